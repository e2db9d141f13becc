"""`train.sync_batchnorm`: BatchNorm batch statistics over every rank's samples (torch engine).

A BatchNorm layer in training mode normalises with its batch's mean and variance, so each
rank would normalise with statistics of its own few samples: 3+5 samples would not train
like 8, and a small rank's statistics would be noisy. Here each BatchNorm instance of the
task's model gets a forward that sums per-channel sums, sums of squares and element counts
over the ranks (float64), and a backward that sums the two per-channel gradient sums, as
`torch.nn.SyncBatchNorm` does; running statistics get the global mean and unbiased variance.
Sums weight each rank by its elements, so unequal batches are exactly one batch of them all.

The forward is patched on each instance rather than the module replaced: module identity,
parameters and state_dict names stay the user's, so engine and checkpoints are unaffected.
Each exchange carries a sequence number, so ranks that got out of step (a forward that
differs between ranks) stop with an error instead of mixing another layer's sums.
"""

from __future__ import annotations

import types

import numpy as np

from ..cluster.world import World
from ..config import Config, ConfigError
from ..engine.registry import engine_spec

_TAG_WRAP = 1 << 20  # keeps tag**2 * ranks exact in float64


class _Exchange:
    """The sums of one installation: one all-reduce per call, checked for step."""

    def __init__(self, world: World):
        self.world, self.calls = world, 0

    def sum(self, parts: list[np.ndarray]) -> np.ndarray:
        self.calls += 1
        tag = float(self.calls % _TAG_WRAP + 1)
        buf = np.concatenate([np.asarray(p, np.float64).ravel() for p in parts] + [np.array([tag, tag * tag])])
        with self.world.watch("BatchNorm statistics all-reduce (train.sync_batchnorm)"):
            total = self.world.allreduce_arrays({"bn": buf})["bn"]
        n = self.world.size
        if total[-2] != n * tag or total[-1] != n * tag * tag:
            raise RuntimeError(
                f"train.sync_batchnorm: {self.world.label}: the ranks' BatchNorm exchanges got out of step at "
                f"exchange {self.calls} (a rank ran another number of BatchNorm calls: a forward that differs "
                "between ranks, or a micro-batch redone at a smaller size); every rank must run the same "
                "forward once per step")
        return total[:-2]


def _shape(x) -> tuple[list[int], list[int]]:
    return [0, *range(2, x.dim())], [1, x.shape[1]] + [1] * (x.dim() - 2)


def _host(t) -> np.ndarray:
    return t.detach().cpu().double().numpy()  # MPS has no float64: to the host first


def _normalize_function():
    import torch

    class SyncNormalize(torch.autograd.Function):
        """y = (x - mean) * invstd * weight + bias with the global mean/invstd; backward sums
        sum(dy) and sum(dy * (x - mean)) over the ranks (torch's batch_norm_backward_elemt)."""

        @staticmethod
        def forward(ctx, x, weight, bias, mean, invstd, count, exchange):
            _, shape = _shape(x)
            xf = x.float()
            y = (xf - mean.view(shape)) * invstd.view(shape)
            if weight is not None:
                y = y * weight.float().view(shape)
            if bias is not None:
                y = y + bias.float().view(shape)
            ctx.save_for_backward(x, weight, mean, invstd)
            ctx.count, ctx.exchange = count, exchange
            return y.to(x.dtype)

        @staticmethod
        def backward(ctx, grad):
            x, weight, mean, invstd = ctx.saved_tensors
            dims, shape = _shape(x)
            dy = grad.float()
            xmu = x.float() - mean.view(shape)
            sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
            gx = gw = gb = None
            if ctx.needs_input_grad[0]:
                c = sum_dy.numel()
                total = ctx.exchange.sum([_host(sum_dy), _host(sum_dy_xmu)])
                means = torch.as_tensor(total / ctx.count, dtype=torch.float32, device=x.device)
                mean_dy, mean_dy_xmu = means[:c].view(shape), means[c:].view(shape)
                scale = invstd if weight is None else invstd * weight.float()
                gx = ((dy - mean_dy - xmu * (invstd * invstd).view(shape) * mean_dy_xmu)
                      * scale.view(shape)).to(x.dtype)
            if weight is not None and ctx.needs_input_grad[1]:
                gw = (sum_dy_xmu * invstd).to(weight.dtype)
            if ctx.needs_input_grad[2]:
                gb = sum_dy.to(weight.dtype)
            return gx, gw, gb, None, None, None, None

    return SyncNormalize


def _sync_forward(exchange: _Exchange, normalize):
    import torch

    def forward(self, input):
        if not self.training:
            return type(self).forward(self, input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        dims, _ = _shape(input)
        with torch.no_grad():
            n = input.numel() // max(input.shape[1], 1)
            if n:
                var, mean = torch.var_mean(input.float(), dims, correction=0)
            else:
                var = mean = torch.zeros(input.shape[1], device=input.device)
            m, v = _host(mean), _host(var)
            c = m.size
            total = exchange.sum([n * m, n * (v + m * m), np.array([n])])
            count = float(total[-1])
            if count <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, got {count:g} over all "
                                 f"ranks (input size {list(input.shape)} on this one)")
            g_mean = total[:c] / count
            g_var = np.maximum(total[c:2 * c] / count - g_mean * g_mean, 0.0)
            mean_t = torch.as_tensor(g_mean, dtype=torch.float32, device=input.device)
            invstd_t = torch.as_tensor(1.0 / np.sqrt(g_var + self.eps), dtype=torch.float32, device=input.device)
            if self.track_running_stats and self.running_mean is not None:
                unbiased = torch.as_tensor(g_var * count / (count - 1), dtype=self.running_var.dtype,
                                           device=input.device)  # MPS: no float64 tensors
                self.running_mean.mul_(1 - factor).add_(mean_t.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return normalize.apply(input, self.weight, self.bias, mean_t, invstd_t, count, exchange)

    # Dynamo cannot trace the MPI call: a compiled model runs these layers eagerly.
    return torch.compiler.disable(forward)


def batchnorm_layers(model) -> dict[str, object]:
    from torch.nn.modules.batchnorm import _BatchNorm

    return {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}


def _own_forward(module) -> bool:
    """A BatchNorm subclass with a forward of its own: replacing it would drop what it does."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    return type(module).forward not in (_BatchNorm.forward, torch.nn.SyncBatchNorm.forward)


def sync_batchnorm_layers(model, world: World) -> list[str]:
    """Patch every plain BatchNorm instance of `model` to sum its statistics over `world`'s
    ranks (collective in training mode). Returns the names patched."""
    forward = _sync_forward(_Exchange(world), _normalize_function())
    patched = []
    for name, m in batchnorm_layers(model).items():
        if not _own_forward(m):
            m.forward = types.MethodType(forward, m)
            patched.append(name)
    return patched


def _refuse(world: World, text: str) -> ConfigError:
    return world.agreed_error(f"train.sync_batchnorm: {text}")


def install_sync_batchnorm(cfg: Config, world: World, engine, plan) -> list[str]:
    """When `train.sync_batchnorm` is set: refuse what cannot work, else patch the torch
    engine's model. Returns the notes to print. Every rank calls it with the same plan. A
    strategy whose ranks hold different weights (`Strategy.ranks_differ`: DiLoCo) is refused
    by the config (`config.check_pieces`)."""
    if not cfg.train.sync_batchnorm:
        return []
    if not engine_spec(engine.name).sync_batchnorm:
        raise _refuse(world, f"the {engine.name} engine is not supported (MLX has no collective inside autograd on "
                             "mlxdist's transports); run with --engine torch, or set train.sync_batchnorm=false")
    task = engine.capabilities.task_name
    layers = batchnorm_layers(engine.model)
    if not layers:
        raise _refuse(world, f"task {task} has no BatchNorm layer (torch.nn.BatchNorm1d/2d/3d); "
                             "set train.sync_batchnorm=false")
    own = [name for name, m in layers.items() if _own_forward(m)]
    if len(own) == len(layers):
        raise _refuse(world, f"task {task}'s BatchNorm layers all have a forward of their own "
                             f"({', '.join(own[:3])}), which it cannot synchronise; set train.sync_batchnorm=false")
    if world.size == 1:
        return [f"train.sync_batchnorm: one rank: its {len(layers)} BatchNorm layer(s) see the whole batch already"]
    for key, why in (("control.adapt_batch", "may split a rank's share into micro-batches mid-run"),
                     ("control.balance", "moves samples between ranks, which may need more micro-batches")):
        if getattr(cfg.control, key.split(".")[1]):
            raise _refuse(world, f"{key} {why}, and the ranks would then wait on each other's BatchNorm "
                                 f"statistics; set {key}=false, or train.sync_batchnorm=false")
    for r in range(world.size):
        k = plan.accumulation(r)
        if k != 1:
            raise _refuse(world, f"rank {r} runs {k} micro-batches per step (share {plan.shares[r]}, micro-batch "
                                 f"{plan.micro[r]}); every rank must run exactly one, or the ranks would wait on each "
                                 "other's BatchNorm statistics: set train.accum=1 and give each rank a batch size "
                                 "(train.batch_size, nodes: batch_size) that holds its share, or set "
                                 "train.sync_batchnorm=false")
    patched = sync_batchnorm_layers(engine.model, world)
    notes = [f"train.sync_batchnorm: {len(patched)} BatchNorm layer(s) of task {task} normalise over all "
             f"{world.size} ranks' samples (2 small all-reduces per layer per step)"]
    if own:
        notes.append(f"train.sync_batchnorm: {len(own)} BatchNorm layer(s) with a forward of their own keep "
                     f"per-rank statistics ({', '.join(own[:3])}{' ...' if len(own) > 3 else ''})")
    if engine.capabilities.compiled:
        notes.append("train.sync_batchnorm: torch.compile runs the BatchNorm layers eagerly (graph breaks)")
    return notes
