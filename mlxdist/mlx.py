"""Your own MLX loop across Macs: `import mlxdist.mlx as md`, start with mpirun.

    md.init()
    md.broadcast(model, optimizer)                     # rank 0's parameters and optimizer state
    sampler = md.DistributedSampler(len(data), global_batch=64)   # this rank's rows of each batch
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)  # compiled or not, the same lines
    def step(x, y):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)   # loss_fn: a mean over the batch
        grads = md.average_gradients(grads, count=x.shape[0])          # weighed by samples, over ranks
        optimizer.update(model, grads)
        return loss

    for idx in sampler:
        step(mx.array(data_x[idx]), mx.array(data_y[idx]))
        mx.eval(state)
        if md.should_stop():
            break

`mlx.nn.average_gradients` averages per rank, so a MacBook's 3 samples would weigh like a
Studio's 5; this sums over ranks and divides by the cluster's units (3+5 == 8), over any
backend mlxdist has. The default (`auto`) sums on the host with mpi4py, as the trainer does,
and inside a compiled step with MLX's own collectives (graph ops: MLX's mpi backend, else
its ring); `mlx-mpi`, `mlx-ring`, `mlx-jaccl` sum with MLX's alone, `mpi4py` on the host alone
(then a compiled step is refused with a line saying so).
"""

from __future__ import annotations

from collections.abc import Iterator
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
    transport (`dist.backend`'s choices); `auto` sums on the host with mpi4py and, inside
    `mx.compile`, with MLX's collectives (`mpi4py+mlx-mpi`, else `mpi4py+mlx-ring`);
    `config`: a YAML whose `nodes:` size `shares`."""
    from .cluster.transport import auto_with_graph_sums, make_transport
    from .sync.grad import GradSync

    if "grad" in _SYNC:
        return info()
    chosen = auto_with_graph_sums() if backend == "auto" else resolve_backend(backend)
    s = _session.start("mlx", config, chosen, stall_timeout, metrics_port)
    s.device = str(mx.default_device())
    transport = make_transport(s.world, chosen)
    # Two layouts: the host sum's gradients, and the in-graph sum's with the count beside them.
    _SYNC.update(grad=GradSync(transport), graph=GradSync(transport), backend=chosen,
                 nonfinite=_session.nonfinite_policy(_NAME, s), skipped=False)
    return info()


def info() -> Info:
    """This process's `rank` and `size` in the job, `local_rank` (its index on its host),
    `host` and MLX's default `device`. Each rank trains on its own rows of every global batch:
    `DistributedSampler` hands them out, `shares(global_batch)` says only how many."""
    return _session.info(_NAME)


def shares(global_batch: int) -> list[int]:
    """Every rank's samples of each global batch (from `nodes:`; equal without a config).
    Rank r's are rows sum(shares[:r]) to sum(shares[:r+1]) of the same global batch: only then
    do the ranks together equal one process (`DistributedSampler` does this)."""
    return _session.current(_NAME).shares(global_batch)


class DistributedSampler(_session.RankSampler):
    """This rank's rows of every global batch, as `mlxdist.torch.DistributedSampler` (the same
    stream: fixed by (seed, position), whatever the split or the number of ranks). Iterating
    gives one numpy index array per global batch of the epoch (`set_epoch(e)`; `start_step`
    continues a resumed run); `indices(step)` gives any step's, for a loop that counts steps."""

    def __init__(self, n_samples: int, global_batch: int, seed: int = 0, start_step: int = 0):
        s = _session.current(_NAME)
        super().__init__(n_samples, global_batch, s.shares(global_batch), s.rank, seed, start_step,
                         f"{_NAME}.DistributedSampler")

    def __len__(self) -> int:
        return len(self.epoch_steps())

    def __iter__(self) -> Iterator[np.ndarray]:
        for step in self.epoch_steps():
            yield self.indices(step)


def should_stop() -> bool:
    """True on every rank once any rank got Ctrl-C, SIGTERM or `kill -USR1 MPIRUN_PID`."""
    return _session.should_stop(_session.current(_NAME))


def average_gradients(grads: Any, count: int | mx.array, reduction: str = "mean") -> Any:
    """The gradient tree summed over ranks and divided by the cluster's units. `count`: this
    rank's units; `reduction`: whether the loss was their mean (weighed by `count`) or sum.
    With no unit anywhere, or NaN or infinity in the sum, the gradients come back as zeros
    (the weights stay finite) and `skipped()` is true; the trainer skips such a step, so the
    loop should too: `if not md.skipped(): optimizer.update(model, grads)` (zeros still move an
    optimizer with momentum or weight decay). A non-finite sum is counted and said, and
    `control.max_nonfinite_steps` of them in a row end the job in one line, as in the trainer.

    Inside `mx.compile` (mlx-lm's and mlx-examples' compiled steps) the sums, the count's too,
    are nodes of MLX's graph; out of it, the sum runs as the trainer's does. The graph cannot
    branch or reach the host, so there a skipped step's gradients are zeros and nothing more:
    no line, no count, no stop, and `skipped()` refuses to guess."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{_NAME}.average_gradients: reduction '{reduction}' is not 'mean' or 'sum'")
    s = _session.current(_NAME)
    flat = tree_flatten(grads)
    arrays = [g * count if reduction == "mean" else g for _, g in flat]
    sync = _SYNC["graph"]
    in_graph = _traced(arrays)  # every call: the host's check of the sum evaluates them anyway
    _SYNC["skipped"] = None if in_graph else False  # None: known only inside the graph
    if in_graph:
        if not sync.transport.graph_sum:
            raise _session.ConfigError(
                f"{_NAME}.average_gradients: called inside mx.compile (or vmap), where the "
                f"{_SYNC['backend']} backend cannot sum (it sums on the host, outside MLX's graph): "
                f"use md.init(backend='auto') or 'mlx-mpi'/'mlx-ring', or call it outside the compiled function")
        return _average_in_graph(flat, arrays, count, sync)
    return _average_on_host(s, flat, arrays, count)


# The line MLX 0.32 raises when asked to evaluate a tracer (mlx/transforms.cpp, eval_impl).
_TRACING = "[eval] Attempting to eval an array during function transformations"


def _traced(arrays: list[mx.array]) -> bool:
    """Whether `arrays` are tracers of `mx.compile` or `mx.vmap`. MLX has no call that says so;
    its eval refuses a tracer while walking the graph, before anything is scheduled or run (the
    walk only detaches arrays already evaluated, as every eval does), so the refusal changes
    nothing. Out of a trace the eval is the one the host-side sum makes anyway."""
    try:
        mx.eval(arrays)
    except ValueError as e:
        if _TRACING in str(e):
            return True
        raise
    return False


def _average_in_graph(flat: list, arrays: list[mx.array], count: int | mx.array, sync: Any) -> Any:
    """The sum and the count's total in one in-graph exchange (the count rides in the last
    bucket, beside how many ranks hold a NaN or infinity); a total of 0, or any rank's
    non-finite gradients, give zeros, as on the host. The flag is each rank's own, summed, so
    every rank zeroes the same step: a NaN that reached AdamW's moments would stay there."""
    n = (count if isinstance(count, mx.array) else mx.array(count)).astype(mx.float32).reshape(1)
    bad = 1 - mx.stack([mx.isfinite(a).all() for a in arrays]).all().astype(mx.float32).reshape(1)
    *summed, totals = sync.all_sum_in_graph([*arrays, mx.concatenate([n, bad])])
    total, keep = totals[0], (totals[0] > 0) & (totals[1] == 0)
    return tree_unflatten([(name, mx.where(keep, a / mx.maximum(total, 1), 0))
                           for (name, _), a in zip(flat, summed, strict=True)])


def _average_on_host(s: _session.Session, flat: list, arrays: list[mx.array], count: int) -> Any:
    """The trainer's sum; its finiteness judged on the sums and agreed in the count's own
    all-reduce, so every rank skips the same step."""
    if s.size > 1:
        arrays, _ = _SYNC["grad"].all_sum(arrays)
    bad = 0.0 if not arrays or bool(mx.stack([mx.isfinite(a).all() for a in arrays]).all()) else 1.0
    if s.size > 1:
        total_f, bad = s.world.allreduce_sum([float(count), bad])
        total = int(total_f)
    else:
        total = int(count)
    if total > 0:
        _session.judge_update(_NAME, s, _SYNC["nonfinite"], not bad,  # the last straw: one line
                              "the gradients come back as zeros (md.skipped() is true)")
        if bad:
            _SYNC["skipped"] = True
            return tree_unflatten([(n, mx.zeros_like(g)) for (n, g) in flat])
    if total <= 0:
        _SYNC["skipped"] = True
        s.skipped_steps += 1
        if s.world.is_main:
            from .markers import write_line

            write_line(f"{_NAME}: no rank had a unit to learn from (count 0 everywhere; {s.skipped_steps} so far); "
                       "the gradients are zeros")
        return tree_unflatten([(n, mx.zeros_like(g)) for (n, g) in flat])
    return tree_unflatten([(n, a / total) for (n, _), a in zip(flat, arrays, strict=True)])


def skipped() -> bool:
    """Whether the last `average_gradients` skipped its step (no unit on any rank, or NaN or
    infinity in the sum), the same on every rank: `if not md.skipped(): optimizer.update(...)`
    leaves the model and the optimizer as if the step was never taken, as the trainer does.
    After a sum inside `mx.compile` the answer lives in the graph only (its zeros), so asking
    is one line rather than a guess a compiled function would bake in."""
    _session.current(_NAME)
    if _SYNC.get("skipped") is None:
        raise _session.ConfigError(
            f"{_NAME}.skipped(): the last average_gradients summed inside mx.compile, where whether the step is "
            "skipped is known only in the graph (its gradients came back as zeros there); to skip such steps "
            "whole, call md.average_gradients and optimizer.update outside the compiled function")
    return bool(_SYNC["skipped"])


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
    equal = _session.ranks_equal(_NAME, step, model_arrays)
    return _session.save_checkpoint(_NAME, run_dir, step, model_arrays, opt_arrays,
                                    {"user": state, "optimizer": optimizer is not None, "ranks_equal": equal}, keep_last)


def sync_state(model: Any, count: int) -> None:
    """After each step's update: the model's state beyond what trains (BatchNorm's running
    statistics) agreed across ranks as the trainer keeps it, running statistics averaged by
    `count` (this rank's samples in the step: 3+5 holds what one process with 8 would),
    anything else as rank 0 has it. Outside `mx.compile` (it talks to the other ranks);
    nothing on one rank. Collective."""
    s = _session.current(_NAME)
    if s.size == 1:
        return
    sync = _STATE.get(id(model))
    if sync is None:
        from .engine.model_state import MlxModelState
        from .sync.model_state import RUNNING_STATS

        trained = {n for n, _ in tree_flatten(model.trainable_parameters())}
        state = {n: a for n, a in tree_flatten(model.parameters()) if n not in trained}
        # Made after the first step, whose running statistics are already this rank's own.
        tracker = MlxModelState(model, lambda: {n: a for n, a in tree_flatten(model.parameters()) if n not in trained},
                                unmarked=[n for n in state if n.rsplit(".", 1)[-1] in RUNNING_STATS])
        sync = _STATE[id(model)] = _session.model_state_sync(s, tracker)
    sync(count)


_STATE: dict[int, Any] = {}


def load_checkpoint(where: str | Path, model: Any, optimizer: Any = None) -> dict[str, Any] | None:
    """The newest whole checkpoint under `where` into `model` (strictly) and `optimizer` on every
    rank; returns {"step": N, **state}, or None when there is none yet."""
    found = _session.load_checkpoint(_NAME, where)
    if found is None:
        return None
    arrays, opt_arrays, meta = found
    dtypes = {n: a.dtype for n, a in tree_flatten(model.parameters())}
    try:
        model.load_weights([(n, mx.array(a).astype(dtypes.get(n, mx.float32))) for n, a in arrays.items()], strict=True)
    except (ValueError, TypeError) as e:  # MLX's strict refusal: a checkpoint of another model
        err = _session.ConfigError(f"{_NAME}.load_checkpoint({where}): the model's weights do not fit "
                                   f"({str(e).strip().splitlines()[0][:300]}); load it into the model it was saved from")
        err.quiet = _session.current(_NAME).rank != 0
        raise err from None
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


__all__ = ["DistributedSampler", "Info", "all_gather", "all_reduce", "average_gradients", "broadcast", "broadcast_object", "info", "init",
           "load_checkpoint", "save_checkpoint", "shares", "should_stop", "skipped", "sync_state"]
