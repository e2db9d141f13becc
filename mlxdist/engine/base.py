"""The contract between the training loop and an engine (MLX or PyTorch).

Everything crossing it is numpy or plain Python, so data, checkpoints and controllers
never import a framework. Gradients are of the *summed* token loss: the loop divides by
the global token count once, which is what makes unequal per-rank batches exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class StepStats:
    loss_sum: float  # summed token cross-entropy over the whole cluster's step
    tokens: int  # tokens the loss was summed over (cluster-wide)
    grad_norm: float  # global L2 norm of the averaged gradient, before clipping
    skipped: bool  # True when loss or gradients were non-finite and no update was made
    sync_seconds: float = 0.0
    sync_bytes: int = 0

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)


class Engine(Protocol):
    name: str
    device: str

    def get_weights(self) -> dict[str, np.ndarray]:
        """fp32 master weights by parameter name."""

    def set_weights(self, weights: dict[str, np.ndarray]) -> None: ...

    def get_optimizer_state(self) -> tuple[dict[str, np.ndarray], int]:
        """AdamW moments as `m.<param>` / `v.<param>` fp32 arrays, and the update count."""

    def set_optimizer_state(self, state: dict[str, np.ndarray], step: int) -> None: ...

    def micro_step(self, tokens: np.ndarray) -> None:
        """Forward+backward on int32 [b, T+1] windows; gradients accumulate until `step`."""

    def step(self, lr: float) -> StepStats:
        """Average accumulated gradients over all ranks' tokens, clip, and apply AdamW."""

    def discard_gradients(self) -> None:
        """Forget gradients accumulated since the last `step` (retry after out-of-memory)."""

    def clear_cache(self) -> None:
        """Return cached allocator memory to the system."""

    def eval_loss(self, tokens: np.ndarray) -> tuple[float, int]:
        """(summed loss, token count) without touching gradients."""

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 logits [b, T, vocab] for int32 tokens [b, T]."""
