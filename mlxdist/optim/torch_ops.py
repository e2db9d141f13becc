"""The primitives of `Optimizer.update` in torch (`numpy_ops` defines them), in place, on single
tensors and on `Many`.

`Many` holds a list of tensors (every trained parameter) and runs each primitive as one
`torch._foreach_*` call, as torch's own multi-tensor optimizers do: a kernel per operation for
all parameters, not one each, and in place where the primitive may overwrite (a trailing `_`),
so AdamW makes about as many passes over memory as `torch.optim.AdamW(foreach=True)`. A plain
tensor (a rank's flat shard) runs the same kernels one tensor at a time.
"""

from __future__ import annotations

from typing import Any

import torch


class Many:
    """Tensors a primitive treats as one."""

    __slots__ = ("items",)

    def __init__(self, items: list[torch.Tensor]):
        self.items = list(items)


def scale_(x: Any, c: float) -> Any:
    if c == 1.0:  # x * 1 is x, bit for bit
        return x
    if isinstance(x, Many):
        torch._foreach_mul_(x.items, c)
        return x
    return x.mul_(c)


def div(x: Any, c: float) -> Any:
    return Many(torch._foreach_div(x.items, c)) if isinstance(x, Many) else x / c


def add_(x: Any, c: float) -> Any:
    if isinstance(x, Many):
        torch._foreach_add_(x.items, c)
        return x
    return x.add_(c)


def sqrt_(x: Any) -> Any:
    if isinstance(x, Many):
        torch._foreach_sqrt_(x.items)
        return x
    return x.sqrt_()


def sign_(x: Any) -> Any:
    if isinstance(x, Many):
        torch._foreach_sign_(x.items)
        return x
    return x.sign_()


def mix(a: Any, b: Any, beta: float) -> Any:
    """A lerp (one pass; equal to `numpy_ops.mix` to rounding), as `torch.optim.AdamW` does."""
    if isinstance(a, Many):
        return Many(torch._foreach_lerp(a.items, b.items, 1 - beta))
    return torch.lerp(a, b, 1 - beta)


def ema_(acc: Any, x: Any, beta: float) -> Any:
    if isinstance(acc, Many):
        torch._foreach_lerp_(acc.items, x.items, 1 - beta)
        return acc
    return acc.lerp_(x, 1 - beta)


def ema_square_(acc: Any, x: Any, beta: float) -> Any:
    if isinstance(acc, Many):
        torch._foreach_mul_(acc.items, beta)
        torch._foreach_addcmul_(acc.items, x.items, x.items, value=1 - beta)
        return acc
    return acc.mul_(beta).addcmul_(x, x, value=1 - beta)


def decay_(p: Any, rate: float, mask: Any) -> Any:
    """`mask`: a bool, one per tensor of a `Many`, or a bool tensor of p's shape."""
    if isinstance(mask, bool):
        mask = [mask] * len(p.items) if isinstance(p, Many) else mask
    if isinstance(p, Many):
        chosen = [t for t, d in zip(p.items, mask, strict=True) if d]
        if chosen:
            torch._foreach_mul_(chosen, 1 - rate)
        return p
    if isinstance(mask, bool):
        return p.mul_(1 - rate) if mask else p
    return p.mul_(torch.where(mask, 1 - rate, 1.0))


def descend_(p: Any, lr: float, num: Any, den: Any = None, bc: float | None = None) -> Any:
    step = -lr if bc is None else -lr / bc
    if isinstance(p, Many):
        if den is None:
            torch._foreach_add_(p.items, num.items, alpha=step)
        else:
            torch._foreach_addcdiv_(p.items, num.items, den.items, value=step)
        return p
    return p.add_(num, alpha=step) if den is None else p.addcdiv_(num, den, value=step)
