"""The global sample stream and how one step of it is split across ranks.

Position p of the stream (p counts samples since the run began) maps to a dataset index
through a per-epoch permutation seeded by (seed, epoch). Nothing depends on how many ranks
there are or how the step is split, so rebalancing or resuming on fewer nodes neither
drops nor repeats a sample.
"""

from __future__ import annotations

import numpy as np


class GlobalSampler:
    def __init__(self, n_samples: int, seed: int):
        self.n = n_samples
        self.seed = seed
        self._cache: tuple[int, np.ndarray | None] = (-1, None)

    def _permutation(self, epoch: int) -> np.ndarray:
        cached = self._cache  # one tuple: two prefetch threads never see a torn update
        if cached[0] != epoch:
            cached = (epoch, np.random.default_rng((self.seed, epoch)).permutation(self.n))
            self._cache = cached
        return cached[1]

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of stream positions [start, start + count)."""
        out = np.empty(count, dtype=np.int64)
        pos, filled = start, 0
        while filled < count:
            epoch, offset = divmod(pos, self.n)
            take = min(count - filled, self.n - offset)
            out[filled : filled + take] = self._permutation(epoch)[offset : offset + take]
            filled += take
            pos += take
        return out


def rank_slice(shares: list[int], rank: int) -> tuple[int, int]:
    """[begin, end) of a step's samples that `rank` owns, given every rank's share."""
    begin = sum(shares[:rank])
    return begin, begin + shares[rank]

