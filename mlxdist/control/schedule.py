"""Learning-rate schedule as a pure function of the step.

A pure function (rather than a stateful scheduler object) means resuming from a
checkpoint needs only the step number, and every rank computes the same value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("cosine", "linear", "constant")


def lr_at(
    step: int,
    *,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.1,
    kind: str = "cosine",
    scale: float = 1.0,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warmup is ``base_lr * (step + 1) / warmup_steps`` so step 0 already trains
    (a zero LR would waste a step) and the last warmup step reaches ``base_lr``.
    After warmup the LR decays to ``min_lr_ratio * base_lr`` at ``total_steps``
    and stays flat after that, so running past the planned length is safe.
    ``scale`` multiplies the result; a rollback uses it to retry more gently
    without changing the shape of the schedule.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {KINDS}")
    if step < 0 or warmup_steps < 0 or total_steps < 0:
        raise ValueError("step, warmup_steps and total_steps must be >= 0")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps * scale
    if kind == "constant":
        return base_lr * scale
    min_lr = base_lr * min_lr_ratio
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "cosine":
        lr = min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        lr = base_lr - (base_lr - min_lr) * progress
    return lr * scale


@dataclass(frozen=True)
class LRSchedule:
    """The schedule's settings bundled once, so the loop only passes the step."""

    base_lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1
    kind: str = "cosine"

    def __call__(self, step: int, scale: float = 1.0) -> float:
        return lr_at(
            step,
            base_lr=self.base_lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
            kind=self.kind,
            scale=scale,
        )
