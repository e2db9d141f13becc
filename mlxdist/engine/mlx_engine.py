"""The MLX engine: one rank's forward/backward and its optimizer's update (`mlxdist.optim`).

Master weights and optimizer state stay fp32; with `model.dtype` bf16/fp16 the forward pass
runs on a cast copy, and the cast's gradient brings fp32 gradients back for free. Only the
trainable parameters (all of them, or the adapters of a fine-tune) are held here, synced
and saved; a frozen base stays inside the module.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..config import Config
from ..models.build import BuiltModel, adopt_mlx, build_mlx, built_from_task
from ..models.presets import ModelArgs
from ..models.stages import has_stages, model_stages
from ..models.weights import checksum
from ..optim import check_state, make_optimizer, mlx_ops
from ..tasks import Task, TaskContext, TaskError, sample_seeds_of, tree_map
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
from .memory import MemoryReading, mlx_memory_limit, with_override
from .model_state import MlxModelState
from .staged import Output, ReleasesWeights, Staged, StagedShardOps, model_input

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _item(a: mx.array) -> float:
    return float(a.item())


def _pairs(totals: dict, counts: dict) -> dict:
    return {n: (t, counts.get(n)) for n, t in totals.items()}


class MLXEngine(ReleasesWeights):
    """`engine/base.py`'s `Engine` on MLX's device, offering generation, sharding (staged where
    the model has stages) and adapters (`capabilities`); no overlap: MLX builds the whole
    backward graph lazily."""

    name = "mlx"

    def __init__(self, cfg: Config, task: Task | None = None, args=None, micro_batch: int = 0):
        """`task` defaults to the built-in LM of `cfg`; `args` overrides its preset's shape (tests)."""
        self.cfg = cfg
        self.device = str(mx.default_device())
        self.compute_dtype = DTYPES[cfg.model.dtype]
        task = task or lm_model(cfg, args)
        self.task_loss, self.task_name = task.loss, task.name
        mx.random.seed(cfg.train.seed)  # a model initialised without a seed still starts the same every run
        ctx = TaskContext("mlx", self.device, cfg.train.seed, cfg, micro_batch)
        built = built_from_task(task.build(ctx), adopt_mlx, None, task.name)
        self.model = built.module
        self.whole_state = built.whole_state
        self.names = sorted(built.params)
        self.trained_names = self.names
        self.params: dict[str, mx.array] = {k: v.astype(mx.float32) for k, v in built.params.items()}
        self.optimizer = make_optimizer(cfg.train.optimizer, cfg.train)
        # The optimizer's state by its names ("m", "v" for AdamW), each by parameter.
        self.opt_state = {k: {n: mx.zeros_like(a) for n, a in self.params.items()} for k in self.optimizer.state_names}
        self.opt_step = 0
        self._decay = [decays(self.params[n].shape) for n in self.names]
        self._value_and_grad = mx.value_and_grad(self._loss)
        self._update = mx.compile(self._update_all)
        self.own_optimizer = self._make_optimizer(task)
        self._reset_accumulators()
        self.model_state = MlxModelState(self.model, self._state_arrays)
        self.memory = MLXMemory()
        self.capabilities = Capabilities(task.name, own_optimizer=self.own_optimizer is not None,
                                         staged=has_stages(self.model),
                                         model_summary=built.summary, base_fingerprint=built.fingerprint,
                                         base=built.base, generation=True, shards=True, adapters=True)

    def _make_optimizer(self, task: Task):
        """The task's own `mlx.optimizers.Optimizer`, initialised on the trained parameters,
        or None for mlxdist's AdamW."""
        if task.optimizer is None:
            return None
        import mlx.optimizers as optim

        opts = task_optimizers(task, self.model, optim.Optimizer,
                               "an mlx.optimizers.Optimizer (for several, mlx.optimizers.MultiOptimizer)")
        if len(opts) != 1:
            raise TaskError(f"task {task.name}: optimizer(model) returned {len(opts)} optimizers; the MLX engine "
                            "takes one (for several, mlx.optimizers.MultiOptimizer)")
        opt = opts[0]
        if callable(opt.learning_rate) and not isinstance(opt.learning_rate, mx.array):
            raise TaskError(f"task {task.name}: the optimizer has its own learning-rate schedule; give it a number "
                            "and set train.schedule / train.lr, which scale it each step")
        opt.init(tree_unflatten(list(self.params.items())))
        self._base_lr = float(opt.learning_rate)
        self.opt_state = {}  # mlxdist's optimizer: not used
        return opt

    # -- math -------------------------------------------------------------------------
    def _forward(self, params: dict[str, mx.array], inputs: mx.array) -> mx.array:
        if self.compute_dtype != mx.float32:
            params = {k: v.astype(self.compute_dtype) for k, v in params.items()}
        self.model.update(tree_unflatten(list(params.items())))
        return self.model(inputs).astype(mx.float32)

    def _loss(self, params: dict[str, mx.array], batch) -> tuple[mx.array, dict, dict]:
        if self.compute_dtype != mx.float32:
            params = {k: v.astype(self.compute_dtype) for k, v in params.items()}
        self.model.update(tree_unflatten(list(params.items())))
        return self._loss_of(self.model, batch)

    def _loss_of(self, model, batch) -> tuple[mx.array, dict, dict]:
        loss, metrics = split_loss(self.task_loss(model, batch), self.task_name)
        # The metrics ride along as auxiliary outputs (value_and_grad differentiates the first).
        totals = {n: mx.array(t, mx.float32) for n, (t, _) in metrics.items()}
        counts = {n: mx.array(c, mx.float32) for n, (_, c) in metrics.items() if c is not None}
        return check_scalar(loss, self.task_name).astype(mx.float32), totals, counts

    def _update_all(self, params, states, grads, scalars):
        """The optimizer's update of each parameter (compiled as one: `states` per parameter)."""
        out = [self.optimizer.update(mlx_ops, p, g, st, scalars, decay)
               for p, st, g, decay in zip(params, states, grads, self._decay, strict=True)]
        return [o[0] for o in out], [o[1] for o in out]

    @staticmethod
    def _arrays(data):
        return tree_map(lambda a: mx.array(a.astype(np.float32) if a.dtype == np.float64 else a), data)

    # -- the step ---------------------------------------------------------------------
    def _reset_accumulators(self) -> None:
        self._grads: dict[str, mx.array] | None = None
        self._loss_sum = mx.array(0.0)
        self._tokens = 0
        self._metrics = MetricSums()

    def micro_step(self, batch) -> None:
        batch = as_batch(batch)
        with sample_seeds_of(batch):
            (loss, totals, counts), grads = self._value_and_grad(self.params, self._arrays(batch.data))
        if self._grads is None:
            self._grads = grads
        else:
            self._grads = {k: self._grads[k] + grads[k] for k in grads}
        self._loss_sum = self._loss_sum + loss
        self._tokens += batch.count
        mx.eval(self._grads, self._loss_sum, totals, counts, self._state_arrays())  # BatchNorm's statistics too
        self._metrics.add(_pairs(totals, counts), _item)

    def take_gradients(self) -> LocalGradients:
        if self._grads is None:
            raise RuntimeError("take_gradients() without micro_step(): no gradients to apply")
        out = LocalGradients([self._grads[n] for n in self.names], self._loss_sum.item(), self._tokens,
                             self._metrics)
        self._reset_accumulators()
        return out

    def take_totals(self) -> LocalGradients:
        """Loss, units and metrics since the last take, with no gradients: a staged step
        (dist.shard=weights) handed those over stage by stage."""
        out = LocalGradients([], float(self._loss_sum), self._tokens, self._metrics)
        self._reset_accumulators()
        return out

    def apply_gradients(self, grads: list[mx.array], loss_sum: float, count: int, lr: float) -> StepStats:
        if count <= 0:
            return nothing_to_learn(loss_sum)
        grads = [g * (1.0 / max(count, 1)) for g in grads]
        norm = math.sqrt(mx.stack([mx.sum(mx.square(g)) for g in grads]).sum().item())
        stats = StepStats(loss_sum, int(count), norm, skipped=False)
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            stats.skipped = True
            return stats
        clip = self.cfg.train.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        if self.own_optimizer is not None:
            return self._own_update(grads, coef, lr, stats)
        t = self.opt_step + 1
        keys = self.optimizer.state_names
        p, states = self._update([self.params[n] for n in self.names],
                                 [tuple(self.opt_state[k][n] for k in keys) for n in self.names], grads,
                                 mx.array(self.optimizer.scalars(lr, t, coef)))
        self.params = dict(zip(self.names, p, strict=True))
        self.opt_state = {k: {n: st[i] for n, st in zip(self.names, states, strict=True)} for i, k in enumerate(keys)}
        mx.eval(self.params, self.opt_state)
        self.opt_step = t
        return stats

    def _own_update(self, grads: list[mx.array], coef: float, lr: float, stats: StepStats) -> StepStats:
        opt = self.own_optimizer
        opt.learning_rate = self._base_lr * (lr / self.cfg.train.lr if self.cfg.train.lr > 0 else 0.0)
        new = opt.apply_gradients(tree_unflatten([(n, g * coef) for n, g in zip(self.names, grads, strict=True)]),
                                  tree_unflatten(list(self.params.items())))
        self.params = {n: a for n, a in tree_flatten(new) if n in self.params}
        mx.eval(self.params, opt.state)
        self.opt_step += 1
        return stats

    def discard_gradients(self) -> None:
        self._reset_accumulators()

    # -- dist.shard=weights: the model stage by stage ------------------------------
    def staged_step(self, batch, fetch: Callable[[int], list], hand: Callable[[int, list], None]) -> None:
        """One micro-batch's forward and backward through the model's stages
        (`models/stages.py`), one stage's weights at a time: `fetch(i)` gives stage i's fp32
        weights (in its names' order), `hand(i, grads)` takes their gradients, last stage first.
        Only the stages' inputs are kept: each block runs forward again inside its backward, as
        `model.grad_checkpoint_every=1` does.
        Loss, units and metrics add up as `micro_step`'s do."""
        stages = model_stages(self.model)
        data = self._arrays(batch.data)
        with sample_seeds_of(batch):
            inputs = [model_input(self.task_loss, self.model, data, self.task_name)]
            for i, (names, run) in enumerate(stages[:-1]):
                inputs.append(self._stage(names, run, fetch(i), inputs[-1]))
                mx.eval(inputs[-1])
                self._let_go(names)
            names, run = stages[-1]
            last = len(stages) - 1

            def tail(weights, h):
                return self._loss_of(Output(self.model, self._stage(names, run, weights, h)), data)

            (loss, totals, counts), (grads, back) = mx.value_and_grad(tail, argnums=(0, 1))(fetch(last), inputs.pop())
            mx.eval(loss, totals, counts, grads, back)
            self._let_go(names)
            hand(last, grads)
            for i in reversed(range(last)):
                names, run = stages[i]
                x = inputs.pop()
                floating = mx.issubdtype(x.dtype, mx.floating)
                weights = fetch(i)

                def f(*args, names=names, run=run, x=x, n=len(weights), floating=floating):
                    return self._stage(names, run, list(args[:n]), args[n] if floating else x)

                _, grads = mx.vjp(f, weights + ([x] if floating else []), [back])
                mx.eval(grads)
                self._let_go(names)
                del weights
                hand(i, grads[:len(names)])
                back = grads[len(names)] if floating else None
        self._loss_sum = self._loss_sum + loss
        self._tokens += batch.count
        mx.eval(self._loss_sum)
        self._metrics.add(_pairs(totals, counts), _item)

    def staged_eval(self, batch, fetch: Callable[[int], list], metrics: MetricSums | None = None) -> tuple[float, int]:
        """`eval_loss` a stage at a time (forward only: each stage's weights fetched once)."""

        def stage(i: int, names: list[str], call, x):
            h = self._stage(names, call, fetch(i), x)
            mx.eval(h)
            self._let_go(names)
            return h

        return self._evaluate(batch, metrics, lambda data: self._loss_of(Staged(self.model, stage), data))

    def _stage(self, names: list[str], run, weights: list, x):
        if self.compute_dtype != mx.float32:
            weights = [w.astype(self.compute_dtype) for w in weights]
        self.model.update(tree_unflatten(list(zip(names, weights, strict=True))))
        return run(x)

    def _let_go(self, names: list[str]) -> None:
        """The module lets go of a stage's gathered weights (it keeps what it was last given)."""
        self.model.update(tree_unflatten([(n, _NOTHING) for n in names]))

    def release_weights(self) -> None:
        """The strategy holds the weights in shards now: lazy zeros stand in (no memory), and
        anything that would read them says so instead (`_whole`)."""
        self.params = {n: mx.zeros(self.params[n].shape, mx.float32) for n in self.names}
        self._let_go(self.names)
        self.released = True

    def eval_loss(self, batch, metrics: MetricSums | None = None) -> tuple[float, int]:
        self._whole("eval_loss")
        return self._evaluate(batch, metrics, lambda data: self._loss(self.params, data))

    def _evaluate(self, batch, metrics: MetricSums | None, loss_of: Callable) -> tuple[float, int]:
        """(summed loss, units) of `loss_of(data)`, the model in eval mode and the batch's
        sample seeds set; the task's metrics added into `metrics`."""
        batch = as_batch(batch)
        self.model.eval()
        try:
            with sample_seeds_of(batch):
                loss, totals, counts = loss_of(self._arrays(batch.data))
                mx.eval(loss, totals, counts)
        finally:
            self.model.train()
        if metrics is not None:
            metrics.add(_pairs(totals, counts), _item)
        return loss.item(), batch.count

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        self._whole("logits")
        return np.array(self._forward(self.params, mx.array(tokens)))

    def sample(self, prompt: list[int], max_new: int, temperature: float = 0.8, seed: int = 0,
               context: int | None = None, stop: set[int] | None = None,
               on_token: Callable[[int], None] | None = None) -> list[int]:
        return sample_tokens(lambda w: self.logits(np.array([w], np.int32))[0, -1], prompt, max_new,
                             temperature, seed, context or self.cfg.data.seq_len, stop, on_token)

    # -- state ------------------------------------------------------------------------
    def gradient_sizes(self) -> list[int]:
        """Elements of each trained parameter, in `trained_names` order."""
        return [self.params[n].size for n in self.names]

    def get_weights(self) -> dict[str, np.ndarray]:
        self._whole("get_weights")
        return {k: np.array(v) for k, v in self.params.items()}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        check_weights({n: tuple(self.params[n].shape) for n in self.names}, weights)
        self.params = {n: mx.array(np.asarray(weights[n], np.float32)) for n in self.names}
        mx.eval(self.params)
        self.released = False

    def get_optimizer_state(self) -> tuple[dict[str, np.ndarray], int]:
        if self.own_optimizer is not None:  # the task's own: its state tree, flattened
            return {f"opt0.{k}": np.array(v) for k, v in tree_flatten(self.own_optimizer.state)}, self.opt_step
        return {f"{k}.{n}": np.array(a) for k, arrays in self.opt_state.items() for n, a in arrays.items()}, \
            self.opt_step

    def set_optimizer_state(self, state: dict[str, np.ndarray], step: int) -> None:
        if self.own_optimizer is not None:
            mine = [(k[len("opt0."):], mx.array(v)) for k, v in state.items() if k.startswith("opt0.")]
            self.own_optimizer.state = tree_unflatten(mine)
            self.opt_step = int(step)
            return
        check_state(self.optimizer, self.names, state)
        self.opt_state = {k: {n: mx.array(state[f"{k}.{n}"]) for n in self.names} for k in self.optimizer.state_names}
        self.opt_step = int(step)

    def shard_ops(self) -> MLXShardOps:
        return MLXShardOps(self)

    def weight_checksum(self) -> int:
        self._whole("weight_checksum")
        return checksum(np.array(self.params[n]) for n in self.names)

    # -- the rest of the model's state: a task's non-trainable parameters (BatchNorm's
    # running statistics, frozen weights) --------------------------------------------
    def _state_arrays(self) -> dict[str, mx.array]:
        if not self.whole_state:
            return {}
        trained = set(self.names)
        return {n: a for n, a in tree_flatten(self.model.parameters()) if n not in trained}

    def save_adapter(self, out_dir: Path) -> Path | None:
        """The trained adapter in PEFT's layout (None when the whole model trained)."""
        if self.cfg.finetune.method == "full":
            return None
        from ..models.adapters import BaseInfo, save_peft

        caps = self.capabilities
        base = BaseInfo(caps.base.path, len(self.model.layers), caps.base_fingerprint)
        return save_peft(self.get_weights(), base, self.cfg.finetune, out_dir)

    # -- machine ----------------------------------------------------------------------
    def describe(self) -> str:
        from ..blas import status

        opt = (f"; optimizer {type(self.own_optimizer).__name__} (the task's)" if self.own_optimizer is not None
               else f"; optimizer {self.optimizer.title}")
        return (f"mlx on {self.device}, compute {self.cfg.model.dtype}, master fp32; {status()}; "
                f"{MLXMemory.limit()[1]}{opt}")


class MLXMemory:
    """`engine.base.Memory` from MLX's allocator."""

    def reading(self) -> MemoryReading:
        return with_override(MemoryReading(mx.get_active_memory(), mx.get_peak_memory(), self.limit()[0]))

    @staticmethod
    def limit() -> tuple[int, str]:
        """On a Mac Metal's recommended working set (MLX's own limit is ~1.5x that, into
        GPU paging); on Linux, about the RAM."""
        return mlx_memory_limit(mx.device_info(), mx.get_memory_limit(), sys.platform)

    def reset_peak(self) -> None:
        mx.reset_peak_memory()

    def clear_cache(self) -> None:
        mx.clear_cache()


_NOTHING = mx.zeros((0,), mx.float32)


class MLXShardOps(StagedShardOps):
    """`engine.base.ShardOps` for the MLX engine, whose layout is checkpoint layout. The update
    is the engine's optimizer's (`mlxdist.optim`), compiled once for a flat shard, its decay a
    mask over the shard's pieces."""

    def __init__(self, engine: MLXEngine):
        self.engine = engine
        self.names = list(engine.names)
        self.shapes = [tuple(engine.params[n].shape) for n in self.names]
        self.optimizer = engine.optimizer
        self._masks = {}
        opt = self.optimizer
        self._update = mx.compile(lambda p, state, g, decay, scalars: opt.update(mlx_ops, p, g, state, scalars, decay))

    def flat(self, index: int, grad: mx.array) -> np.ndarray:
        return np.asarray(grad, np.float32).reshape(-1)

    def weights(self, pieces: tuple[Piece, ...]) -> mx.array:
        params = self.engine.params
        parts = [params[self.names[pc.index]].reshape(-1)[pc.start:pc.end] for pc in pieces]
        return mx.concatenate(parts) if parts else mx.zeros((0,), mx.float32)

    def array(self, a: np.ndarray) -> mx.array:
        return mx.array(a)

    def numpy(self, x: mx.array) -> np.ndarray:
        return np.asarray(x)

    def squares(self, g: mx.array, pieces: tuple[Piece, ...]) -> float:
        if not pieces:
            return 0.0
        sums = mx.stack([mx.sum(mx.square(g[pc.at:pc.at + pc.end - pc.start])) for pc in pieces])
        return float(np.sum(np.array(sums, np.float64)))

    def update(self, p, state: tuple, g, pieces: tuple[Piece, ...], lr: float, t: int, coef: float) -> tuple:
        p, state = self._update(p, tuple(state), g, self._decay(pieces), mx.array(self.optimizer.scalars(lr, t, coef)))
        mx.eval(p, state)
        return p, state

    def drop_moments(self, step: int) -> None:
        """Lazy zeros: never evaluated, so no memory."""
        lazy = {f"{k}.{n}": mx.zeros(s, mx.float32) for k in self.optimizer.state_names
                for n, s in zip(self.names, self.shapes, strict=True)}
        self.engine.set_optimizer_state(lazy, step)


# -- what the registry (registry.py) names for this engine -----------------------------------


def make(cfg: Config, device: str, task: Task | None, local_rank: int, micro_batch: int) -> MLXEngine:
    """MLX picks its one device itself: `device` and `local_rank` are the torch engine's."""
    return MLXEngine(cfg, task, micro_batch=micro_batch)


def build_lm(cfg: Config, device: object, args: ModelArgs | None = None) -> BuiltModel:
    return build_mlx(cfg, args)


def seed(value: int) -> None:
    mx.random.seed(value)


def on_cpu() -> None:
    mx.set_default_device(mx.cpu)
