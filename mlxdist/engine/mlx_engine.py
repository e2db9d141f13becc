"""The MLX engine: one rank's forward/backward, gradient sync, and AdamW update.

Master weights and AdamW moments stay fp32; with `model.dtype` bf16/fp16 the forward pass
runs on a cast copy, and the cast's gradient brings fp32 gradients back for free.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..collective import Collective
from ..config import Config
from ..models.init import param_shapes
from ..models.mlx_model import Transformer, init_params
from ..models.presets import ModelArgs
from ..sync import GradSync
from ..world import World
from .base import StepStats

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class MLXEngine:
    name = "mlx"

    def __init__(self, args: ModelArgs, cfg: Config, world: World | None = None,
                 collective: Collective | None = None):
        self.args, self.cfg = args, cfg
        self.world = world or World()
        self.collective = collective or Collective()
        self.sync = GradSync(self.collective, cfg.dist.bucket_mb, cfg.dist.wire_dtype)
        self.device = str(mx.default_device())
        self.compute_dtype = DTYPES[cfg.model.dtype]
        self.model = Transformer(args)
        self.names = sorted(param_shapes(args))
        self.params: dict[str, mx.array] = init_params(args, cfg.train.seed)
        self.m = {k: mx.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: mx.zeros_like(v) for k, v in self.params.items()}
        self.opt_step = 0
        self._decay = [len(self.params[n].shape) >= 2 for n in self.names]
        self._value_and_grad = mx.value_and_grad(self._loss)
        self._adamw = mx.compile(self._adamw_update)
        self._reset_accumulators()

    # -- math -------------------------------------------------------------------------
    def _forward(self, params: dict[str, mx.array], inputs: mx.array) -> mx.array:
        if self.compute_dtype != mx.float32:
            params = {k: v.astype(self.compute_dtype) for k, v in params.items()}
        self.model.update(tree_unflatten(list(params.items())))
        return self.model(inputs).astype(mx.float32)

    def _loss(self, params: dict[str, mx.array], inputs: mx.array, targets: mx.array) -> mx.array:
        return nn.losses.cross_entropy(self._forward(params, inputs), targets, reduction="sum")

    def _adamw_update(self, params, m, v, grads, scalars):
        lr, bc1, bc2, coef = scalars[0], scalars[1], scalars[2], scalars[3]
        c = self.cfg.train
        out_p, out_m, out_v = [], [], []
        for p, mi, vi, g, decay in zip(params, m, v, grads, self._decay, strict=True):
            g = g * coef
            mi = c.beta1 * mi + (1 - c.beta1) * g
            vi = c.beta2 * vi + (1 - c.beta2) * mx.square(g)
            if decay:
                p = p * (1 - lr * c.weight_decay)
            p = p - lr * (mi / bc1) / (mx.sqrt(vi / bc2) + c.eps)
            out_p.append(p)
            out_m.append(mi)
            out_v.append(vi)
        return out_p, out_m, out_v

    # -- the Engine contract ----------------------------------------------------------
    def _reset_accumulators(self) -> None:
        self._grads: dict[str, mx.array] | None = None
        self._loss_sum = mx.array(0.0)
        self._tokens = 0

    def micro_step(self, tokens: np.ndarray) -> None:
        batch = mx.array(tokens)
        loss, grads = self._value_and_grad(self.params, batch[:, :-1], batch[:, 1:])
        if self._grads is None:
            self._grads = grads
        else:
            self._grads = {k: self._grads[k] + grads[k] for k in grads}
        self._loss_sum = self._loss_sum + loss
        self._tokens += int(batch.shape[0] * (batch.shape[1] - 1))
        mx.eval(self._grads, self._loss_sum)

    def step(self, lr: float) -> StepStats:
        if self._grads is None:
            raise RuntimeError("step() without micro_step(): no gradients to apply")
        grads, sync = self.sync.all_sum([self._grads[n] for n in self.names])
        loss_sum, tokens = self.world.allreduce_sum([self._loss_sum.item(), self._tokens])
        grads = [g * (1.0 / tokens) for g in grads]
        norm = math.sqrt(mx.stack([mx.sum(mx.square(g)) for g in grads]).sum().item())
        self._reset_accumulators()
        stats = StepStats(loss_sum, int(tokens), norm, skipped=False,
                          sync_seconds=sync.seconds, sync_bytes=sync.bytes)
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            stats.skipped = True
            return stats
        clip = self.cfg.train.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        t = self.opt_step + 1
        scalars = mx.array([lr, 1 - self.cfg.train.beta1**t, 1 - self.cfg.train.beta2**t, coef])
        p, m, v = self._adamw([self.params[n] for n in self.names], [self.m[n] for n in self.names],
                              [self.v[n] for n in self.names], grads, scalars)
        self.params = dict(zip(self.names, p, strict=True))
        self.m = dict(zip(self.names, m, strict=True))
        self.v = dict(zip(self.names, v, strict=True))
        mx.eval(self.params, self.m, self.v)
        self.opt_step = t
        return stats

    def discard_gradients(self) -> None:
        """Drop a half-accumulated step (after an out-of-memory), keeping weights and moments."""
        self._reset_accumulators()

    def poison_loss(self) -> None:
        """Test seam: make this step's loss non-finite, as a numerical blow-up would."""
        self._loss_sum = self._loss_sum + float("nan")

    def perturb_weights(self, eps: float = 1e-3) -> None:
        """Test seam: make this rank's weights differ, as a silent drift would."""
        first = self.names[0]
        self.params[first] = self.params[first] + eps

    def clear_cache(self) -> None:
        mx.clear_cache()

    def get_weights(self) -> dict[str, np.ndarray]:
        return {k: np.array(v) for k, v in self.params.items()}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        missing = set(self.names) - set(weights)
        if missing:
            raise ValueError(f"weights lack {len(missing)} parameters, e.g. {sorted(missing)[0]} (different model.preset?)")
        for n in self.names:
            if tuple(weights[n].shape) != tuple(self.params[n].shape):
                raise ValueError(f"{n}: checkpoint shape {tuple(weights[n].shape)} != model {tuple(self.params[n].shape)}")
        self.params = {n: mx.array(weights[n].astype(np.float32)) for n in self.names}
        mx.eval(self.params)

    def get_optimizer_state(self) -> tuple[dict[str, np.ndarray], int]:
        state = {f"m.{k}": np.array(v) for k, v in self.m.items()}
        state |= {f"v.{k}": np.array(v) for k, v in self.v.items()}
        return state, self.opt_step

    def set_optimizer_state(self, state: dict[str, np.ndarray], step: int) -> None:
        self.m = {n: mx.array(state[f"m.{n}"]) for n in self.names}
        self.v = {n: mx.array(state[f"v.{n}"]) for n in self.names}
        self.opt_step = int(step)

    def broadcast_state(self, root: int = 0) -> None:
        """Make every rank's weights and moments bit-identical to `root`'s."""
        if self.collective.size == 1:
            return
        arrays = [self.params[n] for n in self.names] + [self.m[n] for n in self.names] + \
                 [self.v[n] for n in self.names]
        out = self.collective.broadcast(arrays, root)
        k = len(self.names)
        self.params = dict(zip(self.names, out[:k], strict=True))
        self.m = dict(zip(self.names, out[k : 2 * k], strict=True))
        self.v = dict(zip(self.names, out[2 * k :], strict=True))
        mx.eval(self.params, self.m, self.v)

    def weight_arrays(self) -> list[np.ndarray]:
        return [np.array(self.params[n]) for n in self.names]

    def eval_loss(self, tokens: np.ndarray) -> tuple[float, int]:
        batch = mx.array(tokens)
        loss = self._loss(self.params, batch[:, :-1], batch[:, 1:])
        return loss.item(), int(batch.shape[0] * (batch.shape[1] - 1))

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        return np.array(self._forward(self.params, mx.array(tokens)))

    def sample(self, prompt: list[int], max_new: int, temperature: float = 0.8, seed: int = 0,
               context: int = 256) -> list[int]:
        key = mx.random.key(seed)
        out = list(prompt)
        for _ in range(max_new):
            logits = self._forward(self.params, mx.array([out[-context:]]))[0, -1]
            if temperature <= 0:
                nxt = int(mx.argmax(logits).item())
            else:
                key, sub = mx.random.split(key)
                nxt = int(mx.random.categorical(logits / temperature, key=sub).item())
            out.append(nxt)
        return out[len(prompt):]

    def describe(self) -> str:
        return f"mlx on {self.device}, compute {self.cfg.model.dtype}, master fp32"
