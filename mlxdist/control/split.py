"""How one optimizer step's ``global_batch`` samples are divided among ranks.

Rank ``r`` processes ``share[r]`` samples in micro-batches of at most
``micro[r]`` (its memory limit), so the global batch - and therefore the
optimisation itself - does not depend on how fast or how big each node is.
"""

from __future__ import annotations

import math
from typing import Any


class AccumulationError(ValueError):
    """Raised when the global batch cannot be reached within the accumulation limit."""


def proportional_split(total: int, weights: list[float], minimum: int = 1) -> list[int]:
    """Split ``total`` into integers proportional to ``weights``; sums exactly to ``total``.

    Largest-remainder method: floor every quota, then hand the leftover units to
    the largest fractional parts, ties to the lower rank index, so every rank
    computes the identical split. If ``total >= len(weights) * minimum`` each
    rank then gets at least ``minimum``, taken one unit at a time from the
    largest share (ties: lowest index): a rank with no work would stall on the
    gradient all-reduce anyway, and we could never measure its speed again.
    """
    n = len(weights)
    if n == 0 or total < 0:
        raise ValueError("need at least one weight and total >= 0")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero: {weights}")
    wsum = sum(weights)
    quotas = [total * w / wsum for w in weights]
    shares = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(n), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    if total >= n * minimum:
        for i in range(n):
            while shares[i] < minimum:
                donor = max(range(n), key=lambda j: (shares[j], -j))
                shares[donor] -= 1
                shares[i] += 1
    return shares


def shard_bounds(total: int, budgets: list[float], split: str = "memory") -> list[tuple[int, int]]:
    """[a_r, b_r) of each rank's shard of `total` elements: contiguous ranges in rank order,
    sized by `budgets` (`dist.shard_split=memory`) or equal (`equal`, or a budget unknown: not
    finite, negative, or all zero). The one split the sharded strategies train with and the
    memory plan counts."""
    known = sum(budgets) > 0 and all(math.isfinite(b) and b >= 0 for b in budgets)
    weights = list(budgets) if split == "memory" and known else [1.0] * len(budgets)
    starts = [0]
    for size in proportional_split(total, weights, minimum=1):
        starts.append(starts[-1] + size)
    return [(starts[r], starts[r + 1]) for r in range(len(weights))]


def accumulation_steps(share: list[int], micro: list[int]) -> list[int]:
    """Micro-batches each rank needs this step (0 for a rank with no samples)."""
    if len(share) != len(micro):
        raise ValueError(f"share and micro differ in length: {len(share)} vs {len(micro)}")
    if any(m < 1 for m in micro) or any(s < 0 for s in share):
        raise ValueError("micro sizes must be >= 1 and shares >= 0")
    return [math.ceil(s / m) for s, m in zip(share, micro, strict=True)]


def micro_batches(share_r: int, micro_r: int) -> list[int]:
    """Sizes of one rank's micro-batches, e.g. ``(10, 4) -> [4, 3, 3]``.

    Even-ish rather than greedy (``[4, 4, 2]``): sizes differ by at most one, so
    a step sees at most two nearby shapes instead of an arbitrary small tail,
    which keeps compiled graphs and per-micro-batch memory stable. Gradients
    must still be weighted by micro-batch size (or summed and divided by the
    global batch) because the sizes are not all equal.
    """
    if micro_r < 1 or share_r < 0:
        raise ValueError("micro_r must be >= 1 and share_r >= 0")
    count = math.ceil(share_r / micro_r)
    if count == 0:
        return []
    base, extra = divmod(share_r, count)
    return [base + 1] * extra + [base] * (count - extra)


class AccumulationController:
    """Checks a step plan is feasible before the step runs.

    Too many micro-batches means a step is too slow to be useful (or a rank's
    memory collapsed); failing loudly with the rank named beats a silent stall.
    It holds no state; ``state_dict`` exists so every policy checkpoints alike.
    """

    def __init__(self, global_batch: int, max_accum: int) -> None:
        if global_batch < 1 or max_accum < 1:
            raise ValueError("global_batch and max_accum must be >= 1")
        self.global_batch = global_batch
        self.max_accum = max_accum

    def plan(self, shares: list[int], micro: list[int]) -> list[int]:
        """Accumulation steps per rank; raises AccumulationError if any exceeds max_accum."""
        if sum(shares) != self.global_batch:
            raise ValueError(
                f"shares sum to {sum(shares)}, expected global batch {self.global_batch}"
            )
        steps = accumulation_steps(shares, micro)
        for rank, (k, s, m) in enumerate(zip(steps, shares, micro, strict=True)):
            if k > self.max_accum:
                raise AccumulationError(
                    f"rank {rank}: share {s} at micro-batch {m} needs {k} accumulation steps "
                    f"> max_accum {self.max_accum}; global batch {self.global_batch} is "
                    "unreachable within max accumulation (lower global_batch, raise max_accum, "
                    "or rebalance shares away from this rank)"
                )
        return steps

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        pass
