"""PyTorch engine (MPS, CUDA or CPU), one per rank, with the MLX engine's exact step contract.

Why it exists: the same config and checkpoints can be trained on an NVIDIA box or a
single Mac through torch, and compared number-for-number with the MLX engine. For that
the two must share parameter names, initial weights, the summed-loss gradient
convention of `base.py`, and the optimizer's math (`mlxdist.optim`, written once: decoupled
decay on ndim >= 2 parameters, state stored as `m.<param>` / `v.<param>` for AdamW), run here
over all parameters at once (`optim.torch_ops.Many`, one `torch._foreach_*` call an operation).

Speed knobs and their defaults (each printed by `describe()`):
  * TF32 matmuls/convolutions on CUDA: on, because the master weights and optimizer stay
    fp32 and TF32's 10-bit mantissa is far below the noise of SGD; set `MLXDIST_TF32=0` to
    get bit-for-bit fp32 matmuls (e.g. when comparing against the MLX engine).
  * `torch.compile` of the model forward: on for CUDA, off for MPS/CPU (slow to compile,
    little gain there); any non-empty `DISABLE_COMPILE` other than "0" turns it off.
  * `model.dtype`: bfloat16 -> autocast bf16; float16 -> autocast fp16 + GradScaler (on a
    CPU both are slower than float32, and the start-up says so: `slow_autocast_note`).
    Master weights are always fp32.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..config import Config
from ..models.build import BuiltModel, adopt_torch, build_torch, built_from_task
from ..models.presets import ModelArgs
from ..models.weights import checksum
from ..optim import check_state, make_optimizer, torch_ops
from ..tasks import Batch, Task, TaskContext, sample_seeds_of, tree_map
from ..tasks.lm import lm_model
from ..tasks.metrics import MetricSums, split_loss
from .base import (
    Capabilities,
    LocalGradients,
    Piece,
    StepStats,
    as_batch,
    check_scalar,
    nothing_to_learn,
)
from .common import check_weights, decays, sample_tokens, task_optimizers
from .memory import MemoryReading, mps_reading, process_reading, with_override
from .model_state import TorchModelState, state_numpy
from .staged import Output, ReleasesWeights, Staged, StagedShardOps, model_input
from .torch_grads import ParamGradients

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cuda_missing_reason() -> str:
    if torch.version.cuda is None:
        return (
            f"no CUDA GPU visible to torch {torch.__version__} (a CPU-only build); "
            "install a CUDA build of torch (see pytorch.org/get-started) or use --device auto"
        )
    return (
        f"no CUDA GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda} build); "
        "check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or use --device auto"
    )


def _mps_missing_reason() -> str:
    if platform.system() != "Darwin":
        return (
            f"MPS needs an Apple Silicon Mac (this is {platform.system()}); "
            "use --device auto, or the MLX engine on a Mac"
        )
    if not torch.backends.mps.is_built():
        return (
            f"torch {torch.__version__} was built without MPS; "
            "`pip install torch` from pypi.org (macOS arm64 wheels include MPS) or use --device cpu"
        )
    return "MPS is built but unavailable (needs macOS 12.3+ on Apple Silicon); use --device cpu"


def select_device(requested: str, local_rank: int = 0) -> tuple[str, str]:
    """(device, reason) for `--device`; auto prefers cuda > mps > cpu. Under mpirun, auto
    and `cuda` give each rank of a host its own GPU (cuda:LOCAL_RANK mod the GPU count).

    An explicit device that is missing is an error rather than a silent fallback: a run
    meant for a GPU that quietly lands on the CPU wastes hours before anyone notices.
    """
    req = (requested or "auto").strip().lower()
    if req == "auto":
        if torch.cuda.is_available():
            dev = f"cuda:{local_rank % torch.cuda.device_count()}"
            return dev, f"auto: CUDA GPU found ({torch.cuda.get_device_name(dev)})"
        if torch.backends.mps.is_available():
            return "mps", "auto: no CUDA GPU; Apple MPS available"
        return "cpu", "auto: no CUDA GPU or Apple MPS visible to torch"
    if req == "cuda" or req.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {req}: {_cuda_missing_reason()}")
        if req == "cuda":
            req = f"cuda:{local_rank % torch.cuda.device_count()}"
        if ":" in req:
            idx = req.split(":", 1)[1]
            if not idx.isdigit() or int(idx) >= torch.cuda.device_count():
                raise RuntimeError(
                    f"--device {req}: torch sees {torch.cuda.device_count()} CUDA device(s) "
                    f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
                )
        return req, f"requested: {torch.cuda.get_device_name(torch.device(req))}"
    if req == "mps":
        if not torch.backends.mps.is_available():
            raise RuntimeError(f"--device mps: {_mps_missing_reason()}")
        return "mps", "requested: Apple MPS"
    if req == "cpu":
        return "cpu", "requested"
    raise RuntimeError(f"--device {requested}: unknown device (use auto, cuda, cuda:N, mps or cpu)")


def compile_enabled(device: str) -> tuple[bool, str]:
    """Whether to `torch.compile` the forward on `device`, and why (for `describe()`)."""
    flag = os.environ.get("DISABLE_COMPILE", "")
    if flag not in ("", "0"):
        return False, "DISABLE_COMPILE set"
    if device.startswith("cuda"):
        return True, "default on CUDA"
    return False, f"default off on {device.split(':')[0]}"


# Step time against float32 for examples/audio's CNN on a 2-core x86 Linux box (bf16: 4.4x
# here, 5x in the run that first met it; fp16 with its GradScaler: 2.7x).
_CPU_AUTOCAST_COST = {"bfloat16": "4-5x", "float16": "~3x"}


def slow_autocast_note(device_type: str, dtype: str) -> str | None:
    """The banner's one line when `model.dtype` asks for autocast on a CPU, else None.

    A Mac config (bf16, meant for MPS) run on a Linux CPU with `--device auto` autocasts its
    matmuls and convolutions to bf16, which CPUs without bf16 units run far slower than fp32,
    and nothing said why."""
    if device_type != "cpu" or dtype == "float32":
        return None
    cost = _CPU_AUTOCAST_COST.get(dtype, "several times")
    return (f"note: model.dtype {dtype} autocast is slow on a CPU (examples/audio: {cost} float32's step time); "
            "model.dtype=float32 on the command line, or `model: {dtype: float32}` in the config, turns it off")


def _tf32_wanted() -> bool:
    return os.environ.get("MLXDIST_TF32", "1") not in ("0", "", "false", "off")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()


def _float(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


def flipped(name: str) -> bool:
    """Whether the torch weight `name` is held transposed to its checkpoint layout: PEFT stores
    LoRA factors (`*.lora_a`, `*.lora_b`) transposed to mlx-lm's layout, and checkpoints use
    mlx-lm's, so a LoRA checkpoint moves between engines as it is. Whatever moves torch weights
    to or from a checkpoint (export, the sharded strategies) transposes these."""
    return name.endswith((".lora_a", ".lora_b"))


def _ours(name: str, a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T) if flipped(name) else a


class TorchEngine(ReleasesWeights):
    """`engine/base.py`'s `Engine` on one torch device, offering generation, sharding (staged
    where the model has stages), adapters and overlap (`capabilities`)."""

    name = "torch"
    notes_extra: list[str] = []

    def __init__(self, cfg: Config, device: str = "auto", args: ModelArgs | None = None, task: Task | None = None,
                 local_rank: int = 0, micro_batch: int = 0):
        """`task` defaults to the built-in LM of `cfg`; `args` overrides its preset's shape (tests)."""
        self.cfg = cfg
        self.device, self.device_reason = select_device(device, local_rank)
        self.device_type = self.device.split(":")[0]
        self.dev = torch.device(self.device)

        self.dtype_name = cfg.model.dtype
        self.amp_dtype = _DTYPES[self.dtype_name]
        self.tf32 = self.device_type == "cuda" and _tf32_wanted()
        if self.device_type == "cuda":
            # Set both ways: the flags are process-global, and an earlier engine in the same
            # process (tests, notebooks) must not leave TF32 on when MLXDIST_TF32=0 asks not to.
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32

        task = task or lm_model(cfg, args)
        self.task_loss, self.task_name = task.loss, task.name
        ctx = TaskContext("torch", self.device, cfg.train.seed, cfg, micro_batch)
        torch.manual_seed(cfg.train.seed)  # a model initialised without a seed still starts the same every run
        built = built_from_task(task.build(ctx), adopt_torch, self.dev, task.name)
        self.model = built.module
        self.whole_state = built.whole_state
        self.model.train()
        self._names = sorted(built.params)
        self.trained_names = self._names
        self._params = [built.params[n] for n in self._names]

        self.compiled, self.compile_reason = compile_enabled(self.device)
        # Compile only the forward: the loss, optimizer and sampling stay eager, so
        # variable-length sampling never triggers recompiles.
        self._forward = torch.compile(self.model) if self.compiled else self.model

        self.optimizer = make_optimizer(cfg.train.optimizer, cfg.train)
        self._decay = [decays(tuple(p.shape)) for p in self._params]
        # The optimizer's state by its names, each a list in `_names` order; None: zeros, not
        # allocated yet (a fresh run; a sharded run, whose shards hold it).
        self._opt_state: dict[str, list[torch.Tensor]] | None = None
        self.optimizers, self.own_optimizer = self._make_optimizers(task), task.optimizer is not None
        # Each group's learning rate as built: the schedule scales it by schedule(step) / train.lr.
        self._base_lrs = [[g["lr"] for g in o.param_groups] for o in self.optimizers]
        # fp16's GradScaler unscales gradients through a torch optimizer; mlxdist's steps itself.
        self._unscaled = self.optimizers or [_GradCarrier(self._params)]
        self._updates = 0

        self.scaler: torch.amp.GradScaler | None = None
        if self.amp_dtype == torch.float16:
            if not torch.amp.autocast_mode.is_autocast_available(self.device_type):
                raise RuntimeError(
                    f"model.dtype float16: autocast is not available on {self.device}"
                )
            try:
                # The gradients are of the *summed* loss (b*T times a mean loss), so the
                # default 2**16 initial scale overflows fp16 on the first steps; the scale
                # is divided by the first micro-batch's token count in `micro_step`.
                self.scaler = torch.amp.GradScaler(self.device_type)
            except Exception as e:  # pragma: no cover - depends on the torch build
                raise RuntimeError(
                    f"model.dtype float16: torch {torch.__version__} has no GradScaler for "
                    f"{self.device_type} ({e}); use model.dtype=bfloat16"
                ) from None
        self._scaler_ready = False
        notes = [n for n in [slow_autocast_note(self.device_type, self.dtype_name)] if n] + self.notes_extra
        self.capabilities = Capabilities(task.name, own_optimizer=self.own_optimizer,
                                         loss_scaling=self.scaler is not None, compiled=self.compiled,
                                         staged=getattr(self.model, "stages", None) is not None, notes=tuple(notes),
                                         model_summary=built.summary, base_fingerprint=built.fingerprint,
                                         base=built.base, generation=True, shards=True, adapters=True, overlap=True)
        # `engine.base.Overlap`: the gradient sum reads gradients through these (engine/torch_grads.py).
        self.gradients = self._grads = ParamGradients(self._params, self.model)
        self.memory = TorchMemory(self.device_type, self.dev)
        self.last_skip_overflow = False
        self.model_state = TorchModelState(self.model, self._state_tensors)
        self._reset_accumulators()
        self._by_name = dict(zip(self._names, self._params, strict=True))
        self._shapes = {n: tuple(p.shape) for n, p in self._by_name.items()}
        self._nothing = torch.empty(0, device=self.dev)

    # ---------------------------------------------------------------- helpers
    def _make_optimizers(self, task: Task) -> list[torch.optim.Optimizer]:
        """The task's own optimizers; none for mlxdist's (`self.optimizer`)."""
        if task.optimizer is None:
            return []
        opts = task_optimizers(task, self.model, torch.optim.Optimizer, "a torch.optim.Optimizer (or a list of them)")
        covered = {id(p) for o in opts for g in o.param_groups for p in g["params"]}
        idle = [n for n, p in zip(self._names, self._params, strict=True) if id(p) not in covered]
        if idle:
            self.notes_extra = [f"note: task {task.name}: {len(idle)} parameter(s) get gradients but no optimizer of "
                                f"the task updates them ({', '.join(idle[:3])}{' ...' if len(idle) > 3 else ''})"]
        return opts


    def _reset_accumulators(self) -> None:
        self._loss_sum = torch.zeros((), device=self.dev, dtype=torch.float32)
        self._tokens = 0
        self._micro_steps = 0
        self._metrics = MetricSums()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a, np.float32 if a.dtype == np.float64 else None))
        # Non-blocking only on CUDA: on MPS a non-blocking copy from a temporary, unpinned
        # tensor can hand the kernel corrupted data (PyTorch issues 139550, 189690).
        return t.to(self.dev, non_blocking=self.device_type == "cuda")

    def _summed_loss(self, forward, batch: Batch, metrics: MetricSums | None = None) -> tuple[torch.Tensor, int]:
        data = tree_map(self._to_device, batch.data)
        with self._autocast(), sample_seeds_of(batch):
            loss, found = split_loss(self.task_loss(forward, data), self.task_name)
        if found:
            (self._metrics if metrics is None else metrics).add(found, _float)
        return check_scalar(loss, self.task_name).float(), batch.count

    # ---------------------------------------------------------------- protocol

    def describe(self) -> str:
        tf32 = (
            "on" if self.tf32 else ("off (MLXDIST_TF32=0)" if self.device_type == "cuda" else "n/a")
        )
        comp = f"{'on' if self.compiled else 'off'} ({self.compile_reason})"
        amp = self.dtype_name + (" autocast" if self.amp_dtype != torch.float32 else "")
        if self.scaler is not None:
            amp += " + GradScaler"
        return (
            f"torch {torch.__version__} on {self.device} ({self.device_reason}); "
            f"dtype {amp}, fp32 master weights; compile {comp}; tf32 {tf32}; "
            + (f"optimizer {self._describe_optimizers()} (the task's)" if self.own_optimizer
               else f"optimizer {self.optimizer.title} (multi-tensor)")
        )

    def _describe_optimizers(self) -> str:
        return ", ".join(f"{type(o).__name__} ({len(o.param_groups)} group{'s' * (len(o.param_groups) > 1)})"
                         for o in self.optimizers)

    def get_weights(self) -> dict[str, np.ndarray]:
        self._whole("get_weights")
        # Copies: on the CPU `.numpy()` would alias the live parameters, and a checkpoint
        # written in the background would then see later updates.
        return {n: _ours(n, _to_numpy(p)) for n, p in zip(self._names, self._params, strict=True)}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        check_weights({n: s[::-1] if flipped(n) else s for n, s in self._shapes.items()}, weights)
        with torch.no_grad():
            for name, p in zip(self._names, self._params, strict=True):
                if self.released:
                    p.data = torch.empty(self._shapes[name], device=self.dev)
                p.copy_(torch.from_numpy(_ours(name, np.asarray(weights[name], dtype=np.float32))))
        self.released = False

    # -- the rest of the model's state: a task's buffers and frozen weights ------------
    def _state_tensors(self) -> dict[str, torch.Tensor]:
        if not self.whole_state:
            return {}
        trained = set(self._names)
        return {n: t for n, t in self.model.state_dict(keep_vars=True).items() if n not in trained}

    def save_adapter(self, out_dir: Path) -> Path | None:
        """The trained adapter in PEFT's own layout (None when the whole model trained)."""
        peft_model = getattr(self.model, "peft", None)
        if peft_model is None:
            return None
        peft_model.save_pretrained(str(out_dir))
        return Path(out_dir)

    def weight_checksum(self) -> int:
        self._whole("weight_checksum")
        return checksum(_to_numpy(p) for p in self._params)

    def _from_numpy(self, value: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        """A fresh device tensor: `from_numpy` shares memory, and optimizer moments that
        alias the caller's arrays would be updated in place behind its back."""
        t = torch.tensor(np.asarray(value, dtype=np.float32), device=self.dev)
        return t.reshape(like.shape).contiguous()

    def get_optimizer_state(self) -> tuple[dict[str, np.ndarray], int]:
        """mlxdist's optimizer's state as `<state name>.<param>` (the MLX engine's names, so the
        two load each other's checkpoints); a task's own optimizers as `opt<i>.<param>.<key>`."""
        if self.own_optimizer:
            return self._own_optimizer_state(), self._updates
        out: dict[str, np.ndarray] = {}
        for k in self.optimizer.state_names:
            for i, name in enumerate(self._names):
                a = np.zeros(self._shapes[name], np.float32) if self._opt_state is None else _to_numpy(self._opt_state[k][i])
                out[f"{k}.{name}"] = _ours(name, a)
        return out, self._updates

    def _param_names(self) -> dict[int, str]:
        return {id(t): n for n, t in self.model.state_dict(keep_vars=True).items()}

    def _own_optimizer_state(self) -> dict[str, np.ndarray]:
        names, out = self._param_names(), {}
        for i, opt in enumerate(self.optimizers):
            for p, st in opt.state.items():
                for key, value in st.items():
                    out[f"opt{i}.{names.get(id(p), id(p))}.{key}"] = (
                        state_numpy(value) if torch.is_tensor(value) else np.asarray(value))
        return out

    def set_optimizer_state(self, state: dict[str, np.ndarray], step: int) -> None:
        if self.own_optimizer:
            self._set_own_optimizer_state(state)
            self._updates = int(step)
            return
        check_state(self.optimizer, self._names, state)
        self._updates = int(step)
        self._opt_state = {k: [self._from_numpy(_ours(n, state[f"{k}.{n}"]), p)
                               for n, p in zip(self._names, self._params, strict=True)]
                           for k in self.optimizer.state_names}

    def _set_own_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        tensors = self.model.state_dict(keep_vars=True)
        for i, opt in enumerate(self.optimizers):
            prefix = f"opt{i}."
            mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            opt.state.clear()
            for key, value in mine.items():
                name, field = key.rsplit(".", 1)
                p = tensors.get(name)
                if p is None:
                    raise ValueError(f"optimizer state for {name!r}, which the model does not have")
                like = opt.state[p].get(field) if p in opt.state else None
                v = torch.from_numpy(np.array(value))
                # torch's optimizers keep `step` on the CPU; moments live with their parameter.
                opt.state[p][field] = v if field == "step" else v.to(p.device, like.dtype if like is not None
                                                                         else (p.dtype if v.is_floating_point()
                                                                               else v.dtype))

    def shard_ops(self) -> TorchShardOps:
        return TorchShardOps(self)

    @property
    def trained_params(self) -> list[torch.Tensor]:
        """The trained parameters, in `trained_names` order (the shard ops update them in place)."""
        return self._params

    def drop_optimizer_state(self, step: int) -> None:
        """Let go of mlxdist's optimizer state (a strategy's shards hold it) and keep `step` as
        the update count; `set_optimizer_state` brings it back."""
        self._opt_state = None
        self._updates = int(step)

    @property
    def updates(self) -> int:
        """Updates made so far: AdamW's step count, kept here while sharding holds the moments."""
        return self._updates

    @updates.setter
    def updates(self, step: int) -> None:
        self._updates = int(step)

    def micro_step(self, batch) -> None:
        loss, n = self._summed_loss(self._forward, as_batch(batch))
        if self.scaler is not None:
            if not self._scaler_ready:
                self.scaler = torch.amp.GradScaler(
                    self.device_type, init_scale=max(2.0**16 / n, 1.0)
                )
                self._scaler_ready = True
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        self._loss_sum += loss.detach()
        self._tokens += n
        self._micro_steps += 1

    def take_gradients(self) -> LocalGradients:
        if self._micro_steps == 0:
            raise RuntimeError("TorchEngine.take_gradients() called before any micro_step()")
        # A parameter this rank's batches did not reach has no gradient: zeros, so every rank
        # hands the same list to the all-reduce.
        out = LocalGradients(self._grads.gradients(), float(self._loss_sum), self._tokens, self._metrics)
        for p in self._params:  # the next micro_step starts a fresh sum; apply_gradients puts these back
            p.grad = None
        self._grads.on_gradient_ready(None)
        self._reset_accumulators()
        return out

    def take_totals(self) -> LocalGradients:
        """Loss, units and metrics since the last take, with no gradients: a staged step
        (dist.shard=weights) handed those over stage by stage."""
        out = LocalGradients([], float(self._loss_sum), self._tokens, self._metrics)
        self._reset_accumulators()
        return out

    def apply_gradients(self, grads: list[torch.Tensor], loss_sum: float, count: int, lr: float) -> StepStats:
        if count <= 0:
            self._zero_grad()
            return nothing_to_learn(loss_sum)
        with torch.no_grad():
            for p, g in zip(self._params, grads, strict=True):
                if g is not None and g is not p.grad:  # sums handed back by the sync strategy
                    p.grad = g.to(p.device).reshape(p.shape)
        grads = [p.grad for p in self._params if p.grad is not None]
        if self.scaler is not None:
            for opt in self._unscaled:
                self.scaler.unscale_(opt)
        torch._foreach_mul_(grads, 1.0 / max(count, 1))
        grad_norm = float(torch.nn.utils.get_total_norm(grads, 2.0))
        finite = np.isfinite(loss_sum) and np.isfinite(grad_norm)
        self.last_skip_overflow = False
        if finite:
            if self.own_optimizer:
                self._own_step(lr, grad_norm)
            else:
                clip = self.cfg.train.grad_clip
                self._step(lr, min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0)
            if self.scaler is not None:
                self.scaler.update()
            self._updates += 1
        elif self.scaler is not None:
            # An fp16 overflow mostly means the loss scale is too high: shrink it and tell
            # the loop (via last_skip_overflow) that the model itself is probably fine.
            self.last_skip_overflow = np.isfinite(loss_sum)
            self.scaler.update()
        self._zero_grad()
        return StepStats(loss_sum=loss_sum, tokens=count, grad_norm=grad_norm, skipped=not finite)

    def _own_step(self, lr: float, grad_norm: float) -> None:
        clip = self.cfg.train.grad_clip
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params, clip, torch.tensor(grad_norm))
        scale = lr / self.cfg.train.lr if self.cfg.train.lr > 0 else 0.0
        for opt, base in zip(self.optimizers, self._base_lrs, strict=True):
            for group, group_lr in zip(opt.param_groups, base, strict=True):
                group["lr"] = group_lr * scale
            if self.scaler is not None:
                self.scaler.step(opt)
            else:
                opt.step()

    @torch.no_grad()
    def _step(self, lr: float, coef: float) -> None:
        """mlxdist's optimizer over every parameter at once (a parameter no batch reached has a
        zero gradient, as on the MLX engine)."""
        opt, keys, Many = self.optimizer, self.optimizer.state_names, torch_ops.Many
        if self._opt_state is None:
            self._opt_state = {k: [torch.zeros_like(p) for p in self._params] for k in keys}
        grads = Many([torch.zeros_like(p) if p.grad is None else p.grad for p in self._params])
        new, state = opt.update(torch_ops, Many([p.detach() for p in self._params]), grads,
                                tuple(Many(self._opt_state[k]) for k in keys),
                                opt.scalars(lr, self._updates + 1, coef), self._decay)
        # The primitives ending in `_` work in place, so the returned p is usually the parameters'
        # own storage; an update that returns new tensors (a primitive without `_` last) is
        # copied in, so no optimizer's result is lost.
        for p, q in zip(self._params, new.items, strict=True):
            if q.data_ptr() != p.data_ptr():
                p.detach().copy_(q)
        self._opt_state = {k: st.items for k, st in zip(keys, state, strict=True)}

    def _zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def discard_gradients(self) -> None:
        """Drop a half-accumulated step (after an out-of-memory), keeping weights and moments."""
        self._grads.on_gradient_ready(None)  # the retry's early micro-batches must not look final
        self._zero_grad()
        self._reset_accumulators()

    # -- dist.shard=weights: the model stage by stage (sync/fully_sharded.py) ------------
    def staged_step(self, batch, fetch: Callable[[int], list], hand: Callable[[int, list], None]) -> None:
        """The MLX engine's `staged_step` in torch: each stage's forward without a graph, then
        backward stage by stage, each recomputed from its input with `torch.autograd.grad`
        (the parameters' storage is the fetched weights while the stage runs)."""
        batch = as_batch(batch)
        stages = self.model.stages()
        data = tree_map(self._to_device, batch.data)
        last = len(stages) - 1
        with sample_seeds_of(batch):
            inputs = [model_input(self.task_loss, self.model, data, self.task_name)]
            with torch.no_grad():
                for i, (names, call) in enumerate(stages[:-1]):
                    inputs.append(self._stage(names, call, fetch(i), inputs[-1]))
                    self._let_go(names)
            names, call = stages[-1]
            with torch.enable_grad():
                h = inputs.pop().detach().requires_grad_()
                out = self._stage(names, call, fetch(last), h)
                with self._autocast():
                    loss, found = split_loss(self.task_loss(Output(self.model, out), data), self.task_name)
                loss = check_scalar(loss, self.task_name).float()
                grads = self._grad(loss, names, h, None)
            self._let_go(names)
            hand(last, grads[:-1])
            back = grads[-1]
            for i in reversed(range(last)):
                names, call = stages[i]
                x = inputs.pop()
                floating = x.is_floating_point()
                with torch.enable_grad():
                    x = x.detach().requires_grad_(floating)
                    grads = self._grad(self._stage(names, call, fetch(i), x), names, x if floating else None, back)
                self._let_go(names)
                hand(i, grads[:len(names)])
                back = grads[len(names)] if floating else None
        self._loss_sum += loss.detach()
        self._tokens += batch.count
        if found:
            self._metrics.add(found, _float)

    def _grad(self, out: torch.Tensor, names: list[str], x: torch.Tensor | None, back) -> list[torch.Tensor]:
        """Gradients of `out` (given its own, `back`) for the named parameters, then `x`'s."""
        wrt = [self._by_name[n] for n in names] + ([x] if x is not None else [])
        got = torch.autograd.grad(out, wrt, grad_outputs=back, allow_unused=True)
        return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt, strict=True)]

    @torch.no_grad()
    def staged_eval(self, batch, fetch: Callable[[int], list], metrics: MetricSums | None = None) -> tuple[float, int]:
        def stage(i: int, names: list[str], call, x):
            h = self._stage(names, call, fetch(i), x)
            self._let_go(names)
            return h

        self.model.eval()
        try:
            loss, n = self._summed_loss(Staged(self.model, stage), as_batch(batch), metrics or MetricSums())
        finally:
            self.model.train()
        return float(loss), n

    def _stage(self, names: list[str], call, weights: list, x):
        for n, w in zip(names, weights, strict=True):
            self._by_name[n].data = w
        with self._autocast():
            return call(x)

    def _let_go(self, names: list[str]) -> None:
        for n in names:
            self._by_name[n].data = self._nothing

    def release_weights(self) -> None:
        """The strategy holds the weights in shards: the parameters keep no storage, and
        anything that would read them says so instead (`_whole`)."""
        self._let_go(self._names)
        self.released = True


    def gradient_sizes(self) -> list[int]:
        return self._grads.gradient_sizes()

    @torch.no_grad()
    def eval_loss(self, batch, metrics: MetricSums | None = None) -> tuple[float, int]:
        self._whole("eval_loss")
        self.model.eval()
        try:
            loss, n = self._summed_loss(self._forward, as_batch(batch), metrics or MetricSums())
        finally:
            self.model.train()
        return float(loss), n

    @torch.no_grad()
    def logits(self, tokens: np.ndarray) -> np.ndarray:
        self._whole("logits")
        with self._autocast():
            out = self.model(self._to_device(tokens).long())
        return out.float().cpu().numpy()

    def sample(self, prompt: list[int], max_new: int, temperature: float = 0.8, seed: int = 0,
               context: int | None = None, stop: set[int] | None = None,
               on_token: Callable[[int], None] | None = None) -> list[int]:
        """No KV cache: each token re-runs the cropped context (fine for short demos)."""
        return sample_tokens(lambda w: self.logits(np.array([w], np.int32))[0, -1], prompt, max_new,
                             temperature, seed, context or self.cfg.data.seq_len, stop, on_token)


class TorchMemory:
    """`engine.base.Memory` from the device's allocator (CUDA, MPS), or the process's on a CPU."""

    def __init__(self, device_type: str, dev: torch.device):
        self.device_type, self.dev = device_type, dev

    def reading(self) -> MemoryReading:
        if self.device_type == "cuda":
            return with_override(MemoryReading(torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                                               torch.cuda.get_device_properties(self.dev).total_memory))
        return mps_reading(torch.mps) if self.device_type == "mps" else process_reading()

    def reset_peak(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def clear_cache(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.empty_cache()
        elif self.device_type == "mps":
            torch.mps.empty_cache()


class _GradCarrier(torch.optim.Optimizer):
    """What the fp16 GradScaler unscales the gradients through (it takes a torch optimizer);
    mlxdist's optimizer makes the step, never this."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__(params, {})

    def step(self, closure=None):
        raise RuntimeError("_GradCarrier only carries gradients to the GradScaler; it never steps")


class TorchShardOps(StagedShardOps):
    """`engine.base.ShardOps` for the torch engine. LoRA factors turn to checkpoint layout on
    the way out (gradients, weights) and back in `set_weights`/`set_optimizer_state`. The
    update is the engine's optimizer's formula (`mlxdist.optim`) on the flat shard, its decay a
    mask over the pieces: every element gets the arithmetic of the unsharded run."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine
        self.names = list(engine.trained_names)
        self.shapes = [tuple(p.shape)[::-1] if flipped(n) else tuple(p.shape)
                       for n, p in zip(self.names, engine.trained_params, strict=True)]
        self.optimizer = engine.optimizer
        self._masks = {}

    def _ours(self, index: int, t: torch.Tensor) -> torch.Tensor:
        return t.T if flipped(self.names[index]) else t

    def flat(self, index: int, grad: torch.Tensor) -> np.ndarray:
        g = self._ours(index, grad.detach()).to("cpu", torch.float32)
        return g.contiguous().reshape(-1).numpy()  # on the CPU, fp32 and not a LoRA factor: a view

    @torch.no_grad()
    def weights(self, pieces: tuple[Piece, ...]) -> torch.Tensor:
        params = self.engine.trained_params
        parts = [self._ours(pc.index, params[pc.index].detach()).reshape(-1)[pc.start:pc.end] for pc in pieces]
        return torch.cat(parts) if parts else torch.zeros(0, device=self.engine.dev)

    def array(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.engine.dev)

    def numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().to("cpu").numpy()

    @staticmethod
    def _cuts(pieces: tuple[Piece, ...]) -> list[slice]:
        return [slice(pc.at, pc.at + pc.end - pc.start) for pc in pieces]

    @torch.no_grad()
    def squares(self, g: torch.Tensor, pieces: tuple[Piece, ...]) -> float:
        if not pieces:
            return 0.0
        sums = torch.stack([g[s].square().sum() for s in self._cuts(pieces)])
        return float(sums.cpu().double().sum())  # float64 on the CPU: MPS has none

    @torch.no_grad()
    def update(self, p, state: tuple, g, pieces: tuple[Piece, ...], lr: float, t: int, coef: float) -> tuple:
        opt = self.optimizer
        return opt.update(torch_ops, p, g, tuple(state), opt.scalars(lr, t, coef), self._decay(pieces))

    def drop_moments(self, step: int) -> None:
        self.engine.drop_optimizer_state(step)


# -- what the registry (registry.py) names for this engine -----------------------------------


def make(cfg: Config, device: str, task: Task | None, local_rank: int, micro_batch: int) -> TorchEngine:
    return TorchEngine(cfg, device, task=task, local_rank=local_rank, micro_batch=micro_batch)


def build_lm(cfg: Config, device: object, args: ModelArgs | None = None) -> BuiltModel:
    return build_torch(cfg, device, args)


def seed(value: int) -> None:
    torch.manual_seed(value)


def on_cpu() -> None:
    """Tensors go where they are put: the CPU is the device the caller names."""
