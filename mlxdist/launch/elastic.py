"""Elastic runs, the decisions: which hosts go on, from which checkpoint, and when to stop trying.

`launch/mlxrun --elastic` restarts a failed job on the hosts that still answer. Every choice it
makes is here, as plain functions of what it observed (the failed job's exit code and last
step, each host's probe), so the policy is unit-tested without MPI, hosts or files; the
orchestration that gathers the observations lives in `elastic_run.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..markers import Exit

# A failure that a restart on the survivors can cure. A rank that raised while every host
# still answers (a bug, a bad file) would fail again: that ends the run instead.
_HOST_FAILURES = {Exit.STALLED: "stall", Exit.HOST_LOST: "host lost", Exit.FAILED: "job failed"}


@dataclass(frozen=True)
class ElasticSettings:
    min_hosts: int = 1
    max_restarts: int = 5  # restarts after failures; rejoins do not count
    rejoin: bool = False


@dataclass(frozen=True)
class Copy:
    """A checkpoint that verified (sha256) on the host that reported it."""

    host: str  # hostfile entry of that host
    path: str
    step: int
    global_batch: int | None = None


@dataclass(frozen=True)
class Probe:
    """What one host said when asked (or that it did not answer, and why)."""

    host: str  # hostfile entry
    answered: bool
    name: str = ""  # the host's own name (what ranks and `nodes:` see)
    newest: Copy | None = None
    why: str = ""  # why it does not count as answering
    unusable: tuple[str, ...] = ()  # newer copies that failed verification, with the reason

    @property
    def label(self) -> str:
        return f"{self.host} ({self.name})" if self.name and self.name != self.host else self.host


@dataclass(frozen=True)
class Restart:
    hosts: list[str]  # hostfile entries in rank order: the holder of `resume` first
    resume: Copy | None
    steps_lost: int
    dropped: list[str]


@dataclass(frozen=True)
class GiveUp:
    message: str
    code: Exit = Exit.GAVE_UP


def failure_reason(code: Exit) -> str | None:
    """A short reason word for a failed job that may be restarted; None if it must not be."""
    return _HOST_FAILURES.get(code)


def worth_restarting(code: Exit, probes: Sequence[Probe]) -> bool:
    """Stalls and lost hosts always; a plain failure only when some host stopped answering
    (its ranks died with it), never when every host is fine (the error would repeat)."""
    if code in (Exit.STALLED, Exit.HOST_LOST):
        return True
    return code == Exit.FAILED and not all(p.answered for p in probes)


def newest_copy(probes: Sequence[Probe]) -> Copy | None:
    """The newest checkpoint that verified on a host that answers; on a tie, the first host
    in order (the current rank 0's, so a restart moves as little as possible)."""
    best = None
    for p in probes:
        if p.answered and p.newest is not None and (best is None or p.newest.step > best.step):
            best = p.newest
    return best


def plan_restart(settings: ElasticSettings, probes: Sequence[Probe], *, last_step: int,
                 failures_so_far: int, after_failure: bool) -> Restart | GiveUp:
    """Hosts and checkpoint for the next job, or why there is none.

    `probes` lists every candidate host in its current order (the failed job's hosts, then
    any rejoining); `last_step` is the last step the failed job completed."""
    alive = [p for p in probes if p.answered]
    lost = [p for p in probes if not p.answered]
    copy = newest_copy(probes)
    kept = (f"checkpoints are kept; newest whole one: step {copy.step} ({copy.path} on {copy.host})"
            if copy else "no whole checkpoint was found on the hosts that answer")
    if len(alive) < settings.min_hosts:
        gone = "; ".join(f"{p.label}: {p.why or 'no answer'}" for p in lost)
        return GiveUp(f"elastic: only {len(alive)} of {len(probes)} hosts answer ({gone}), fewer than "
                      f"--min-hosts {settings.min_hosts}; not restarting. Bring a host back and run the "
                      f"same command with --resume auto; {kept}")
    if after_failure and failures_so_far >= settings.max_restarts:
        return GiveUp(f"elastic: --max-restarts {settings.max_restarts} used up; not restarting again. "
                      f"Find the cause above, then run the same command with --resume auto; {kept}")
    order = [p.host for p in alive]
    if copy is not None:
        order.remove(copy.host)
        order.insert(0, copy.host)
    return Restart(hosts=order, resume=copy, steps_lost=max(0, last_step - (copy.step if copy else 0)),
                   dropped=[p.host for p in lost])


def restart_args(restart: Restart) -> list[str]:
    """What the restarted job adds to the user's arguments: resume from the newest whole copy
    (rank 0 is the host holding it, and `--resume auto` searches its copies) and keep the
    checkpoint's global batch, so fewer hosts accumulate more instead of changing the step."""
    args = []
    if restart.resume is not None and restart.resume.global_batch:
        args.append(f"train.global_batch={restart.resume.global_batch}")
    return [*args, "--resume", "auto" if restart.resume is not None else "none"]


@dataclass
class RejoinWatch:
    """When to stop a job so that a host that answers again can rejoin: at the next checkpoint
    written after it came back (no steps lost, no extra checkpoint), or at once when the run
    writes no periodic checkpoints (`immediate`); the stop itself saves one."""

    immediate: bool
    back_at: int | None = None  # checkpoints seen when the first host came back

    def host_back(self, checkpoints_seen: int) -> None:
        if self.back_at is None:
            self.back_at = checkpoints_seen

    def stop_now(self, checkpoints_seen: int) -> bool:
        return self.back_at is not None and (self.immediate or checkpoints_seen > self.back_at)


def restart_line(n: int, reason: str, restart: Restart, probes: Sequence[Probe]) -> str:
    """The supervisor's log line for one restart: reason, hosts, checkpoint, steps lost."""
    by_host = {p.host: p for p in probes}
    hosts = ", ".join(by_host[h].label if h in by_host else h for h in restart.hosts)
    dropped = "; ".join(f"{by_host[h].label}: {by_host[h].why or 'no answer'}" if h in by_host else h
                        for h in restart.dropped)
    src = (f"step {restart.resume.step} ({restart.resume.path} on {restart.resume.host})"
           if restart.resume else "the start (no whole checkpoint)")
    return (f"elastic_restart {n}: reason {reason}; hosts {hosts}" + (f"; dropped {dropped}" if dropped else "")
            + f"; resuming from {src}; steps lost {restart.steps_lost}")
