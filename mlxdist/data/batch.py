"""What one micro-batch is, and which micro-batches a rank gets in a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..control.split import micro_batches
from .sampler import GlobalSampler, rank_slice

if TYPE_CHECKING:
    from ..control.step_plan import StepPlan


@dataclass
class TokenBatch:
    """int32 windows `tokens` [b, T+1] (inputs are [:, :-1], targets [:, 1:]) and, for
    instruction data, `mask` [b, T]: which targets the loss counts (prompt and padding
    do not). Without a mask every target counts."""

    tokens: np.ndarray
    mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def trained_tokens(self) -> int:
        t = self.tokens
        return int(self.mask.sum()) if self.mask is not None else int(t.shape[0] * (t.shape[1] - 1))

    @classmethod
    def of(cls, batch: TokenBatch | np.ndarray) -> TokenBatch:
        """Datasets may hand back bare token arrays; everything past them sees a TokenBatch."""
        return batch if isinstance(batch, TokenBatch) else cls(np.asarray(batch, np.int32))

    @classmethod
    def concat(cls, batches: list[TokenBatch]) -> TokenBatch:
        masks = [b.mask for b in batches]
        mask = None if all(m is None for m in masks) else np.concatenate(
            [m if m is not None else np.ones((len(b), b.tokens.shape[1] - 1), bool)
             for b, m in zip(batches, masks, strict=True)])
        return cls(np.concatenate([b.tokens for b in batches]), mask)

    def split(self, sizes: list[int]) -> list[TokenBatch]:
        out, offset = [], 0
        for n in sizes:
            sl = slice(offset, offset + n)
            out.append(TokenBatch(self.tokens[sl], None if self.mask is None else self.mask[sl]))
            offset += n
        return out


class BatchMaker:
    """Turns (stream position, plan, rank) into this rank's micro-batches for one step.
    `make(indices)` collates dataset indices into one batch (the task's `make_batch`); the
    indices are `StreamIndices` that carry their stream positions (each sample's key to its
    augmentation and seeds) through the split and an out-of-memory re-split."""

    def __init__(self, make: Callable[[np.ndarray], Any], sampler: GlobalSampler, rank: int):
        self.make, self.sampler, self.rank = make, sampler, rank

    def __call__(self, position: int, plan: StepPlan) -> list:
        begin, end = rank_slice(plan.shares, self.rank)
        return self.split(self.sampler.indices(position + begin, end - begin), plan.micro[self.rank])

    def split(self, indices: np.ndarray, micro: int) -> list:
        """The same samples in micro-batches of at most `micro` (also after an out-of-memory)."""
        out, offset = [], 0
        for n in micro_batches(len(indices), micro):
            out.append(self.make(indices[offset : offset + n]))
            offset += n
        return out
