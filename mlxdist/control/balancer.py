"""Rebalance per-rank shares of the global batch toward measured speed.

Every rank runs an identical balancer on identical all-gathered numbers, so all
ranks reach the same decision without extra communication. This only holds if
every rank calls ``observe`` at the same steps with the same lists.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .split import proportional_split


class LoadBalancer:
    """Give faster ranks more samples so all ranks finish compute together.

    The input must be each rank's own compute time (forward/backward), never wall
    time that includes waiting for peers: a fast rank that waits would look slow,
    and the split would chase its own shadow.

    A rank's rate is the median of its last ``window`` samples-per-second readings
    taken under the current split, so a step hit by a neighbour's burst of load (or
    a garbage collection) cannot move work around; a decision needs
    ``min_observations`` readings from every rank. A new split is adopted only if
    it shortens the predicted step (the slowest rank's compute) by more than
    ``hysteresis``: below that, moving work costs more (new shapes, a restarted
    prefetch) than it saves. A split that moves work back toward the one just left
    must clear ``return_margin`` times that threshold, so noise that alternates
    cannot make the cluster flip between two splits. The first ``warmup``
    observations, and the first ``warmup`` after each change, are discarded: they
    include compilation and allocation for the new shapes.
    """

    def __init__(
        self,
        global_batch: int,
        n_ranks: int,
        hysteresis: float = 0.05,
        min_share: int = 1,
        interval: int = 1,
        warmup: int = 2,
        initial_shares: list[int] | None = None,
        window: int = 5,
        min_observations: int = 3,
        return_margin: float = 3.0,
    ) -> None:
        if n_ranks < 1 or global_batch < n_ranks * min_share:
            raise ValueError(
                f"global_batch {global_batch} cannot give {n_ranks} ranks {min_share} each"
            )
        if hysteresis < 0 or interval < 1 or warmup < 0 or return_margin < 1:
            raise ValueError("need hysteresis >= 0, interval >= 1, warmup >= 0, return_margin >= 1")
        if not 1 <= min_observations <= window:
            raise ValueError(f"need 1 <= min_observations ({min_observations}) <= window ({window})")
        self.global_batch, self.n_ranks = global_batch, n_ranks
        self.hysteresis, self.return_margin = hysteresis, return_margin
        self.min_share, self.interval, self.warmup = min_share, interval, warmup
        self.window, self.min_observations = window, min_observations
        if initial_shares is None:
            initial_shares = proportional_split(global_batch, [1.0] * n_ranks, min_share)
        if len(initial_shares) != n_ranks or sum(initial_shares) != global_batch:
            raise ValueError(
                f"initial_shares {initial_shares} must have {n_ranks} entries summing to {global_batch}"
            )
        self._shares = list(initial_shares)
        self._readings: list[list[float]] = [[] for _ in range(n_ranks)]  # samples/s, newest last
        self._left: list[int] | None = None  # the split the last change moved away from
        self._settle = warmup
        self.changes = 0

    @property
    def shares(self) -> list[int]:
        return list(self._shares)

    @property
    def rates(self) -> list[float | None]:
        """Smoothed samples/s per rank (None until a reading under this split exists)."""
        return [statistics.median(r) if r else None for r in self._readings]

    def predicted_step_time(self, shares: list[int], rates: list[float | None] | None = None) -> float:
        """Compute time of the slowest rank: the step waits for it at the all-reduce."""
        rates = self.rates if rates is None else rates
        if any(r is None for r in rates):
            raise ValueError("no rate measured yet for some rank")
        return max(s / r for s, r in zip(shares, rates, strict=True))  # type: ignore[operator]

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
        for readings, n, sec in zip(self._readings, samples, compute_seconds, strict=True):
            if n > 0 and sec > 0 and math.isfinite(sec):
                readings.append(n / sec)
                del readings[: -self.window]
        if step % self.interval != 0 or any(len(r) < self.min_observations for r in self._readings):
            return None
        rates = self.rates
        proposal = proportional_split(self.global_batch, rates, self.min_share)  # type: ignore[arg-type]
        if proposal == self._shares:
            return None
        gain = 1 - self.predicted_step_time(proposal, rates) / self.predicted_step_time(self._shares, rates)
        if gain <= self.hysteresis * (self.return_margin if self._moves_back(proposal) else 1):
            return None
        self._left, self._shares = self._shares, proposal
        self._readings = [[] for _ in range(self.n_ranks)]  # rates at the old split are stale
        self._settle = self.warmup
        self.changes += 1
        return self.shares

    def _moves_back(self, proposal: list[int]) -> bool:
        """Whether `proposal` shifts work back toward the split the last change left."""
        if self._left is None:
            return False
        return sum((p - c) * (o - c) for p, c, o in zip(proposal, self._shares, self._left, strict=True)) > 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "shares": self.shares,
            "rates": self.rates,
            "readings": [list(r) for r in self._readings],
            "left": None if self._left is None else list(self._left),
            "settle": self._settle,
            "changes": self.changes,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Also reads checkpoints of the EMA balancer, which kept one smoothed rate per rank."""
        shares = [int(s) for s in d["shares"]]
        if len(shares) != self.n_ranks or sum(shares) != self.global_batch:
            raise ValueError(f"balancer state has shares {shares}; this run needs {self.n_ranks} "
                             f"ranks summing to {self.global_batch}")
        self._shares = shares
        if "readings" in d:
            self._readings = [[float(x) for x in r][-self.window :] for r in d["readings"]]
        else:
            self._readings = [[] if r is None else [float(r)] for r in d.get("rates", [None] * self.n_ranks)]
        left = d.get("left")
        self._left = None if left is None else [int(s) for s in left]
        self._settle = int(d.get("settle", self.warmup))
        self.changes = int(d.get("changes", 0))
