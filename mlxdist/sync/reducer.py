"""The framework-free half of gradient sync: bucket planning, the one-rank reducer, stats.

Kept apart from `grad.py` (MLX arrays) so the PyTorch engine runs where MLX cannot be installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0
    overlapped: int = 0  # buckets sent before backward ended


def plan_buckets(sizes: list[int], bucket_elems: int) -> list[list[int]]:
    """Group consecutive arrays into buckets of at most `bucket_elems` (a large one stands alone)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        if current and filled + n > bucket_elems:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        buckets.append(current)
    return buckets


class Reducer:
    """The data plane's sum of a step's gradient arrays over the ranks, as data parallel holds
    it. A reducer with state of its own (a lossy wire's error-feedback residuals) says so with
    `keeps_rank_state`; data parallel then keeps that state in the rank's checkpoint file."""

    keeps_rank_state = False

    def arm(self, gradients) -> None:
        """Before a step's last backward (reducers that overlap start sending then): the
        gradients as backward finishes them (`engine.base.GradientFeed`), where the engine
        offers them (`capabilities.overlap`)."""

    def all_sum(self, arrays: list) -> tuple[list, SyncStats]:
        raise NotImplementedError

    def rank_state(self) -> dict[str, np.ndarray]:
        """This rank's own state, for its rank file."""
        return {}

    def load_rank_state(self, arrays: dict[str, np.ndarray] | None) -> None:
        """The state `rank_state` saved, or None: start afresh."""


class Unreduced(Reducer):
    """One rank, or an engine whose arrays stay its own: the sum over ranks is the array."""

    def all_sum(self, arrays: list) -> tuple[list, SyncStats]:
        return arrays, SyncStats()
