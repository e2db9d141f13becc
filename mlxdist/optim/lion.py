"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an
interpolated momentum, one moment per parameter (half of AdamW's state), decoupled weight
decay. Its steps are all of size lr, so it wants a learning rate 3-10x below AdamW's (and a
weight decay as much higher): `train.lr` and `train.weight_decay` are taken as given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .optimizer import Optimizer


@dataclass(frozen=True)
class Lion(Optimizer):
    name: ClassVar[str] = "lion"
    title: ClassVar[str] = "Lion"
    state_names: ClassVar[tuple[str, ...]] = ("m",)

    beta1: float = 0.9  # the update's interpolation (the paper's defaults, not train.beta1/beta2: AdamW's)
    beta2: float = 0.99  # the moment's decay
    weight_decay: float = 0.1

    @classmethod
    def from_config(cls, train: Any) -> Lion:
        return cls(weight_decay=train.weight_decay)

    def scalars(self, lr: float, t: int, coef: float) -> list[float]:
        return [lr, coef]

    def update(self, xp: Any, p: Any, g: Any, state: tuple, s: Any, decay: Any) -> tuple[Any, tuple]:
        (m,) = state
        lr, coef = s[0], s[1]
        g = xp.scale_(g, coef)
        direction = xp.sign_(xp.mix(m, g, self.beta1))
        p = xp.decay_(p, lr * self.weight_decay, decay)
        p = xp.descend_(p, lr, direction)
        m = xp.ema_(m, g, self.beta2)
        return p, (m,)
