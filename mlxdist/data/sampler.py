"""The global sample stream and how one step of it is split across ranks.

Position p of the stream (p counts samples since the run began) maps to a dataset index
through a per-epoch permutation seeded by (seed, epoch). Nothing depends on how many ranks
there are or how the step is split, so rebalancing or resuming on fewer nodes neither
drops nor repeats a sample.

The position is also each sample's key to randomness: `Task.augment` draws from
`position_rng(seed, position)` and the model from `position_seeds(seed, positions)`, so a
sample is augmented and dropped out the same way on any rank, in any split, after a resume.
The sampler hands out `StreamIndices`: dataset indices that carry their positions.
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

    def indices(self, start: int, count: int) -> StreamIndices:
        """Dataset indices of stream positions [start, start + count), which they carry."""
        out = np.empty(count, dtype=np.int64)
        pos, filled = start, 0
        while filled < count:
            epoch, offset = divmod(pos, self.n)
            take = min(count - filled, self.n - offset)
            out[filled : filled + take] = self._permutation(epoch)[offset : offset + take]
            filled += take
            pos += take
        return StreamIndices(out, np.arange(start, start + count), self.seed)


def rank_slice(shares: list[int], rank: int) -> tuple[int, int]:
    """[begin, end) of a step's samples that `rank` owns, given every rank's share."""
    begin = sum(shares[:rank])
    return begin, begin + shares[rank]


TRAIN, EVAL = 0, 1  # the two streams: training positions, and evaluation windows


class StreamIndices(np.ndarray):
    """Dataset indices that know where they stand in the sample stream: `positions[i]` is the
    stream position of `self[i]`, `seed` is `train.seed`, `stream` TRAIN or EVAL. Slicing and
    `np.concatenate` keep them (a rank's share, its micro-batches, an out-of-memory re-split);
    arithmetic and reductions give plain arrays."""

    positions: np.ndarray | None
    seed: int
    stream: int

    def __new__(cls, indices, positions, seed: int, stream: int = TRAIN) -> StreamIndices:
        out = np.asarray(indices, np.int64).view(cls)
        out.positions = np.asarray(positions, np.int64)
        if out.positions.shape != out.shape or out.ndim != 1:
            raise ValueError(f"{out.shape} indices with {out.positions.shape} positions")
        out.seed, out.stream = int(seed), int(stream)
        return out

    def __array_finalize__(self, obj) -> None:
        self.positions = None
        self.seed, self.stream = getattr(obj, "seed", 0), getattr(obj, "stream", TRAIN)

    def __getitem__(self, key):
        out = super().__getitem__(key)
        if isinstance(out, StreamIndices) and self.positions is not None and out.ndim == 1:
            out.positions = self.positions[key]
        return out

    def __array_wrap__(self, out, context=None, return_scalar=False):
        out = out.view(np.ndarray)
        return out[()] if return_scalar else out

    def __array_function__(self, func, types, args, kwargs):
        if func is np.concatenate and not kwargs and len(args) == 1:
            parts = list(args[0])
            if parts and all(isinstance(p, StreamIndices) and p.positions is not None
                             and (p.seed, p.stream) == (parts[0].seed, parts[0].stream) for p in parts):
                return StreamIndices(np.concatenate([p.view(np.ndarray) for p in parts]),
                                     np.concatenate([p.positions for p in parts]), parts[0].seed, parts[0].stream)
        return super().__array_function__(func, types, args, kwargs)


def stream_of(indices) -> StreamIndices:
    """`indices` as StreamIndices; plain indices stand at positions equal to themselves, seed 0."""
    if isinstance(indices, StreamIndices) and indices.positions is not None:
        return indices
    idx = np.asarray([int(i) for i in indices], np.int64)
    return StreamIndices(idx, idx, 0)


def position_rng(seed: int, position: int, stream: int = TRAIN) -> np.random.Generator:
    """The generator `Task.augment` gets for the sample at `position`: `default_rng([seed, position])`
    in training, `default_rng([seed, position, 1])` for evaluation window slot `position`."""
    return np.random.default_rng([int(seed), int(position)] + ([int(stream)] if stream else []))


_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def position_seeds(seed: int, positions, stream: int = TRAIN) -> np.ndarray:
    """One uint64 per position, a hash of (seed, stream, position): `Batch.seeds`, the seeds a
    model's own randomness (dropout) draws from through `mlxdist.tasks.sample_seeds()`."""
    key = _mix(np.array([int(seed) * 2 + int(stream)], np.uint64) * _GOLDEN + _GOLDEN)
    return _mix(key ^ (np.asarray(positions, np.int64).astype(np.uint64) * _GOLDEN))
