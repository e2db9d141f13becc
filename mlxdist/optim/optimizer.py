"""What every optimizer in `OPTIMIZERS` is: see the package's docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Optimizer:
    """Hyper-parameters as fields; `update` the math, over `xp`'s primitives and operators.

    `scalars(lr, t, coef)` are the per-step numbers, computed once in Python (float64) and handed
    to `update` as one sequence (the MLX engine passes them as one array, so its compiled update
    is not traced again each step): whatever depends on the update count `t` belongs there."""

    name: ClassVar[str]
    title: ClassVar[str]  # as banners print it
    state_names: ClassVar[tuple[str, ...]]  # fp32 arrays of the parameter's shape, one per name

    @classmethod
    def from_config(cls, train: Any) -> Optimizer:
        raise NotImplementedError

    @property
    def state_bytes(self) -> int:
        """Bytes of state per trained parameter (fp32): what the memory plan counts."""
        return 4 * len(self.state_names)

    def scalars(self, lr: float, t: int, coef: float) -> list[float]:
        """Update `t`'s numbers (t counts from 1); `coef` scales the gradient (clipping)."""
        raise NotImplementedError

    def update(self, xp: Any, p: Any, g: Any, state: tuple, s: Any, decay: Any) -> tuple[Any, tuple]:
        """(new p, new state) from the weights `p`, gradient `g` (of the mean loss, unclipped),
        `state` (in `state_names` order) and `s` = `scalars(...)`; decoupled weight decay where
        `decay` (a bool, a list of them, or a mask of p's shape). Written over `xp`'s primitives
        only (`numpy_ops` defines each); one ending in `_` may overwrite its first argument (torch
        does, in place), so the formula never reads that argument again."""
        raise NotImplementedError
