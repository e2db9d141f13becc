"""The primitives `Optimizer.update` is written over, defined here in numpy (the reference: the
MLX namespace is this one over `mlx.core`; torch's runs them in place, `torch_ops`)."""

from __future__ import annotations

from typing import Any

import numpy as np

_np: Any = np


def bind(xp: Any) -> dict[str, Any]:
    """The primitives over the array module `xp` (numpy or mlx.core), as plain functions."""

    def scale_(x, c):
        return x * c

    def div(x, c):
        return x / c

    def add_(x, c):
        return x + c

    def sqrt_(x):
        return xp.sqrt(x)

    def sign_(x):
        return xp.sign(x)

    def mix(a, b, beta):
        """beta a + (1 - beta) b (torch: a lerp, equal to rounding)."""
        return beta * a + (1 - beta) * b

    def ema_(acc, x, beta):
        """`mix` into acc."""
        return beta * acc + (1 - beta) * x

    def ema_square_(acc, x, beta):
        return beta * acc + (1 - beta) * xp.square(x)

    def decay_(p, rate, mask):
        """p (1 - rate) where `mask` (a bool, or an array of p's shape), p elsewhere."""
        return xp.where(mask, p * (1 - rate), p)

    def descend_(p, lr, num, den=None, bc=None):
        """p - lr (num / bc) / den (without den or bc: those divisions left out)."""
        num = num if bc is None else num / bc
        return p - lr * num if den is None else p - lr * num / den

    return {f.__name__: f for f in (scale_, div, add_, sqrt_, sign_, mix, ema_, ema_square_, decay_, descend_)}


globals().update(bind(_np))
