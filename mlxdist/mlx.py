"""Your own MLX loop across Macs: `import mlxdist.mlx as md`, start with mpirun.

    md.init()
    md.broadcast(model, optimizer)                     # rank 0's parameters and optimizer state
    loss_and_grad = nn.value_and_grad(model, loss_fn)  # loss_fn: a mean over the batch
    for x, y in my_batches(md.shares(64)[md.info().rank]):
        loss, grads = loss_and_grad(model, x, y)
        grads = md.average_gradients(grads, count=len(x))   # weighed by samples, over ranks
        optimizer.update(model, grads)
        if md.should_stop():
            break

`mlx.nn.average_gradients` averages per rank, so a MacBook's 3 samples would weigh like a
Studio's 5; this sums over ranks and divides by the cluster's units (3+5 == 8), over any
backend mlxdist has (`mpi4py` ring by default; `mlx-mpi`, `mlx-ring`, `mlx-jaccl`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .cluster.world import resolve_backend
from .config import Config
from .yourloop import session as _session

_NAME = "mlxdist.mlx"


Info = _session.Info


_SYNC: dict[str, Any] = {}


def init(config: str | Path | Config | None = None, backend: str = "auto", stall_timeout: float | None = None,
         metrics_port: int | None = None) -> Info:
    """Join the job mpirun started (one rank without mpirun). `backend`: the gradient
    transport (`dist.backend`'s choices); `config`: a YAML whose `nodes:` size `shares`."""
    from .cluster.transport import make_transport
    from .sync.grad import GradSync

    chosen = resolve_backend(backend)
    s = _session.start("mlx", config, chosen, stall_timeout, metrics_port)
    s.device = str(mx.default_device())
    if "grad" not in _SYNC:
        _SYNC["grad"] = GradSync(make_transport(s.world, chosen))
    return info()


def info() -> Info:
    return _session.info(_NAME)


def shares(global_batch: int) -> list[int]:
    """Every rank's samples of each global batch (from `nodes:`; equal without a config)."""
    return _session.current(_NAME).shares(global_batch)


def should_stop() -> bool:
    """True on every rank once any rank got Ctrl-C, SIGTERM or `kill -USR1 MPIRUN_PID`."""
    return _session.should_stop(_session.current(_NAME))


def average_gradients(grads: Any, count: int, reduction: str = "mean") -> Any:
    """The gradient tree summed over ranks and divided by the cluster's units. `count`: this
    rank's units; `reduction`: whether the loss was their mean (weighed by `count`) or sum.
    With no unit anywhere the gradients come back as zeros and a line says so."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{_NAME}.average_gradients: reduction '{reduction}' is not 'mean' or 'sum'")
    s = _session.current(_NAME)
    flat = tree_flatten(grads)
    arrays = [g * count if reduction == "mean" else g for _, g in flat]
    if s.size > 1:
        arrays, _ = _SYNC["grad"].all_sum(arrays)
        total = int(s.world.allreduce_sum([float(count)])[0])
    else:
        total = int(count)
    if total <= 0:
        s.skipped_steps += 1
        if s.world.is_main:
            from .markers import write_line

            write_line(f"{_NAME}: no rank had a unit to learn from (count 0 everywhere; {s.skipped_steps} so far); "
                       "the gradients are zeros")
        return tree_unflatten([(n, mx.zeros_like(g)) for (n, g) in flat])
    return tree_unflatten([(n, a / total) for (n, _), a in zip(flat, arrays, strict=True)])


def broadcast(model: Any, optimizer: Any = None, root: int = 0) -> None:
    """`root`'s parameters (trainable or not) and optimizer state on every rank."""
    s = _session.current(_NAME)
    params = tree_flatten(model.parameters())
    _session.check_same_shapes(s, {n: tuple(a.shape) for n, a in params}, f"{_NAME}.broadcast")
    if s.size == 1:
        return
    model.update(tree_unflatten(list(_bcast(s, dict(params), root).items())))
    if optimizer is not None:
        state = tree_flatten(optimizer.state)
        theirs = s.world.bcast([n for n, _ in state] if s.rank == root else None, root)
        if s.rank != root and {n for n, _ in state} != set(theirs):
            raise RuntimeError(f"{_NAME}.broadcast: the optimizer on rank {s.rank} has other state than rank "
                               f"{root}'s; call broadcast after one update on every rank, or before any")
        optimizer.state = tree_unflatten(list(_bcast(s, dict(state), root).items()))
    mx.eval(model.parameters())


def _bcast(s: _session.Session, arrays: dict[str, mx.array], root: int) -> dict[str, mx.array]:
    dtypes = {n: a.dtype for n, a in arrays.items()}
    got = s.world.broadcast_arrays(_host(arrays), root)
    return {n: mx.array(got[n]).astype(dtypes[n]) for n in arrays}


def save_checkpoint(run_dir: str | Path, step: int, model: Any, optimizer: Any = None, keep_last: int = 3,
                    **state: Any) -> Path | None:
    """`run_dir/checkpoints/step_N` in mlxdist's format, by rank 0 while the others wait: the
    model's parameters (trainable or not), the optimizer's state and `state` (JSON values)."""
    model_arrays = _host(dict(tree_flatten(model.parameters())))
    opt_arrays = _host(dict(tree_flatten(optimizer.state))) if optimizer is not None else {}
    return _session.save_checkpoint(_NAME, run_dir, step, model_arrays, opt_arrays,
                                    {"user": state, "optimizer": optimizer is not None}, keep_last)


def load_checkpoint(where: str | Path, model: Any, optimizer: Any = None) -> dict[str, Any] | None:
    """The newest whole checkpoint under `where` into `model` (strictly) and `optimizer` on every
    rank; returns {"step": N, **state}, or None when there is none yet."""
    found = _session.load_checkpoint(_NAME, where)
    if found is None:
        return None
    arrays, opt_arrays, meta = found
    dtypes = {n: a.dtype for n, a in tree_flatten(model.parameters())}
    model.load_weights([(n, mx.array(a).astype(dtypes.get(n, mx.float32))) for n, a in arrays.items()], strict=True)
    if optimizer is not None:
        if not meta.get("optimizer"):
            raise _session.ConfigError(f"{_NAME}.load_checkpoint({where}): the checkpoint holds no optimizer state "
                                       "(saved without an optimizer); load it without one")
        optimizer.state = tree_unflatten([(n, mx.array(a)) for n, a in opt_arrays.items()])
    mx.eval(model.parameters())
    return {"step": meta["step"], **meta["user"]}


def _host(arrays: dict[str, mx.array]) -> dict[str, np.ndarray]:
    return {n: np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for n, a in arrays.items()}


def all_reduce(value: Any, op: str = "sum") -> Any:
    """A number, numpy or MLX array summed (mean, max, min) over ranks, in the same type."""
    return _session.all_reduce(_NAME, value, op, mx.array, np.array, lambda a, x: mx.array(a).astype(x.dtype))


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (any picklable value), in rank order."""
    return _session.all_gather(_NAME, obj)


def broadcast_object(obj: Any, root: int = 0) -> Any:
    return _session.broadcast_object(_NAME, obj, root)


__all__ = ["Info", "all_gather", "all_reduce", "average_gradients", "broadcast", "broadcast_object", "info", "init",
           "load_checkpoint", "save_checkpoint", "shares", "should_stop"]
