"""AdamW (Loshchilov & Hutter): bias-corrected moments, decoupled weight decay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .optimizer import Optimizer


@dataclass(frozen=True)
class AdamW(Optimizer):
    name: ClassVar[str] = "adamw"
    title: ClassVar[str] = "AdamW"
    state_names: ClassVar[tuple[str, ...]] = ("m", "v")

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    @classmethod
    def from_config(cls, train: Any) -> AdamW:
        return cls(train.beta1, train.beta2, train.eps, train.weight_decay)

    def scalars(self, lr: float, t: int, coef: float) -> list[float]:
        return [lr, 1 - self.beta1**t, 1 - self.beta2**t, coef]

    def update(self, xp: Any, p: Any, g: Any, state: tuple, s: Any, decay: Any) -> tuple[Any, tuple]:
        m, v = state
        lr, bc1, bc2, coef = s[0], s[1], s[2], s[3]
        g = xp.scale_(g, coef)
        m = xp.ema_(m, g, self.beta1)
        v = xp.ema_square_(v, g, self.beta2)
        p = xp.decay_(p, lr * self.weight_decay, decay)
        p = xp.descend_(p, lr, m, xp.add_(xp.sqrt_(xp.div(v, bc2)), self.eps), bc1)
        return p, (m, v)
