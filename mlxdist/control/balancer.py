"""Rebalance per-rank shares of the global batch toward measured speed.

Every rank runs an identical balancer on identical all-gathered numbers, so all
ranks reach the same decision without extra communication. This only holds if
every rank calls ``observe`` at the same steps with the same lists.
"""

from __future__ import annotations

import math
from typing import Any

from .split import proportional_split


class LoadBalancer:
    """Give faster ranks more samples so all ranks finish compute together.

    Rates are smoothed with an EMA (``smoothing`` is the weight kept by the old
    value) so one noisy step cannot move work around. A new split is adopted
    only if it shortens the predicted step by more than ``hysteresis``; below
    that, moving work costs more (new shapes, recompiles) than it saves. The
    first ``warmup`` observations, and the first ``warmup`` after each change,
    are discarded: they include compilation for the new shapes.
    """

    def __init__(
        self,
        global_batch: int,
        n_ranks: int,
        smoothing: float = 0.5,
        hysteresis: float = 0.05,
        min_share: int = 1,
        interval: int = 1,
        warmup: int = 2,
        initial_shares: list[int] | None = None,
    ) -> None:
        if n_ranks < 1 or global_batch < n_ranks * min_share:
            raise ValueError(
                f"global_batch {global_batch} cannot give {n_ranks} ranks {min_share} each"
            )
        if not 0 <= smoothing < 1 or hysteresis < 0 or interval < 1 or warmup < 0:
            raise ValueError("need 0 <= smoothing < 1, hysteresis >= 0, interval >= 1, warmup >= 0")
        self.global_batch, self.n_ranks = global_batch, n_ranks
        self.smoothing, self.hysteresis = smoothing, hysteresis
        self.min_share, self.interval, self.warmup = min_share, interval, warmup
        if initial_shares is None:
            initial_shares = proportional_split(global_batch, [1.0] * n_ranks, min_share)
        if len(initial_shares) != n_ranks or sum(initial_shares) != global_batch:
            raise ValueError(
                f"initial_shares {initial_shares} must have {n_ranks} entries summing to {global_batch}"
            )
        self._shares = list(initial_shares)
        self.rates: list[float | None] = [None] * n_ranks  # smoothed samples/s
        self._settle = warmup
        self.changes = 0

    @property
    def shares(self) -> list[int]:
        return list(self._shares)

    def predicted_step_time(self, shares: list[int]) -> float:
        """Compute time of the slowest rank: the step waits for it at the all-reduce."""
        if any(r is None for r in self.rates):
            raise ValueError("no rate measured yet for some rank")
        return max(s / r for s, r in zip(shares, self.rates, strict=True))  # type: ignore[operator]

    def observe(
        self, step: int, samples: list[int], compute_seconds: list[float]
    ) -> list[int] | None:
        """Feed one step's per-rank samples and compute time (no sync, no data wait).

        Returns new shares to use from the next step on, or None to keep them.
        """
        if len(samples) != self.n_ranks or len(compute_seconds) != self.n_ranks:
            raise ValueError(
                f"expected {self.n_ranks} entries, got {len(samples)} and {len(compute_seconds)}"
            )
        if self._settle > 0:
            self._settle -= 1
            return None
        for r, (n, sec) in enumerate(zip(samples, compute_seconds, strict=True)):
            if n > 0 and sec > 0 and math.isfinite(sec):
                old = self.rates[r]
                rate = n / sec
                self.rates[r] = (
                    rate if old is None else self.smoothing * old + (1 - self.smoothing) * rate
                )
        if step % self.interval != 0 or any(r is None for r in self.rates):
            return None
        proposal = proportional_split(self.global_batch, self.rates, self.min_share)  # type: ignore[arg-type]
        if proposal == self._shares:
            return None
        if self.predicted_step_time(proposal) >= self.predicted_step_time(self._shares) * (
            1 - self.hysteresis
        ):
            return None
        self._shares = proposal
        self._settle = self.warmup
        self.changes += 1
        return self.shares

    def state_dict(self) -> dict[str, Any]:
        return {
            "shares": self.shares,
            "rates": list(self.rates),
            "settle": self._settle,
            "changes": self.changes,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._shares = [int(s) for s in d["shares"]]
        self.rates = [None if r is None else float(r) for r in d["rates"]]
        self._settle = int(d["settle"])
        self.changes = int(d["changes"])
