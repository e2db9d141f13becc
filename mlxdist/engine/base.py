"""The contract between the training loop and an engine (MLX or PyTorch).

Everything crossing it is numpy or plain Python, so data, checkpoints and controllers
never import a framework, and `train.py` never asks which engine it has. Gradients are of
the *summed* token loss: the engine divides by the cluster's trained-token count once,
which is what makes unequal per-rank batches (and masked prompts) exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..data.batch import TokenBatch
from .memory import MemoryReading


@dataclass
class StepStats:
    loss_sum: float  # summed token cross-entropy over the whole cluster's step
    tokens: int  # trained tokens the loss was summed over (cluster-wide)
    grad_norm: float  # global L2 norm of the averaged gradient, before clipping
    skipped: bool  # True when loss or gradients were non-finite and no update was made
    sync_seconds: float = 0.0
    sync_bytes: int = 0
    local: bool = False  # dist.mode=diloco: loss, tokens and norm are this rank's own


    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)


class Engine(Protocol):
    name: str
    device: str
    model_summary: str  # banner line: which model, how many (trainable) parameters
    base_fingerprint: str | None  # of a pretrained base (every rank must train the same one)

    # -- the step ------------------------------------------------------------------
    def micro_step(self, batch: TokenBatch) -> None:
        """Forward+backward; gradients accumulate until `step`."""

    def step(self, lr: float) -> StepStats:
        """Average accumulated gradients over all ranks' trained tokens, clip, apply AdamW."""

    def discard_gradients(self) -> None:
        """Forget gradients accumulated since the last `step` (retry after out-of-memory)."""

    def eval_loss(self, batch: TokenBatch) -> tuple[float, int]:
        """(summed loss, trained-token count) without touching gradients."""

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 logits [b, T, vocab] for int32 tokens [b, T]."""

    def sample(self, prompt: list[int], max_new: int, temperature: float = 0.8, seed: int = 0,
               context: int | None = None, stop: set[int] | None = None,
               on_token: Callable[[int], None] | None = None) -> list[int]:
        """Generated tokens (not the prompt), drawn by `common.sample_tokens`."""

    # -- state (trainable parameters only: a frozen base is fingerprinted, not saved) --
    def get_weights(self) -> dict[str, np.ndarray]:
        """fp32 master weights by parameter name."""

    def set_weights(self, weights: dict[str, np.ndarray]) -> None: ...

    def get_optimizer_state(self) -> tuple[dict[str, np.ndarray], int]:
        """AdamW moments as `m.<param>` / `v.<param>` fp32 arrays, and the update count."""

    def set_optimizer_state(self, state: dict[str, np.ndarray], step: int) -> None: ...

    def broadcast_state(self, root: int = 0) -> None:
        """Make weights, moments and the update count on every rank equal `root`'s
        (no-op on one rank)."""

    def weight_checksum(self) -> int:
        """Bit-exact fingerprint of this rank's weights (equal on all ranks iff they agree)."""

    def save_adapter(self, out_dir: Path) -> Path | None:
        """A fine-tune's adapter in PEFT's layout; None when the whole model trained."""

    # -- machine -------------------------------------------------------------------
    def memory(self) -> MemoryReading:
        """Bytes in use, peak since `reset_peak`, and the limit to stay under."""

    def reset_peak(self) -> None: ...

    def clear_cache(self) -> None:
        """Return cached allocator memory to the system."""

    def describe(self) -> str:
        """One banner line: framework, device, precision, speed settings."""

    # -- fault-injection seams (tests only) ------------------------------------------
    def poison_loss(self) -> None:
        """Make this step's loss non-finite, as a numerical blow-up would."""

    def perturb_weights(self, eps: float = 1e-3) -> None:
        """Make this rank's weights differ, as a silent drift would."""
