"""Who stopped the job: the stall watchdog's verdict, from what the heartbeats saw.

Every rank waiting in a stuck collective looks the same from inside MPI, so naming the
culprit needs facts MPI does not give: when each peer was last heard on the heartbeat
side channel, and how many collectives it has entered (all ranks enter the same
collectives in the same order, so a lower count means "has not got here yet").
Plain Python, no sockets, no MPI: the watchdog feeds it numbers, tests feed it cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class StallVerdict:
    culprits: list[int] = field(default_factory=list)
    reason: str = ""


def _who(rank: int, hosts: Sequence[str]) -> str:
    return f"rank {rank} ({hosts[rank]})" if rank < len(hosts) else f"rank {rank}"


def stall_culprits(now: float, last_seen: Sequence[float | None], progress: Sequence[int | None],
                   hosts: Sequence[str], me: int, stale_after: float, suspended_s: float = 0.0,
                   doing: Sequence[str | None] | None = None) -> StallVerdict:
    """Name the ranks that stopped making progress, most telling evidence first.

    `last_seen[r]`: when rank r's last heartbeat arrived (same clock as `now`; None: never).
    `progress[r]`: collectives rank r had entered by then (`progress[me]`: this rank's own).
    `suspended_s`: how long this rank's own clock jumped past its watchdog tick; a rank that
    was itself asleep must not blame the peers that gave up waiting for it.
    """
    if suspended_s > 0:
        return StallVerdict([me], f"this rank ({hosts[me] if me < len(hosts) else '?'}) was itself "
                                  f"suspended for {suspended_s:.0f}s (system sleep or SIGSTOP); "
                                  "its peers stopped waiting for it")
    peers = [r for r in range(len(last_seen)) if r != me]
    never = [r for r in peers if last_seen[r] is None]
    stale = [r for r in peers if last_seen[r] is not None and now - last_seen[r] > stale_after]
    if stale or never:
        parts = [f"{_who(r, hosts)} for {now - last_seen[r]:.0f}s" for r in stale]  # type: ignore[operator]
        parts += [f"{_who(r, hosts)} ever" for r in never]
        hint = "asleep, crashed or cut off?" if stale else "UDP blocked between hosts, or it never started?"
        return StallVerdict(sorted(stale + never), f"no heartbeat from {', '.join(parts)} ({hint})")
    known = {r: p for r, p in enumerate(progress) if p is not None}
    if known:
        ahead = max(known.values())
        behind = sorted(r for r, p in known.items() if p < ahead)
        if behind:
            def at(r: int) -> str:
                what = doing[r] if doing and r < len(doing) and doing[r] else "computing"
                seen = last_seen[r] if r < len(last_seen) else None
                quiet = f", last heard {now - seen:.0f}s ago" if seen is not None and now - seen >= 1 else ""
                return f"{_who(r, hosts)} at collective #{known[r]} ({what}{quiet})"

            verb = "has" if len(behind) == 1 else "have"
            return StallVerdict(behind, f"{', '.join(at(r) for r in behind)} {verb} not reached collective "
                                        f"#{ahead} that the others wait in (alive but hung or very slow there?)")
    return StallVerdict([], "every rank answers heartbeats and waits in the same collective "
                            "(the data link between hosts is down, or MPI itself hangs)")
