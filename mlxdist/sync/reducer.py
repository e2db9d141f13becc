"""The framework-free half of gradient sync: bucket planning, the one-rank reducer, stats.

Kept apart from `grad.py` (MLX arrays) so the PyTorch engine runs where MLX cannot be installed.
"""

from __future__ import annotations

from dataclasses import dataclass


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


class Unreduced:
    """One rank, or an engine whose arrays stay its own: the sum over ranks is the array."""

    def arm(self, engine) -> None:
        """Before a step's last backward (reducers that overlap start sending then)."""

    def all_sum(self, arrays: list) -> tuple[list, SyncStats]:
        return arrays, SyncStats()
