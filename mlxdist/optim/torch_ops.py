"""The primitives of `Optimizer.update` in torch, on single tensors and on `Many`.

`Many` holds a list of tensors (every trained parameter, or a shard's pieces) and runs each
operator as one `torch._foreach_*` call, so the update written per tensor runs as torch's own
multi-tensor optimizers do, a kernel per operation for all parameters rather than one each.
"""

from __future__ import annotations

from typing import Any

import torch


class Many:
    """Tensors that `+ - * /` elementwise together (with a scalar or another `Many`)."""

    __slots__ = ("items",)

    def __init__(self, items: list[torch.Tensor]):
        self.items = list(items)

    def __add__(self, o: Any) -> Many:
        return Many(torch._foreach_add(self.items, o.items if isinstance(o, Many) else o))

    __radd__ = __add__

    def __sub__(self, o: Any) -> Many:
        return Many(torch._foreach_sub(self.items, o.items if isinstance(o, Many) else o))

    def __rsub__(self, o: Any) -> Many:
        return Many(torch._foreach_add(torch._foreach_neg(self.items), o))

    def __mul__(self, o: Any) -> Many:
        return Many(torch._foreach_mul(self.items, o.items if isinstance(o, Many) else o))

    __rmul__ = __mul__

    def __truediv__(self, o: Any) -> Many:
        return Many(torch._foreach_div(self.items, o.items if isinstance(o, Many) else o))


def sqrt(x: Any) -> Any:
    return Many(torch._foreach_sqrt(x.items)) if isinstance(x, Many) else torch.sqrt(x)


def sign(x: Any) -> Any:
    return Many(torch._foreach_sign(x.items)) if isinstance(x, Many) else torch.sign(x)


def square(x: Any) -> Any:
    return Many(torch._foreach_mul(x.items, x.items)) if isinstance(x, Many) else torch.square(x)


def where(cond: Any, a: Any, b: Any) -> Any:
    """`cond` a bool (all or nothing), one bool per tensor of a `Many`, or a mask tensor."""
    if isinstance(cond, bool):
        return a if cond else b
    if isinstance(a, Many):
        return Many([x if c else y for c, x, y in zip(cond, a.items, b.items, strict=True)])
    return torch.where(cond, a, b)
