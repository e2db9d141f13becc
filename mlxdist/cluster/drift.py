"""Which rank's weights to trust when the drift check finds ranks that disagree.

Copying rank 0 to everyone is wrong exactly when rank 0 is the one that changed. So:
- 3 or more ranks: a strict majority of equal checksums wins; the minority is named.
- otherwise (2 ranks, or a tie): each rank's self-check decides. A rank remembers the
  checksum of its weights right after its last optimizer update and compares it at the
  check; a rank whose weights changed since then (memory corruption, a stray write) is
  the culprit, and the ranks that pass are the source. The self-check only covers the
  time from the update to the check; when it cannot tell (both pass: the updates
  themselves diverged, e.g. different numerics on different machines), no rank is
  blamed and the latest checkpoint is restored, the one state every rank agreed on.
Plain Python on integers (no MLX, so the CLI imports it before choosing an engine): every rank runs it on the same all-gathered numbers, so all
take the same decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DriftVerdict:
    """`source_rank`: broadcast its state to all (also the fallback when restoring finds
    no checkpoint). `drifted_ranks`: the ranks blamed (empty when none can be)."""

    source_rank: int | None
    drifted_ranks: list[int] = field(default_factory=list)
    message: str = ""
    restore_from_checkpoint: bool = False

    @property
    def in_sync(self) -> bool:
        return self.source_rank is None and not self.restore_from_checkpoint


def _names(ranks: Sequence[int], hosts: Sequence[str] | None) -> str:
    def one(r: int) -> str:
        return f"{r} ({hosts[r]})" if hosts and r < len(hosts) else str(r)

    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(one(r) for r in ranks)


def drift_verdict(checksums: Sequence[int], self_ok: Sequence[bool | None] | None = None,
                  hosts: Sequence[str] | None = None) -> DriftVerdict:
    """`self_ok[r]`: rank r's weights still match its post-update checksum (None: unknown)."""
    n = len(checksums)
    if len(set(checksums)) <= 1:
        return DriftVerdict(None)
    groups: dict[int, list[int]] = {}
    for r, c in enumerate(checksums):
        groups.setdefault(c, []).append(r)
    biggest = max(groups.values(), key=len)
    if n >= 3 and len(biggest) * 2 > n:
        minority = [r for r in range(n) if r not in biggest]
        return DriftVerdict(biggest[0], minority,
                            f"weights on {_names(minority, hosts)} differ from the majority "
                            f"({_names(biggest, hosts)}); repaired from rank {biggest[0]}")
    split = " vs ".join(_names(g, hosts) for g in sorted(groups.values()))
    ok = list(self_ok) if self_ok is not None else [None] * n
    failed = [r for r in range(n) if ok[r] is False]
    passed = [r for r in range(n) if ok[r] is True]
    if failed and passed and len({checksums[r] for r in passed}) == 1:
        source = passed[0]
        drifted = [r for r in range(n) if checksums[r] != checksums[source]]
        return DriftVerdict(source, drifted,
                            f"weights disagree ({split}); {_names(failed, hosts)} changed since "
                            f"the last optimizer update (self-check failed); repaired from rank {source}")
    fallback = passed[0] if passed else 0
    return DriftVerdict(fallback, [],
                        f"weights disagree ({split}) and no rank can be shown wrong; "
                        "restoring the latest checkpoint", restore_from_checkpoint=True)


class SelfCheck:
    """Remembers this rank's weight checksum right after the update of a check step."""

    def __init__(self, every: int):
        self.every = every
        self._expected: tuple[int, int] | None = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def remember(self, step: int, checksum: int) -> None:
        self._expected = (step, checksum)

    def verify(self, step: int, checksum: int) -> bool | None:
        """None when this step's post-update checksum was not taken (a skipped or retried step)."""
        if self._expected is None or self._expected[0] != step:
            return None
        return checksum == self._expected[1]
