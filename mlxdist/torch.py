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

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from . import gate
from .config import Config
from .engine.torch_grads import ParamGradients
from .yourloop import session as _session

_NAME = "mlxdist.torch"

# One optimizer, several (a sparse embedding's own beside AdamW), or none.
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


Info = _session.Info


def init(config: str | Path | Config | None = None, device: str = "auto", stall_timeout: float | None = None,
         metrics_port: int | None = None) -> Info:
    """Join the job mpirun started (one rank without mpirun). `config`: a YAML whose `nodes:`
    give each Mac's share of a global batch (`shares`), `dist.stall_timeout_s`, `metrics.port`;
    without one, $MLXDIST_CONFIG names it (as for the Lightning and HF integrations), so a
    script that parses its own arguments (hydra) needs no new option."""
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


def broadcast(model: torch.nn.Module, optimizer: Optimizers = None, root: int = 0) -> None:
    """`root`'s parameters, buffers and optimizer state on every rank (a model initialised
    without a seed differs per rank); `optimizer` may be a list (a script with two). A model of
    another shape on some rank is one line naming the rank and the parameter."""
    s = _session.current(_NAME)
    state = model.state_dict()
    _session.check_same_shapes(s, {n: tuple(t.shape) for n, t in state.items()}, f"{_NAME}.broadcast")
    if s.size > 1:
        arrays = s.world.broadcast_arrays({n: to_numpy(t) for n, t in state.items()}, root)
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(torch.from_numpy(np.array(arrays[name])).to(t.dtype))
        for opt in _optimizers(optimizer):
            theirs = s.world.bcast(to_cpu(opt.state_dict()) if s.rank == root else None, root)
            opt.load_state_dict(theirs)


def sync_batchnorm(model: torch.nn.Module) -> list[str]:
    """BatchNorm layers that normalise with every rank's samples in training mode, weighted by
    counts (the trainer's `train.sync_batchnorm`): with one forward per rank and step, 3+5 trains
    like 8. Each layer's forward is patched in place (names and checkpoints unchanged); returns
    their names."""
    from .sync.batchnorm import sync_batchnorm_layers

    s = _session.current(_NAME)
    return sync_batchnorm_layers(model, s.world) if s.size > 1 else []


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: Optimizers = None,
                    keep_last: int = 3, **state: Any) -> Path | None:
    """`run_dir/checkpoints/step_N` in mlxdist's format (written whole or not at all, with
    checksums), by rank 0 while the others wait: the model's whole state dict, the state of
    `optimizer` (or of a list of them) and `state`. A `state` value is a JSON value (an epoch),
    tensors (an EMA copy, an RNG state: a tensor, or dicts, lists, tuples and dataclasses of
    them), saved as rank 0 holds them and so loaded the same on every rank; or `md.rows(x)`:
    tensors whose first dimension is this rank's samples (a carry of per-sample state between
    steps), saved as every rank's rows in rank order, so that each rank loads its own rows (on
    any number of ranks). Collective. The newest `keep_last` are kept. Returns the path on rank 0."""
    arrays = {n: to_numpy(t) for n, t in model.state_dict().items()}
    opts = _optimizers(optimizer)
    opt_arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for j, opt in enumerate(opts):
        groups, scalars = _pack_optimizer(opt, f"{j}:" if len(opts) > 1 else "", opt_arrays)
        meta.setdefault("param_groups", []).append(groups)
        meta.setdefault("scalars", []).append(scalars)
    if len(opts) == 1:
        meta["param_groups"], meta["scalars"] = meta["param_groups"][0], meta["scalars"][0]
    tensors: dict[str, np.ndarray] = {}
    meta["user"] = {k: _pack_state(k, v, tensors) for k, v in state.items()}
    meta["ranks_equal"] = _session.ranks_equal(_NAME, step, arrays)
    return _session.save_checkpoint(_NAME, run_dir, step, arrays, opt_arrays, meta, keep_last, tensors)


def load_checkpoint(where: str | Path, model: torch.nn.Module, optimizer: Optimizers = None,
                    classes: Iterable[type | ModuleType] = ()) -> dict[str, Any] | None:
    """The newest whole checkpoint under `where` (a run dir or one `step_N`) into `model`
    (strictly) and `optimizer` (or the list of them saved), on every rank; returns {"step": N,
    **state} with tensors as they were saved (`md.rows` ones: this rank's rows), or None when
    there is none yet. Any number of ranks can load what any number saved.

    A checkpoint is data: it never names code that runs. A dataclass saved in `state` comes
    back as its class only when that class is in `classes` (a class, or a module whose
    dataclasses are all welcome); otherwise as a dict of its fields, and said once."""
    tensors: dict[str, np.ndarray] = {}
    found = _session.load_checkpoint(_NAME, where, tensors)
    if found is None:
        return None
    arrays, opt_arrays, meta = found
    own = model.state_dict()
    with _one_line(f"{_NAME}.load_checkpoint({where}): the model's state", "load it into the model it was saved from"):
        model.load_state_dict({n: torch.from_numpy(np.array(a)).to(own[n].dtype if n in own else None)
                               for n, a in arrays.items()}, strict=True)
    opts = _optimizers(optimizer)
    with _one_line(f"{_NAME}.load_checkpoint({where}): the optimizer state",
                   "pass the optimizers it was saved with, in that order"):
        _load_optimizers(where, opts, opt_arrays, meta)
    unpack = _Unpacker(f"{_NAME}.load_checkpoint({where})", tensors, _welcome(classes))
    user = {k: unpack.state(k, v) for k, v in meta["user"].items()}
    for note in unpack.notes:
        _say(_session.current(_NAME), note)
    return {"step": meta["step"], **user}


@contextmanager
def _one_line(what: str, fix: str) -> Iterator[None]:
    """torch's own refusals of a state dict (several lines, a traceback) as the one line a
    checkpoint from elsewhere gets."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        if isinstance(e, _session.ConfigError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        err = _session.ConfigError(f"{what} does not fit ({first[:300]}); {fix}")
        err.quiet = _session.current(_NAME).rank != 0
        raise err from None


def _load_optimizers(where: str | Path, opts: list[torch.optim.Optimizer], opt_arrays: dict[str, np.ndarray],
                     meta: dict[str, Any]) -> None:
    if opts:
        if "param_groups" not in meta:
            raise _session.ConfigError(f"{_NAME}.load_checkpoint({where}): the checkpoint holds no optimizer state "
                                       "(saved without an optimizer); load it without one")
        several = isinstance(meta["scalars"], list)
        saved = len(meta["scalars"]) if several else 1
        if saved != len(opts):
            raise _session.ConfigError(f"{_NAME}.load_checkpoint({where}): it holds {saved} optimizer(s)' state, "
                                       f"{len(opts)} given; pass the optimizers it was saved with, in that order")
        for j, opt in enumerate(opts):
            prefix, groups = (f"{j}:", meta["param_groups"][j]) if several else ("", meta["param_groups"])
            scalars = meta["scalars"][j] if several else meta["scalars"]
            opt.load_state_dict(_unpack_optimizer(prefix, opt_arrays, groups, scalars))


def _optimizers(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def _pack_optimizer(opt: torch.optim.Optimizer, prefix: str, out: dict[str, np.ndarray]) -> tuple[list, dict]:
    sd = opt.state_dict()
    scalars: dict[str, Any] = {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{prefix}{i}.{k}"] = to_numpy(v)
            else:
                scalars[f"{i}.{k}"] = v
    return sd["param_groups"], scalars


def _unpack_optimizer(prefix: str, arrays: dict[str, np.ndarray], groups: list, scalars: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, a in arrays.items():
        if key.startswith(prefix) and (prefix or ":" not in key):
            i, k = key[len(prefix):].split(".", 1)
            state.setdefault(int(i), {})[k] = torch.from_numpy(np.array(a))
    for key, v in scalars.items():
        i, k = key.split(".", 1)
        state.setdefault(int(i), {})[k] = v
    return {"state": state, "param_groups": groups}


@dataclasses.dataclass
class Rows:
    """Checkpoint state whose tensors' first dimension is this rank's samples (`md.rows`)."""
    value: Any


def rows(value: Any) -> Rows:
    """Mark `value` (tensors, or dicts, lists, tuples and dataclasses of them) for
    `save_checkpoint` as per-sample rows of this rank: a carry of reasoning state between
    steps. Saved as the cluster's rows in rank order (what one process with the global batch
    holds); `load_checkpoint` gives each rank its rows by the shares of that batch."""
    return Rows(value)


def _pack_state(name: str, value: Any, tensors: dict[str, np.ndarray]) -> Any:
    """A `save_checkpoint` state value as JSON: itself, or a tree naming the arrays it went to."""
    if isinstance(value, Rows):
        mine: dict[str, np.ndarray] = {}
        tree = _pack_tree(value.value, f"rows/{name}", mine)
        tensors.update(_gather_rows(name, mine))
        return {"__md_rows__": tree}
    found: dict[str, np.ndarray] = {}
    tree = _pack_tree(value, f"state/{name}", found)
    if not found:
        return value
    tensors.update(found)
    return {"__md_tensors__": tree}


def _pack_tree(tree: Any, key: str, out: dict[str, np.ndarray]) -> Any:
    if isinstance(tree, torch.Tensor):
        out[key] = to_numpy(tree)
        return {"tensor": key, "dtype": str(tree.dtype).removeprefix("torch."), "cpu": tree.device.type == "cpu"}
    if isinstance(tree, np.ndarray):
        out[key] = tree
        return {"ndarray": key}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: _pack_tree(getattr(tree, f.name), f"{key}.{f.name}", out)
                           for f in dataclasses.fields(tree)}}
    if isinstance(tree, dict):
        bad = [k for k in tree if not isinstance(k, str)]
        if bad:
            raise _session.ConfigError(f"{_NAME}.save_checkpoint: state '{key}' has the key {bad[0]!r}, not a "
                                       "string; use string keys (or save a tensor of the values)")
        return {"dict": {k: _pack_tree(v, f"{key}.{k}", out) for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)):
        return {"list" if isinstance(tree, list) else "tuple": [_pack_tree(v, f"{key}.{i}", out) for i, v in enumerate(tree)]}
    try:
        json.dumps(tree)
    except (TypeError, ValueError):
        raise _session.ConfigError(f"{_NAME}.save_checkpoint: state '{key}' is a {type(tree).__name__}, neither "
                                   "a JSON value nor tensors; save its state_dict() or a tensor of it") from None
    return {"value": tree}


def _welcome(classes: Iterable[type | ModuleType]) -> dict[str, type]:
    """The dataclasses a loading script hands in, by the name a checkpoint stores for them."""
    found: dict[str, type] = {}
    for c in classes:
        members = vars(c).values() if isinstance(c, ModuleType) else [c]
        for m in members:
            if isinstance(m, type) and dataclasses.is_dataclass(m):
                found[f"{m.__module__}:{m.__qualname__}"] = m
    return found


_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class _Unpacker:
    """A checkpoint's state trees back into values: tensors from the arrays beside them,
    dataclasses only of the classes the loading script welcomed. A tree is a file from
    elsewhere, so each node is checked and a bad one is one line naming the checkpoint."""

    def __init__(self, where: str, arrays: dict[str, np.ndarray], welcome: dict[str, type]):
        self.where, self.arrays, self.welcome = where, arrays, welcome
        self.notes: list[str] = []

    def state(self, name: str, value: Any) -> Any:
        if isinstance(value, dict) and "__md_rows__" in value:
            s = _session.current(_NAME)
            mine = {k: a for k, a in self.arrays.items() if k == f"rows/{name}" or k.startswith(f"rows/{name}.")}
            sizes = {a.shape[0] if a.ndim else 0 for a in mine.values()}
            if len(sizes) > 1:
                raise self._bad(f"md.rows({name}) holds tensors of {sorted(sizes)} rows; each must have the global "
                                "batch's rows (save them so)")
            begin, end = _session.my_slice(s.shares(sizes.pop()), s.rank) if sizes else (0, 0)
            return _Unpacker(self.where, {k: a[begin:end] for k, a in mine.items()}, self.welcome)._tree(
                value["__md_rows__"], name, 0, self.notes)
        if isinstance(value, dict) and "__md_tensors__" in value:
            return self._tree(value["__md_tensors__"], name, 0, self.notes)
        return value

    def _tree(self, tree: Any, path: str, depth: int, notes: list[str]) -> Any:
        if not isinstance(tree, dict) or len(tree) not in (1, 2, 3) or depth > 64:
            raise self._bad(f"state '{path}' is not a tree mlxdist wrote")
        if "tensor" in tree:
            t = torch.from_numpy(np.array(self._array(tree["tensor"], path)))
            dtype = _TORCH_DTYPES.get(tree.get("dtype"))
            if dtype is None:
                raise self._bad(f"state '{path}' has the dtype {tree.get('dtype')!r}, not a tensor dtype")
            t = t.to(dtype)
            return t if tree.get("cpu", True) is True else t.to(_session.current(_NAME).device)
        if "ndarray" in tree:
            return np.array(self._array(tree["ndarray"], path))
        if "dataclass" in tree:
            fields = tree.get("fields")
            if not isinstance(fields, dict):
                raise self._bad(f"state '{path}' is a dataclass with no fields")
            values = {k: self._tree(v, f"{path}.{k}", depth + 1, notes) for k, v in fields.items()}
            name = str(tree["dataclass"])
            cls = self.welcome.get(name)
            if cls is None:
                note = (f"{_NAME}.load_checkpoint: state '{path}' was saved as the dataclass {name[:200]}; it comes "
                        f"back as a dict of its fields (a checkpoint names no code to run): pass "
                        f"classes=[{name.rpartition(':')[2].rpartition('.')[2][:80]}] to load_checkpoint for the class")
                if note not in notes:
                    notes.append(note)
                return values
            wanted = {f.name for f in dataclasses.fields(cls) if f.init}
            if set(values) != wanted:
                raise self._bad(f"state '{path}' holds the fields {sorted(values)} of {name}, the class given has "
                                f"{sorted(wanted)}; load with the class it was saved with")
            return cls(**values)
        if "dict" in tree and isinstance(tree["dict"], dict):
            return {k: self._tree(v, f"{path}.{k}", depth + 1, notes) for k, v in tree["dict"].items()}
        for kind in (list, tuple):
            if isinstance(tree.get(kind.__name__), list):
                return kind(self._tree(v, f"{path}.{i}", depth + 1, notes) for i, v in enumerate(tree[kind.__name__]))
        if "value" in tree:
            return gate.check(tree["value"], gate.Tree(), self.where, path)
        raise self._bad(f"state '{path}' is not a tree mlxdist wrote")

    def _array(self, key: Any, path: str) -> np.ndarray:
        if not isinstance(key, str) or key not in self.arrays:
            raise self._bad(f"state '{path}' names the array {str(key)[:80]!r}, which the checkpoint does not hold")
        return self.arrays[key]

    def _bad(self, problem: str) -> _session.ConfigError:
        err = _session.ConfigError(f"{self.where}: {problem}; is it the right checkpoint, or was it edited?")
        err.quiet = _session.current(_NAME).rank != 0
        return err


def _gather_rows(name: str, mine: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every rank's rows of each array, concatenated in rank order (collective)."""
    s = _session.current(_NAME)
    flat = [k for k, a in mine.items() if a.ndim == 0]
    if flat:
        raise _session.ConfigError(f"{_NAME}.save_checkpoint: md.rows({name}) holds '{flat[0]}', a tensor with no "
                                   "first dimension; keep per-sample tensors in md.rows(), the rest beside it")
    sizes = sorted({a.shape[0] for a in mine.values()})
    if len(sizes) > 1:
        raise _session.ConfigError(f"{_NAME}.save_checkpoint: md.rows({name}) holds tensors of {sizes} rows; each "
                                   "must have this rank's samples as its first dimension")
    theirs = s.world.allgather(mine) if s.size > 1 else [mine]
    if any(t.keys() != mine.keys() for t in theirs):
        raise _session.ConfigError(f"{_NAME}.save_checkpoint: md.rows({name}) holds other tensors on another rank; "
                                   "give every rank the same structure")
    return {k: np.concatenate([t[k] for t in theirs]) for k in mine}


class DistributedOptimizer:
    """`optimizer` whose step sums gradients over ranks and divides by the cluster's units
    (`backward(loss, count)` or `step(count=N)`). `reduction`: how the loss covers its units,
    'mean' (the default, as torch's: it is weighed by `count`) or 'sum'. Left unsaid, a loss
    given to `backward()` that is plainly a sum (its last operation a `.sum()` or a
    `reduction="sum"` loss) is refused in one line rather than weighed by its count again.

    Only the model's parameters this optimizer holds are summed, so a script's second
    optimizer (its own DistributedOptimizer) never sums them twice. `rows`: tensors whose first
    dimension is this rank's samples, stepped by this optimizer (a sparse embedding's looked-up
    rows and their ids, buffers): for the step they hold every rank's rows in rank order (their
    gradients divided by the cluster's units, as the parameters'), as one process with the
    global batch holds them, then this rank's again. Any optimizer's `step()` works, also one
    that takes no closure.

    A step whose summed gradients hold NaN or infinity is skipped on every rank (no update,
    gradients zeroed), counted and said, as the trainer skips it: one bad batch should not
    poison the weights and the optimizer's moments for good. `max_nonfinite_steps` of them in a
    row end the job in one line (default: the config's `control.max_nonfinite_steps`, else the
    trainer's 10).

    The object's class is built per optimizer class (`DistributedAdamW`: this and AdamW), and
    it shares the optimizer's state (`__dict__`): LR schedulers and `isinstance` see the
    optimizer they expect, and `isinstance(opt, DistributedOptimizer)` tells a wrapped one."""

    def __new__(cls, optimizer: torch.optim.Optimizer | None = None, model: torch.nn.Module | None = None,
                reduction: str | None = None, bucket_mb: float = 25.0, wire_dtype: str = "float32",
                overlap: bool = True, rows: Sequence[torch.Tensor] = (),
                max_nonfinite_steps: int | None = None) -> DistributedOptimizer:
        if cls is not DistributedOptimizer:  # a built class's bare object (copy.deepcopy)
            return super().__new__(cls)
        if optimizer is None or model is None:
            raise TypeError(f"{_NAME}.DistributedOptimizer(optimizer, model): both are needed")
        built = type(f"Distributed{type(optimizer).__name__}", (DistributedOptimizer, type(optimizer)), {})
        dist = object.__new__(built)
        dist.__dict__ = optimizer.__dict__
        dist._setup(model, reduction, bucket_mb, wire_dtype, overlap, list(rows), max_nonfinite_steps)
        return dist

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: `__new__` made the object, and the optimizer's own `__init__` already ran."""

    def _setup(self, model: torch.nn.Module, reduction: str | None, bucket_mb: float, wire_dtype: str,
               overlap: bool, rows: list[torch.Tensor], max_nonfinite_steps: int | None = None) -> None:
        from .cluster.transport import make_transport
        from .sync.torch_grad import TorchGradSync

        if reduction not in ("mean", "sum", None):
            raise ValueError(f"{_NAME}.DistributedOptimizer: reduction '{reduction}' is not 'mean' or 'sum'")
        s = _session.current(_NAME)
        held = {id(p) for group in self.param_groups for p in group["params"]}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in held]
        if not named and not rows:
            raise _session.ConfigError(f"{_NAME}.DistributedOptimizer({type(self).__name__[len('Distributed'):]}): "
                                       "it holds none of the model's trainable parameters; wrap the optimizer of "
                                       "the model's parameters, or name its per-sample buffers in rows=[...]")
        bad = [i for i, t in enumerate(rows) if not isinstance(t, torch.Tensor) or t.ndim == 0]
        if bad:
            raise _session.ConfigError(f"{_NAME}.DistributedOptimizer: rows[{bad[0]}] is not a tensor with a first "
                                       "dimension (this rank's samples)")
        _session.check_same_shapes(s, {n: tuple(p.shape) for n, p in named}, f"{_NAME}.DistributedOptimizer")
        self._md_session, self._md_reduction, self._md_checked = s, reduction or "mean", reduction is not None
        self._md_rows, self._md_swapped = rows, []
        self._md_grads = ParamGradients([p for _, p in named], model)
        self._md_sync = (TorchGradSync(make_transport(s.world, "mpi4py"), bucket_mb, wire_dtype, overlap)
                         if s.size > 1 else None)
        self._md_nonfinite = _session.nonfinite_policy(f"{_NAME}.DistributedOptimizer", s, max_nonfinite_steps)
        self._md_state = _session.model_state_sync(s, _torch_state(model))
        self._md_count: int | None = None  # units since the last step; None: none given yet
        self._md_divisors: list[float | None] = []  # what each backward() loss of the step was divided by
        self._md_armed, self._md_quiet, self._md_synced = False, False, None

    def backward(self, loss: torch.Tensor, count: int) -> None:
        """`loss.backward()` of `count` units (a mean over them with reduction='mean', their
        sum with 'sum'). Not inside `no_sync()`, it is the step's last: buckets go out as
        backward finishes them."""
        if self._md_armed:
            raise RuntimeError(f"{_NAME}: backward() twice in one step; wrap all but the step's last backward in "
                               "`with optimizer.no_sync():` (gradient accumulation)")
        if not self._md_checked:
            self._md_checked = True
            _refuse_summed_loss(loss)
        if not self._md_quiet:
            self.send_during_backward()
        self._md_divisors.append(_constant_divisor(loss))
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
        """Sum gradients over ranks and divide by the cluster's units; returns those units, or 0
        for a step to skip (no unit anywhere; NaN or infinity in the sum: then the gradients are
        already gone, so an optimizer stepped anyway moves nothing). `count`: this rank's units
        when backward was plain `loss.backward()`. Call it before clipping by the global norm;
        `step()` then does not sum again. `own_step`: the caller steps the wrapped optimizer
        itself (Lightning, after clipping), so this object's `step()` keeps no record of this sum."""
        if count is not None:
            if self._md_reduction == "mean":
                torch._foreach_mul_([g for g in self._md_grads.gradients() if g is not None], float(count))
                for t in self._md_rows:
                    if t.grad is not None:
                        t.grad.mul_(float(count))
            self.add_count(count)
        if self._md_count is None:
            raise RuntimeError(f"{_NAME}: step() without a count; use optimizer.backward(loss, count=N) or "
                               "optimizer.step(count=N) (this rank's samples, or units, in the step)")
        divisors, self._md_divisors = self._md_divisors, []
        _refuse_divided_by_micro_steps(divisors)
        s = self._md_session
        grads = self._md_grads.gradients()
        summed = grads
        if self._md_sync is not None and grads:
            summed, _ = self._md_sync.all_sum(grads)
            self._md_grads.on_gradient_ready(None)
        # Judged on the sums (and the rows' gradients, which every rank will hold), and agreed
        # in the count's own all-reduce, so every rank skips the same step.
        bad = 0.0 if _finite([*summed, *(t.grad for t in self._md_rows if t.grad is not None)]) else 1.0
        mine = self._md_count
        if s.size > 1:
            total_f, bad = s.world.allreduce_sum([float(self._md_count), bad])
            total = int(total_f)
        else:
            total = self._md_count
        self._md_count, self._md_armed = None, False
        if self._md_state is not None:  # BatchNorm's running statistics by rows, as the trainer keeps them
            self._md_state(mine)
        if total > 0:
            _session.judge_update(_NAME, s, self._md_nonfinite, not bad,  # the last straw: one line
                                  "no update, the gradients zeroed")
        if total > 0 and bad:
            self.zero_grad(set_to_none=True)
            for t in self._md_rows:
                t.grad = None
            total = 0
        elif total > 0:
            with torch.no_grad():
                for p, g in zip(self._md_grads.params, summed, strict=True):
                    if g is p.grad:
                        g.div_(total)
                    else:  # a fresh tensor: the sum's buffer is not the gradient's to keep
                        p.grad = (g.reshape(p.shape) / total).to(p.device)
            self._gather_rows(total)
        else:
            s.skipped_steps += 1
            _say(s, f"{_NAME}: step skipped: no rank had a unit to learn from (count 0 everywhere; "
                    f"{s.skipped_steps} so far)")
        self._md_synced = None if own_step else total
        return total

    def _gather_rows(self, total: int) -> None:
        """Each `rows` tensor (and its gradient, divided by `total`) as every rank's rows in
        rank order, until `step()` puts this rank's back."""
        s = self._md_session
        for t in self._md_rows:
            grad = None if t.grad is None else t.grad / total
            parts = s.world.allgather((to_numpy(t), None if grad is None else to_numpy(grad))) if s.size > 1 \
                else [(None, None)]
            whole = torch.cat([torch.from_numpy(d) for d, _ in parts]).to(t) if s.size > 1 else t.data
            self._md_swapped.append((t, t.data, grad))
            t.grad = None
            t.data = whole
            if grad is not None:
                t.grad = torch.cat([torch.from_numpy(g) for _, g in parts]).to(grad) if s.size > 1 else grad

    def _put_back_rows(self) -> None:
        for t, data, grad in self._md_swapped:
            t.grad = None
            t.data = data
            t.grad = grad
        self._md_swapped = []

    def step(self, closure=None, count: int | None = None):
        """Sum (unless `synchronize()` did), then the optimizer's own step: with `closure` only
        when one is given, so an optimizer whose `step(self)` takes none works."""
        if self._md_synced is None:
            self.synchronize(count)
        total, self._md_synced = self._md_synced, None
        if total == 0:
            self._put_back_rows()
            self.zero_grad(set_to_none=True)
            return None
        try:
            return super().step() if closure is None else super().step(closure)
        finally:
            self._put_back_rows()


def _torch_state(model: torch.nn.Module) -> Any:
    """The model's state beyond what trains (buffers, frozen weights), tracked for changes."""
    from .engine.model_state import TorchModelState

    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return TorchModelState(model, lambda: {n: t for n, t in model.state_dict(keep_vars=True).items()
                                           if n not in trained})


class DistributedSampler(_session.RankSampler, torch.utils.data.Sampler):
    """This rank's share of every global batch of a shuffled stream that depends only on
    (seed, position): `DataLoader(data, batch_size=sampler.batch_size, sampler=sampler)`. Each
    epoch is `len(data) // global_batch` global batches; `set_epoch(e)` as with torch's, and
    `start_step` continues a resumed run where it stopped. The same rows as `mlxdist.mlx`'s."""

    def __init__(self, n_samples: int, global_batch: int, seed: int = 0, start_step: int = 0):
        s = _session.current(_NAME)
        super().__init__(n_samples, global_batch, s.shares(global_batch), s.rank, seed, start_step,
                         f"{_NAME}.DistributedSampler")

    def __len__(self) -> int:
        return len(self.epoch_steps()) * self.batch_size

    def __iter__(self):
        for step in self.epoch_steps():
            yield from self.indices(step).tolist()


class DistributedIterable:
    """This rank's rows of each global batch an iterable yields (an `IterableDataset`, or the
    `DataLoader` over one, that makes whole global batches the same way on every rank: seeded,
    in a fixed order): every tensor or array in an item (a dict, tuple or list of them, at any
    depth) whose first dimension is `global_batch` is cut to this rank's share (`md.shares`);
    the rest (a set's name, a batch count) passes as it is. `start_step`: global batches of
    the first pass to skip, for a resumed run (the source makes them again, deterministic)."""

    def __init__(self, source: Iterable[Any], global_batch: int, start_step: int = 0):
        s = _session.current(_NAME)
        self.source, self.global_batch, self.start_step = source, int(global_batch), int(start_step)
        self.begin, self.end = _session.my_slice(s.shares(self.global_batch), s.rank)
        self.batch_size = self.end - self.begin
        self._passes = 0

    def __iter__(self) -> Iterator[Any]:
        skip = self.start_step if self._passes == 0 else 0
        self._passes += 1
        for i, item in enumerate(self.source):
            if i < skip:
                continue
            cut, hits = self._cut(item)
            if not hits:
                raise _session.ConfigError(f"{_NAME}.DistributedIterable: item {i} holds no tensor or array of "
                                           f"global_batch={self.global_batch} rows; give the source whole global "
                                           "batches (every rank the same) and their size")
            yield cut

    def _cut(self, item: Any) -> tuple[Any, int]:
        if isinstance(item, (torch.Tensor, np.ndarray)) and item.ndim and item.shape[0] == self.global_batch:
            return item[self.begin:self.end], 1
        if isinstance(item, dict):
            parts = {k: self._cut(v) for k, v in item.items()}
            return {k: v for k, (v, _) in parts.items()}, sum(h for _, h in parts.values())
        if isinstance(item, (list, tuple)):
            parts = [self._cut(v) for v in item]
            return type(item)(v for v, _ in parts), sum(h for _, h in parts)
        return item, 0


_COMBINING = {"AddBackward0", "SubBackward0", "NegBackward0", "MulBackward0"}


def _loss_kinds(fn: Any, depth: int = 0) -> set[str]:
    """What a loss's last operations are, through sums of terms and scalings by a number:
    'sum' (a `.sum()`, a loss with reduction='sum'), 'mean', or 'other'."""
    if fn is None:
        return set()
    name = type(fn).__name__
    nexts = [n for n, _ in fn.next_functions if n is not None]
    if name in _COMBINING and depth < 16 and (name != "MulBackward0" or len(nexts) == 1):
        return set().union(*(_loss_kinds(n, depth + 1) for n in nexts)) if nexts else set()
    if name == "SumBackward0" or getattr(fn, "_saved_reduction", None) == 2:
        return {"sum"}
    return {"mean"} if name == "MeanBackward0" or getattr(fn, "_saved_reduction", None) == 1 else {"other"}


def _refuse_summed_loss(loss: torch.Tensor) -> None:
    """A summed loss weighed as a mean counts each rank's samples twice (3 and 5 rows: rank 1's
    gradient 5/3 as strong): refuse it, once, where the loss plainly is one."""
    if _loss_kinds(loss.grad_fn) == {"sum"}:
        err = _session.ConfigError(f"{_NAME}.DistributedOptimizer.backward: the loss is a sum over its units (its "
                                   "last operation a .sum() or reduction='sum'), but reduction is 'mean' (the "
                                   "default), which weighs it by count again; pass reduction='sum' to "
                                   "DistributedOptimizer, or reduction='mean' if it is a mean after all")
        err.quiet = _session.current(_NAME).rank != 0
        raise err


def _finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value is finite, judged by the norm as the trainer's torch engine judges
    its update: one reduction and one wait for the device, not one per tensor. A norm past
    float32's range counts as non-finite there too."""
    return not tensors or math.isfinite(float(torch.nn.utils.get_total_norm(tensors, 2.0)))


def _constant_divisor(loss: torch.Tensor) -> float | None:
    """c when the loss's last operation divides it by a constant c > 1 (`loss / accum`, or
    `loss * (1 / accum)`), else None."""
    fn = loss.grad_fn
    name = type(fn).__name__ if fn is not None else ""
    if name not in ("DivBackward0", "MulBackward0"):
        return None
    other = getattr(fn, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.ndim or other.requires_grad:
        return None
    value = float(other)
    c = value if name == "DivBackward0" else (1 / value if 0 < value < 1 else 0.0)
    return c if c > 1 else None


def _refuse_divided_by_micro_steps(divisors: list[float | None]) -> None:
    """A DDP script's accumulation divides each micro-batch's mean loss by the number of
    micro-steps; `backward(loss, count)` weighs each by its count already, so such a step
    would be 1/n of what it should be. Refused in one line (it is never what was meant)."""
    n = len(divisors)
    if n < 2 or any(d is None or abs(d - n) > 1e-6 * n for d in divisors):
        return
    err = _session.ConfigError(
        f"{_NAME}.DistributedOptimizer.backward: each of this step's {n} losses was divided by {n:g} (the number of "
        f"micro-steps, as DDP scripts do), but backward(loss, count) already weighs each micro-batch by its count, "
        f"so the step would be 1/{n:g} of what it should be; either pass each micro-batch's mean loss (drop the "
        f"'/ {n:g}'), or keep it and run loss.backward() yourself, then optimizer.synchronize(count=THIS_RANKS_SAMPLES"
        "_IN_THE_STEP) before clipping and step() (docs/your-loop.md, Accumulation)")
    err.quiet = _session.current(_NAME).rank != 0
    raise err


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


__all__ = ["DistributedIterable", "DistributedOptimizer", "DistributedSampler", "Info", "Rows", "all_gather", "all_reduce", "broadcast",
           "broadcast_object", "info", "init", "load_checkpoint", "rows", "save_checkpoint", "set_device", "shares",
           "should_stop", "sync_batchnorm", "to_cpu", "to_numpy"]
