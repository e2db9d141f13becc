"""Three pieces from outside the package, each one class and one registration, as
docs/architecture.md's "how to add each piece" says; a run takes them with the config key
`plugins: [my_pieces]` (this folder on PYTHONPATH) and chooses them by name:

    dist.mode=local_sgd        ranks step alone, weights averaged by rows every dist.inner_steps steps
    dist.wire_dtype=topk:0.25  data parallel's gradients as their largest quarter, with error feedback
    train.optimizer=sgd_nesterov   SGD with Nesterov momentum (train.beta1 the momentum)

Nothing in mlxdist names them; tests/test_plugins.py trains each through `python -m mlxdist.train`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mlxdist.cluster.codec import Codec, register_codec
from mlxdist.engine.base import local_step
from mlxdist.optim import Optimizer, register_optimizer
from mlxdist.sync.strategy import Strategy, load_rank_files, register, save_rank_file


# -- a strategy ------------------------------------------------------------------------------
@register("local_sgd")
class LocalSGD(Strategy):
    """Each rank steps on its own gradients; every H = dist.inner_steps steps (and at the last)
    the ranks average their weights, each weighted by the rows it trained on since the last
    average. With H = 1 and an optimizer linear in the gradient (SGD, momentum or not), that is
    data parallel's update."""

    ranks_differ = True  # between averages: no train.ema, no train.sync_batchnorm
    gradient_wire = "none"  # it sends weights, not gradients: a compressed dist.wire_dtype is refused
    # shardable stays False: with dist.shard the run is refused, never replaced by ZeRO

    def __init__(self, cfg, world, engine, plan, reducer=None, transport=None):
        self.world, self.hosts, self.transport = world, list(plan.hosts), transport
        self.every, self.steps = cfg.dist.inner_steps, cfg.train.steps
        self.rows = 0  # this rank's rows since the last average
        self.averaged = engine.get_weights()  # the model every rank agrees on

    def describe(self) -> str:
        return f"local SGD: weights averaged by rows every {self.every} steps"

    def step(self, engine, lr):
        return local_step(engine, lr)

    def agree_on_rollback(self, wanted: bool, step: int) -> bool:
        return any(self.world.allgather(wanted))  # each rank saw its own loss

    def after_step(self, engine, step, samples, last):
        self.rows += samples
        if step % self.every and not last:
            return []
        weights = engine.get_weights()
        names = sorted(weights)
        scale = np.float32(self.rows)
        parts = [np.ascontiguousarray(weights[n], np.float32).reshape(-1) * scale for n in names]
        sums = self.transport.all_sum([*parts, np.array([self.rows], np.float32)], "local SGD average",
                                      identical=True)
        total = float(sums[-1][0])
        self.averaged = {n: (s / np.float32(total)).reshape(weights[n].shape) for n, s in zip(names, sums, strict=False)}
        engine.set_weights(self.averaged)
        self.rows = 0
        return []

    def model_weights(self, engine):
        return dict(self.averaged)

    def save_rank_state(self, root: Path, step: int, engine, keep: int) -> None:
        opt, count = engine.get_optimizer_state()
        arrays = {**{f"weights.{k}": v for k, v in engine.get_weights().items()}, **opt,
                  "rank.rows": np.array([self.rows], np.int64)}
        save_rank_file(self.world, self.hosts, root, step, arrays, keep, count)

    def load_state_dict(self, shared, root, step, engine, optimizer_step):
        self.averaged = engine.get_weights()  # the checkpoint's (or the start's) model
        if shared is None:
            return []
        own, count, _ = load_rank_files(self.world, self.hosts, root, step)
        if own is not None:  # every rank found its own: exact, else from the averaged model
            engine.set_weights({k[8:]: v for k, v in own.items() if k.startswith("weights.")})
            engine.set_optimizer_state({k: v for k, v in own.items() if not k.startswith(("weights.", "rank."))},
                                       count)
            self.rows = int(own["rank.rows"][0])
        return []


# -- a codec ---------------------------------------------------------------------------------
@register_codec("topk")
class TopK(Codec):
    """The largest `density` of the values (by magnitude) with their positions; what is left out
    goes into the error-feedback residual and is sent later. Payload: k int32 positions, then k
    fp32 values (k fixed by the element count, so ranks all-gather equal sizes)."""

    lossy = True
    summable = False  # all-gathered and decoded in rank order

    def __init__(self, density: str = "0.1"):
        self.density = float(density)
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"the density {density} must lie in (0, 1]")
        self.name = f"topk:{density}"

    def _k(self, n: int) -> int:
        return max(1, int(np.ceil(self.density * n)))

    def nbytes(self, n: int) -> int:
        return 8 * self._k(n)

    def encode(self, x, residual=None, consume=False):
        y = np.asarray(x, np.float32).reshape(-1) + (0.0 if residual is None else residual)
        k = self._k(y.size)
        with np.errstate(invalid="ignore"):
            idx = np.sort(np.argpartition(np.abs(y), y.size - k)[y.size - k:]).astype(np.int32)
        values = y[idx].astype(np.float32)
        if residual is not None:
            residual[...] = y
            residual[idx] = 0.0
        return np.concatenate([idx.view(np.uint8), values.view(np.uint8)])

    def decode(self, payload, n, out=None):
        k = self._k(n)
        dst = np.zeros(n, np.float32) if out is None else out
        dst[...] = 0.0
        dst[payload[: 4 * k].view(np.int32)] = payload[4 * k: 8 * k].view(np.float32)
        return dst

    def nonfinite(self, payload, n):
        k = self._k(n)
        return not np.isfinite(payload[4 * k: 8 * k].view(np.float32)).all()


# -- an optimizer ----------------------------------------------------------------------------
@register_optimizer
@dataclass(frozen=True)
class SGDNesterov(Optimizer):
    """p -= lr (g + mu m'), m' = mu m + g (PyTorch's nesterov=True), decoupled weight decay; the
    state is kept as (1 - mu) m so it is one `ema_` of the primitives."""

    name: ClassVar[str] = "sgd_nesterov"
    title: ClassVar[str] = "SGD (Nesterov)"
    state_names: ClassVar[tuple[str, ...]] = ("momentum",)

    mu: float = 0.9
    weight_decay: float = 0.0

    @classmethod
    def from_config(cls, train: Any) -> SGDNesterov:
        return cls(mu=train.beta1, weight_decay=train.weight_decay)

    def scalars(self, lr: float, t: int, coef: float) -> list[float]:
        return [lr, coef]

    def update(self, xp: Any, p: Any, g: Any, state: tuple, s: Any, decay: Any) -> tuple[Any, tuple]:
        (m,) = state
        lr, coef = s[0], s[1]
        g = xp.scale_(g, coef)
        m = xp.ema_(m, g, self.mu)  # (1 - mu) (mu m + g), kept so
        direction = xp.mix(m, g, self.mu)  # (1 - mu) (mu m' + g)
        p = xp.decay_(p, lr * self.weight_decay, decay)
        p = xp.descend_(p, lr, direction, None, 1.0 - self.mu)
        return p, (m,)
