"""Your own PyTorch loop across Macs: `import mlxdist.torch as md`, start with mpirun.

    info = md.init()                                   # rank, size, host, device (mps / cuda:N / cpu)
    model.to(info.device)
    opt = md.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model)
    md.broadcast(model, opt)                           # rank 0's weights, buffers, optimizer state
    sampler = md.DistributedSampler(len(data), global_batch=64)
    for x, y in DataLoader(data, batch_size=sampler.batch_size, sampler=sampler):
        opt.zero_grad()
        opt.backward(F.cross_entropy(model(x), y), count=len(x))   # a mean loss, weighed by its samples
        opt.step()
        if md.should_stop():                           # Ctrl-C / SIGTERM on any rank: all stop here
            break

Gradients are summed over ranks (in buckets sent while backward runs, the trainer's torch
engine's own sum) and divided by the cluster's units, so a MacBook's 3 samples and a Studio's
5 train exactly like one process with 8. torch.distributed has no MPS backend; this needs none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import Config
from .engine.torch_grads import ParamGradients
from .yourloop import session as _session

_NAME = "mlxdist.torch"


Info = _session.Info


def init(config: str | Path | Config | None = None, device: str = "auto", stall_timeout: float | None = None,
         metrics_port: int | None = None) -> Info:
    """Join the job mpirun started (one rank without mpirun). `config`: a YAML whose `nodes:`
    give each Mac's share of a global batch (`shares`), `dist.stall_timeout_s`, `metrics.port`."""
    from .engine.torch_engine import select_device

    s = _session.start("torch", config, "mpi4py", stall_timeout, metrics_port)
    s.device, _ = select_device(device, s.world.local_rank)
    for note in s.notes:
        _say(s, note)
    return info()


def info() -> Info:
    return _session.info(_NAME)


def set_device(device: str | torch.device) -> None:
    """This rank's device when it is known only after `init()` (Lightning's accelerator), so
    `info().device` names the one in use."""
    _session.current(_NAME).device = str(device)


def shares(global_batch: int) -> list[int]:
    """Every rank's samples of each global batch (from `nodes:`; equal without a config)."""
    return _session.current(_NAME).shares(global_batch)


def should_stop() -> bool:
    """True on every rank once any rank got Ctrl-C, SIGTERM or `kill -USR1 MPIRUN_PID`; call it
    at the end of each step (a collective)."""
    return _session.should_stop(_session.current(_NAME))


def all_reduce(value: Any, op: str = "sum") -> Any:
    """A number, numpy array or tensor summed (mean, max, min) over ranks, in the same type."""
    return _session.all_reduce(_NAME, value, op, torch.Tensor, lambda t: t.detach().double().cpu().numpy(),
                               lambda a, t: torch.as_tensor(a, dtype=t.dtype, device=t.device))


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (any picklable value), in rank order."""
    return _session.all_gather(_NAME, obj)


def broadcast_object(obj: Any, root: int = 0) -> Any:
    return _session.broadcast_object(_NAME, obj, root)


def broadcast(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, root: int = 0) -> None:
    """`root`'s parameters, buffers and optimizer state on every rank (a model initialised
    without a seed differs per rank). A model of another shape on some rank is one line
    naming the rank and the parameter."""
    s = _session.current(_NAME)
    state = model.state_dict()
    _session.check_same_shapes(s, {n: tuple(t.shape) for n, t in state.items()}, f"{_NAME}.broadcast")
    if s.size > 1:
        arrays = s.world.broadcast_arrays({n: to_numpy(t) for n, t in state.items()}, root)
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(torch.from_numpy(np.array(arrays[name])).to(t.dtype))
        if optimizer is not None:
            theirs = s.world.bcast(to_cpu(optimizer.state_dict()) if s.rank == root else None, root)
            optimizer.load_state_dict(theirs)


def sync_batchnorm(model: torch.nn.Module) -> list[str]:
    """BatchNorm layers that normalise with every rank's samples in training mode, weighted by
    counts (the trainer's `train.sync_batchnorm`): with one forward per rank and step, 3+5 trains
    like 8. Each layer's forward is patched in place (names and checkpoints unchanged); returns
    their names."""
    from .sync.batchnorm import sync_batchnorm_layers

    s = _session.current(_NAME)
    return sync_batchnorm_layers(model, s.world) if s.size > 1 else []


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, keep_last: int = 3, **state: Any) -> Path | None:
    """`run_dir/checkpoints/step_N` in mlxdist's format (written whole or not at all, with
    checksums), by rank 0 while the others wait: the model's whole state dict, the optimizer's
    state and `state` (JSON values: an epoch, a best score). The newest `keep_last` are kept.
    Returns the path on rank 0."""
    arrays = {n: to_numpy(t) for n, t in model.state_dict().items()}
    opt_arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"user": state}
    if optimizer is not None:
        sd = optimizer.state_dict()
        meta["param_groups"], meta["scalars"] = sd["param_groups"], {}
        for i, st in sd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    opt_arrays[f"{i}.{k}"] = to_numpy(v)
                else:
                    meta["scalars"][f"{i}.{k}"] = v
    return _session.save_checkpoint(_NAME, run_dir, step, arrays, opt_arrays, meta, keep_last)


def load_checkpoint(where: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any] | None:
    """The newest whole checkpoint under `where` (a run dir or one `step_N`) into `model`
    (strictly) and `optimizer`, on every rank; returns {"step": N, **state}, or None when there
    is none yet. Any number of ranks can load what any number saved."""
    found = _session.load_checkpoint(_NAME, where)
    if found is None:
        return None
    arrays, opt_arrays, meta = found
    own = model.state_dict()
    model.load_state_dict({n: torch.from_numpy(np.array(a)).to(own[n].dtype if n in own else None)
                           for n, a in arrays.items()}, strict=True)
    if optimizer is not None:
        if "param_groups" not in meta:
            raise _session.ConfigError(f"{_NAME}.load_checkpoint({where}): the checkpoint holds no optimizer state "
                                       "(saved without an optimizer); load it without one")
        state: dict[int, dict[str, Any]] = {}
        for key, a in opt_arrays.items():
            i, k = key.split(".", 1)
            state.setdefault(int(i), {})[k] = torch.from_numpy(np.array(a))
        for key, v in meta.get("scalars", {}).items():
            i, k = key.split(".", 1)
            state.setdefault(int(i), {})[k] = v
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return {"step": meta["step"], **meta["user"]}


class DistributedOptimizer:
    """`optimizer` whose step sums gradients over ranks and divides by the cluster's units
    (`backward(loss, count)` or `step(count=N)`). `reduction`: how the loss covers its units,
    'mean' (torch's default: it is weighed by `count`) or 'sum'.

    The object's class is built per optimizer class (`DistributedAdamW`: this and AdamW), and
    it shares the optimizer's state (`__dict__`): LR schedulers and `isinstance` see the
    optimizer they expect, and `isinstance(opt, DistributedOptimizer)` tells a wrapped one."""

    def __new__(cls, optimizer: torch.optim.Optimizer | None = None, model: torch.nn.Module | None = None,
                reduction: str = "mean", bucket_mb: float = 25.0, wire_dtype: str = "float32",
                overlap: bool = True) -> DistributedOptimizer:
        if cls is not DistributedOptimizer:  # a built class's bare object (copy.deepcopy)
            return super().__new__(cls)
        if optimizer is None or model is None:
            raise TypeError(f"{_NAME}.DistributedOptimizer(optimizer, model): both are needed")
        built = type(f"Distributed{type(optimizer).__name__}", (DistributedOptimizer, type(optimizer)), {})
        dist = object.__new__(built)
        dist.__dict__ = optimizer.__dict__
        dist._setup(model, reduction, bucket_mb, wire_dtype, overlap)
        return dist

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: `__new__` made the object, and the optimizer's own `__init__` already ran."""

    def _setup(self, model: torch.nn.Module, reduction: str, bucket_mb: float, wire_dtype: str,
               overlap: bool) -> None:
        from .cluster.transport import make_transport
        from .sync.torch_grad import TorchGradSync

        if reduction not in ("mean", "sum"):
            raise ValueError(f"{_NAME}.DistributedOptimizer: reduction '{reduction}' is not 'mean' or 'sum'")
        s = _session.current(_NAME)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        _session.check_same_shapes(s, {n: tuple(p.shape) for n, p in named}, f"{_NAME}.DistributedOptimizer")
        self._md_session, self._md_reduction = s, reduction
        self._md_grads = ParamGradients([p for _, p in named], model)
        self._md_sync = (TorchGradSync(make_transport(s.world, "mpi4py"), bucket_mb, wire_dtype, overlap)
                         if s.size > 1 else None)
        self._md_count: int | None = None  # units since the last step; None: none given yet
        self._md_armed, self._md_quiet, self._md_synced = False, False, None

    def backward(self, loss: torch.Tensor, count: int) -> None:
        """`loss.backward()` of `count` units (a mean over them with reduction='mean', their
        sum with 'sum'). Not inside `no_sync()`, it is the step's last: buckets go out as
        backward finishes them."""
        if self._md_armed:
            raise RuntimeError(f"{_NAME}: backward() twice in one step; wrap all but the step's last backward in "
                               "`with optimizer.no_sync():` (gradient accumulation)")
        if not self._md_quiet:
            self.send_during_backward()
        (loss * count if self._md_reduction == "mean" else loss).backward()
        self.add_count(count)

    def send_during_backward(self) -> None:
        """For a caller that runs the step's last backward itself (Lightning, which scales the
        loss its own way): buckets go out as that backward finishes them. Nothing on one rank."""
        if self._md_sync is not None:
            self._md_sync.arm(self._md_grads)
            self._md_armed = True

    def add_count(self, count: int) -> None:
        """`count` more units in this step, for a backward the caller ran itself on a loss
        weighed as `backward()` weighs it."""
        self._md_count = (self._md_count or 0) + int(count)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes that only accumulate (all but a step's last micro-batch)."""
        self._md_quiet = True
        try:
            yield
        finally:
            self._md_quiet = False

    def synchronize(self, count: int | None = None, *, own_step: bool = False) -> int:
        """Sum gradients over ranks and divide by the cluster's units; returns those units.
        `count`: this rank's units when backward was plain `loss.backward()`. Call it before
        clipping by the global norm; `step()` then does not sum again. `own_step`: the caller
        steps the wrapped optimizer itself (Lightning, after clipping), so this object's
        `step()` keeps no record of this sum."""
        if count is not None:
            if self._md_reduction == "mean":
                torch._foreach_mul_([g for g in self._md_grads.gradients() if g is not None], float(count))
            self.add_count(count)
        if self._md_count is None:
            raise RuntimeError(f"{_NAME}: step() without a count; use optimizer.backward(loss, count=N) or "
                               "optimizer.step(count=N) (this rank's samples, or units, in the step)")
        s = self._md_session
        grads = self._md_grads.gradients()
        if self._md_sync is not None:
            summed, _ = self._md_sync.all_sum(grads)
            self._md_grads.on_gradient_ready(None)
            total = int(s.world.allreduce_sum([float(self._md_count)])[0])
        else:
            summed, total = grads, self._md_count
        self._md_count, self._md_armed = None, False
        if total > 0:
            with torch.no_grad():
                for p, g in zip(self._md_grads.params, summed, strict=True):
                    if g is p.grad:
                        g.div_(total)
                    else:  # a fresh tensor: the sum's buffer is not the gradient's to keep
                        p.grad = (g.reshape(p.shape) / total).to(p.device)
        else:
            s.skipped_steps += 1
            _say(s, f"{_NAME}: step skipped: no rank had a unit to learn from (count 0 everywhere; "
                    f"{s.skipped_steps} so far)")
        self._md_synced = None if own_step else total
        return total

    def step(self, closure=None, count: int | None = None):
        if self._md_synced is None:
            self.synchronize(count)
        total, self._md_synced = self._md_synced, None
        if total == 0:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


class DistributedSampler(torch.utils.data.Sampler):
    """This rank's share of every global batch of a shuffled stream that depends only on
    (seed, position): `DataLoader(data, batch_size=sampler.batch_size, sampler=sampler)`. Each
    epoch is `len(data) // global_batch` global batches; `set_epoch(e)` as with torch's, and
    `start_step` continues a resumed run where it stopped."""

    def __init__(self, n_samples: int, global_batch: int, seed: int = 0, start_step: int = 0):
        s = _session.current(_NAME)
        self.n, self.global_batch, self.seed = int(n_samples), int(global_batch), int(seed)
        self.steps = self.n // self.global_batch
        if self.steps == 0:
            raise ValueError(f"{_NAME}.DistributedSampler: {n_samples} samples make no global batch of {global_batch}")
        self.begin, self.end = _session.my_slice(s.shares(global_batch), s.rank)
        self.batch_size = self.end - self.begin
        self.epoch, self.start_step = 0, int(start_step)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return (self.steps - self.start_step % self.steps) * self.batch_size

    def __iter__(self):
        first = self.epoch * self.steps + self.start_step % self.steps
        for step in range(first, (self.epoch + 1) * self.steps):
            yield from _session.sample_order(self.n, self.seed, step * self.global_batch + self.begin,
                                             self.batch_size).tolist()


def _say(s: _session.Session, text: str) -> None:
    if s.world.is_main:
        from .markers import write_line

        write_line(text)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy on the CPU, for the collectives and checkpoints (numpy has no
    bfloat16: such a tensor comes as float32)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def to_cpu(tree: Any) -> Any:
    """`tree` (a tensor, or dicts, lists and tuples of them, e.g. an optimizer's state dict)
    with every tensor detached on the CPU: what pickling to another rank needs (its device may
    be another)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


__all__ = ["DistributedOptimizer", "DistributedSampler", "Info", "all_gather", "all_reduce", "broadcast",
           "broadcast_object", "info", "init", "load_checkpoint", "save_checkpoint", "set_device", "shares",
           "should_stop", "sync_batchnorm", "to_cpu", "to_numpy"]
