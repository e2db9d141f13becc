"""Pipeline parallelism (`dist.mode=pipeline`): the model's layer stack cut into one contiguous
run of stages per rank; activations go forward and their gradients back between neighbours.

Why: ZeRO-3 moves about three times the model's bytes over the link every step, which over the
Ethernet or Wi-Fi most Macs have is the whole step. A pipeline sends only each micro-batch's
boundary activation (batch x sequence x hidden) to the next rank and its gradient back, so a
model no single Mac holds trains over a slow link.

What a rank holds: its run's weights (fp32), their gradients and the optimizer's state for the
weights it owns; the engine built the whole model once at start, then lets go of it (as ZeRO-3).
The cut (`dist.pipeline_cut`, else `control/pipeline_cut.py`'s by memory budget, speed, each
stage's forward time measured at start (`probe`) and the last rank's lighter schedule) counts
the model's stages (`models/stages.py`: the built-in LM's embedding, each block,
its head; a pretrained mlx-lm Llama or Qwen's the same, derived from its layer list). A weight
two runs read (tied embeddings: the embedding and the head) is owned by the first rank that
reads it; the other holds a copy, sends its gradient to the owner before the update and gets
the updated weight back after it.

A step (`forward_backward`, then `step`): the pipeline is one replica, so every rank's
micro-batches of the step (each rank's share, as the loop dealt them) are gathered to every
rank and run through the pipeline in rank order, one forward and one backward alternating per
rank after a warm-up of (ranks - rank - 1) forwards (1F1B: at most that many micro-batches'
inputs wait for their backward on a rank). Sends never block (`Transport.send`), so neighbours
sending to each other at once cannot deadlock. The last rank computes the task's summed loss;
the units (`count`) of every micro-batch are known to all ranks from the gather, so each rank
divides its gradients by the cluster-wide count as data parallel does: a pipeline equals one
process on the same samples. The global norm is the square root of every rank's owned sum of
squares, summed over ranks; a non-finite loss or norm skips the step on every rank at once.
Each rank's optimizer (`mlxdist.optim`, through `engine.shard_ops()`, the math ZeRO uses) then
updates the weights it owns.

Checkpoints are data parallel's: before a save each writer gathers every rank's weights and
optimizer state (`whole_model`, `before_save`), so a pipeline's checkpoint loads in one process,
in `generate`, and on a pipeline of any number of ranks or any cut.

Adapters (`finetune.method=lora/dora`, QLoRA with `model.quantize`) train over a frozen base cut
the same way: the stages name only their adapters, each rank holds its run's part of the base
(counted in the cut's cost and bytes) and lets go of the rest, and only the adapters are weights
here (owned, updated, gathered for the checkpoint: data parallel's LoRA checkpoint and adapter).

The engine side (one run's forward, its backward for a given output cotangent) is the engine's
(`EngineSpec.pipeline`: `engine/mlx_pipeline.py`); this module knows no layers and no framework.
Not yet: adapters on the torch engine, models with buffers, a task's own optimizer,
overlapping a send with the next micro-batch's compute beyond what nonblocking sends give,
re-cutting by speeds measured during the run (the cut is made once, at start).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..cluster.transport import Sent, Transport, wait_sent
from ..cluster.world import World
from ..config import Config, ConfigError
from ..control.pipeline_cut import (
    LAST_RUN,
    cut_stages,
    parse_cut,
    stage_costs,
    stage_costs_line,
    stage_loads,
)
from ..control.run_plan import RunPlan
from ..control.step_plan import Decision
from ..engine.base import Engine, Piece, StepStats, nothing_to_learn
from ..engine.registry import ENGINES
from ..engine.staged import time_stages
from ..tasks import Batch
from ..tasks.metrics import MetricSums, means
from .fully_sharded import lent_whole
from .strategy import Strategy

WHY = "dist.mode=pipeline"
DTYPES = ("float32", "bfloat16", "float16")
HEADER = 8  # int64s: dtype code, ndim, shape
# Message tags: micro-batch j's activation header, activation and gradient are 3j, 3j+1, 3j+2;
# a shared weight's gradient and its update go under their own (MPI guarantees tags to 32767).
GRAD_TAG, WEIGHT_TAG = 32000, 32001


def stage_names_of(engine: Engine) -> list[list[str]] | None:
    """Each of the model's stages' trained parameter names, as the engine runs them (its own
    `stages()`, or derived from an mlx-lm model's layer list: `models/stages.py`); None without."""
    return engine.shard_ops().stage_names() if engine.capabilities.staged else None


def stage_cost_bytes(names: list[list[str]], sizes: dict[str, int], state_bytes: int,
                     frozen: list[tuple[int, int]] | None = None) -> tuple[list[float], list[float]]:
    """Each stage's cost and bytes (`control.pipeline_cut.stage_loads`) from its trained
    parameters' elements, plus its frozen base's (a LoRA run's: `frozen`, each stage's elements
    and bytes), which it computes through and holds but neither updates nor keeps state for."""
    costs, nbytes = stage_loads([sum(sizes[n] for n in stage) for stage in names], state_bytes)
    for i, (elements, held) in enumerate(frozen or []):
        costs[i] += elements
        nbytes[i] += held
    return costs, nbytes


def plan_cut(cfg: Config, names: list[list[str]], sizes: dict[str, int], state_bytes: int,
             plan: RunPlan, frozen: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The run's cut: `dist.pipeline_cut` as given, else the slowest stage least for each
    rank's speed (as the run plan carries it: measured at start, or `nodes:` speed) with each
    rank's bytes within its memory budget (`control/pipeline_cut.py`)."""
    if cfg.dist.pipeline_cut:
        return parse_cut(cfg.dist.pipeline_cut, len(names), len(plan.hosts))
    costs, nbytes = stage_cost_bytes(names, sizes, state_bytes, frozen)
    if len(plan.stage_costs) == len(names):
        costs = list(plan.stage_costs)
    return cut_stages(costs, nbytes, list(plan.speeds) or [1.0] * len(plan.hosts), plan.budgets, LAST_RUN)


class Pipeline(Strategy):
    """One replica cut into stages across the ranks; see the module docstring."""

    redo_after_oom = False  # a rank cannot redo its micro-batches alone: its neighbours wait on them
    ranks_differ = True  # each rank holds different weights: no one model to average (train.ema)
    gradient_wire = "none"  # it sends activations, not gradients
    speed_weighted = True  # the cut gives a faster rank more stages (RunPlan.speeds)
    title = "pipeline parallelism"

    @classmethod
    def probe(cls, cfg: Config, world: World, engine: Engine, sample, plan: RunPlan) -> RunPlan:
        """Each stage's share of a forward pass, timed on every rank (`dist.measure_stages`):
        the cut's costs, in place of parameter counts."""
        spec = ENGINES.get(engine.name)
        if (cfg.dist.pipeline_cut or not cfg.dist.measure_stages or spec is None or not spec.pipeline
                or engine.capabilities.own_optimizer or engine.model_state.has_state()):
            return plan
        names = stage_names_of(engine)
        seconds = None
        if names is not None and len(names) > 1:
            try:
                seconds = time_stages(engine.shard_ops().pipeline_run(0, len(names)), sample())
            except Exception as e:  # noqa: BLE001 - said below, and `check` refuses what cannot run
                seconds = f"{type(e).__name__}: {e}"
        with world.watch("timing each model stage's forward pass (dist.measure_stages)"):
            every = world.allgather(seconds)
        failed = [f"rank {r}: {s}" for r, s in enumerate(every) if isinstance(s, str)]
        if names is None or len(names) < 2 or any(s is None for s in every):
            return plan
        if failed:
            return replace(plan, notes=(*plan.notes, f"stage costs not measured ({'; '.join(failed)[:300]}); the "
                                                      "cut counts parameters"))
        costs = stage_costs(every)
        return replace(plan, stage_costs=tuple(costs), notes=(*plan.notes, stage_costs_line(costs, every)))

    @classmethod
    def check(cls, cfg: Config, world: World, engine: Engine, plan: RunPlan) -> None:
        spec = ENGINES.get(engine.name)
        if spec is None or not spec.pipeline:
            raise world.agreed_error(f"{WHY} runs on the MLX engine only for now (the {engine.name} engine has no "
                                     "pipeline stages yet): use --engine mlx, or dist.mode=ddp with "
                                     "dist.shard=weights for a model bigger than one Mac")
        if cfg.finetune.method != "full" and not spec.load("pipeline").adapters:
            raise world.agreed_error(f"{WHY} with finetune.method={cfg.finetune.method}: adapters over a pipelined "
                                     f"frozen base run on the MLX engine only for now (the {engine.name} engine's "
                                     "stages name its whole base); use --engine mlx, or dist.mode=ddp")
        if engine.capabilities.own_optimizer:
            raise world.agreed_error(f"{WHY} updates each stage with mlxdist's optimizer; this task brings its own "
                                     "(Task.optimizer): drop it, or use dist.mode=ddp")
        if engine.model_state.has_state():
            raise world.agreed_error(f"{WHY}: this model has buffers or frozen arrays besides its trained weights "
                                     "(BatchNorm's statistics, ...), which a pipeline does not carry yet; use "
                                     "dist.mode=ddp")
        names = stage_names_of(engine)
        if names is None:
            raise world.agreed_error(f"{WHY} cuts the model's stages, but {type(engine.model).__name__} has no "
                                     "stages() (the built-in LM's presets and mlx-lm Llama/Mistral/Qwen/GPT-2 bases do); give "
                                     "the model a stages() method (docs/bigger-than-one-mac.md) or use dist.mode=ddp")
        trained, seen = set(engine.trained_names), {n for stage in names for n in stage}
        if seen != trained:
            odd = sorted(trained - seen)[:3] or sorted(seen - trained)[:3]
            raise world.agreed_error(f"{type(engine.model).__name__}.stages() do not name each trained parameter: "
                                     f"{', '.join(odd)} (stages must cover the trained parameters, nothing else)")
        if world.size > len(names):
            raise world.agreed_error(f"{WHY} on {world.size} ranks: the model has {len(names)} stages "
                                     f"(model.stages()), fewer than the ranks; run it on at most {len(names)} ranks")
        ops = engine.shard_ops()
        sizes = {n: math.prod(s) for n, s in zip(ops.names, ops.shapes, strict=True)}
        try:
            plan_cut(cfg, names, sizes, ops.optimizer.state_bytes, plan, ops.stage_frozen())
        except ConfigError as e:
            raise world.agreed_error(str(e)) from None

    def __init__(self, cfg: Config, world: World, engine: Engine, plan: RunPlan, reducer=None,
                 transport: Transport | None = None):
        self.cfg, self.world, self.plan = cfg, world, plan
        self.transport = transport
        self.rank, self.size = world.rank, world.size
        self.ops = engine.shard_ops()
        self.optimizer = self.ops.optimizer
        self.shapes = dict(zip(self.ops.names, self.ops.shapes, strict=True))
        self.index = {n: i for i, n in enumerate(self.ops.names)}
        sizes = {n: math.prod(s) for n, s in self.shapes.items()}
        stages = stage_names_of(engine)
        self.cuts = plan_cut(cfg, stages, sizes, self.optimizer.state_bytes, plan, self.ops.stage_frozen())
        a, b = self.cuts[self.rank]
        self.stage = self.ops.pipeline_run(a, b)
        self.stage_titles = [f"{b - a} stage{'s' if b - a > 1 else ''} ({a}-{b - 1})" for a, b in self.cuts]
        # Who reads each weight, in rank order; its owner is the first of them.
        readers: dict[str, list[int]] = {}
        for r, (x, y) in enumerate(self.cuts):
            for n in dict.fromkeys(n for stage in stages[x:y] for n in stage):
                readers.setdefault(n, []).append(r)
        self.readers = readers
        self.owner = {n: rs[0] for n, rs in readers.items()}
        self.shared = sorted(n for n, rs in readers.items() if len(rs) > 1)
        # Every rank's owned weights, rank after rank (each in its run's order): the layout the
        # checkpoint's gathers use; this rank's part is its flat update's.
        self.owned = [[n for n in readers if self.owner[n] == r] for r in range(self.size)]
        counts = [sum(sizes[n] for n in mine) for mine in self.owned]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
        self.ranges = [(starts[r], starts[r + 1]) for r in range(self.size)]
        self.total = starts[-1]
        self.mine = self.owned[self.rank]
        # Each owned weight is updated on its own, in place of a flat shard: no copy of the
        # weights, gradients or moments into one array and back each step.
        self.piece = {n: (Piece(self.index[n], 0, sizes[n], 0),) for n in self.mine}
        self.sizes = sizes
        self.writes = world.allgather(world.rank == 0 or (cfg.checkpoint.on_every_host and world.local_rank == 0))
        # A writer of an adapter run keeps the adapters it last gathered: small, and what the
        # engine's `save_adapter` reads at the end of the run (after the last step's save).
        self.keeps = cfg.finetune.method != "full" and self.writes[self.rank]
        self.weights: dict[str, object] = {}  # this run's weights (owned and copies), set by load_state_dict
        self.state: dict[str, tuple] = {}  # each owned weight's optimizer state, flat
        self.t = 0
        self._depth = 0
        self._count = 0
        self._sent: list[Sent] = []
        # Boundary activations' (shape, dtype) by the batch shapes that make them: what this rank
        # received (from rank - 1) and sent (to rank + 1); the two sides of a link keep the same.
        self._in_shapes: dict[tuple, tuple] = {}
        self._out_shapes: dict[tuple, tuple] = {}
        self._bytes = 0

    def describe(self) -> str | None:
        speeds = "" if len(set(self.plan.speeds)) <= 1 else f" and speed ({', '.join(f'{v:g}' for v in self.plan.speeds)})"
        timed = " and measured stage costs" if len(self.plan.stage_costs) == self.cuts[-1][1] else ""
        how = "by dist.pipeline_cut" if self.cfg.dist.pipeline_cut else f"by memory budget{speeds}{timed}"
        cut = ", ".join(f"rank {r} {t}" for r, t in enumerate(self.stage_titles))
        shared = f"; {', '.join(self.shared)} shared by the runs that read it" if self.shared else ""
        return (f"pipeline parallelism: {self.cuts[-1][1]} model stages cut "
                f"{how}: {cut}; micro-batches one-forward-one-backward{shared}; {self.optimizer.title} state of "
                f"each rank's own weights on it")

    # -- weights -----------------------------------------------------------------------
    def _run_weights(self) -> list:
        return [self.weights[n] for n in self.stage.names]

    def _flat_owned(self, arrays: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
        parts = [np.asarray(arrays[n], np.float32).reshape(-1) for n in names]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _unflatten(self, full: np.ndarray, prefix: str = "") -> dict[str, np.ndarray]:
        out, at = {}, 0
        for mine in self.owned:
            for n in mine:
                out[prefix + n] = full[at:at + self.sizes[n]].reshape(self.shapes[n])
                at += self.sizes[n]
        return out

    def optimizer_state_bytes(self, engine: Engine, rank: int) -> int:
        a, b = self.ranges[rank]
        return self.optimizer.state_bytes * (b - a)

    # -- the schedule --------------------------------------------------------------------
    def forward_backward(self, engine: Engine, batches: list[Batch]) -> float:
        """Every rank's micro-batches of the step through the pipeline, 1F1B; returns the
        seconds this rank waited for its neighbours."""
        with self.world.watch("gathering the step's micro-batches (pipeline)"):
            every = [b for mine in self.world.allgather(list(batches)) for b in mine]
        self._count += sum(int(b.count) for b in every)
        m, p, r = len(every), self.size, self.rank
        waited = 0.0
        inputs: dict[int, object] = {}
        ahead: dict[int, tuple] = {}  # activations' receives posted before their forward
        outputs: dict[int, tuple[tuple[int, ...], str, np.ndarray, Sent]] = {}  # the gradient's receive, posted
        weights = self._run_weights()

        def expect(j: int) -> tuple:
            return self._expect(every[j], r - 1, 3 * j, f"activation of micro-batch {j} from rank {r - 1}")

        def forward(j: int) -> None:
            nonlocal waited
            batch = every[j]
            if self.stage.is_first:
                x = self.stage.input_of(batch)
            else:
                t0 = time.perf_counter()
                x = self._take(ahead.pop(j) if j in ahead else expect(j))
                waited += time.perf_counter() - t0
                # The next activation's receive is posted now, where its shape is known already:
                # it may land while this micro-batch computes.
                if j + 1 < m and self._batch_key(every[j + 1]) in self._in_shapes:
                    ahead[j + 1] = expect(j + 1)
            inputs[j] = x
            if not self.stage.is_last:
                out = self.stage.forward(weights, x, batch)
                shape, dtype = tuple(out.shape), self.stage.dtype_name(out)
                self._send_array(out, batch, r + 1, 3 * j, f"activation of micro-batch {j} to rank {r + 1}")
                # Its gradient's receive is posted now: it may land while later micro-batches compute.
                buf = np.empty(math.prod(shape), self.stage.wire_dtype(dtype))
                outputs[j] = (shape, dtype, buf, self.transport.post_recv(
                    buf, r + 1, 3 * j + 2, f"gradient of micro-batch {j} from rank {r + 1}"))

        def backward(j: int) -> None:
            nonlocal waited
            batch, x = every[j], inputs.pop(j)
            if self.stage.is_last:
                back = self.stage.loss_backward(weights, x, batch)
            else:
                shape, dtype, buf, posted = outputs.pop(j)
                t0 = time.perf_counter()
                posted.wait()
                waited += time.perf_counter() - t0
                back = self.stage.backward(weights, x, self.stage.from_numpy(buf, shape, dtype), batch)
            if not self.stage.is_first:
                self._sent.append(self.transport.send(self.stage.to_numpy(back), r - 1, 3 * j + 2,
                                                      f"gradient of micro-batch {j} to rank {r - 1}"))
                self._bytes += back.nbytes
            self._sent = [s for s in self._sent if not s.done()]

        warm = min(p - r - 1, m)
        for j in range(warm):
            forward(j)
        for j in range(m - warm):
            forward(warm + j)
            backward(j)
        for j in range(m - warm, m):
            backward(j)
        t0 = time.perf_counter()
        wait_sent(self._sent)
        self._sent = []
        return waited + time.perf_counter() - t0

    @staticmethod
    def _batch_key(batch: Batch) -> tuple:
        """What fixes a boundary activation's shape: the batch's arrays' shapes and dtypes."""

        def key(x):
            if isinstance(x, dict):
                return tuple((k, key(v)) for k, v in sorted(x.items()))
            if isinstance(x, list | tuple):
                return tuple(key(v) for v in x)
            shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
            return (tuple(shape), str(dtype)) if shape is not None else type(x).__name__

        return key(batch.data)

    def _send_array(self, a, batch: Batch, to: int, tag: int, what: str) -> None:
        """`a` to rank `to`; first a header with its shape and dtype, unless a batch of the same
        shapes went before (the receiver knows it then, and posts its receive early)."""
        shape, dtype = tuple(a.shape), self.stage.dtype_name(a)
        key = self._batch_key(batch)
        if key not in self._out_shapes:
            header = np.zeros(HEADER, np.int64)
            header[:2 + len(shape)] = [DTYPES.index(dtype), len(shape), *shape]
            self._sent.append(self.transport.send(header, to, tag, what))
            self._out_shapes[key] = (shape, dtype)
        self._sent.append(self.transport.send(self.stage.to_numpy(a), to, tag + 1, what))
        self._bytes += a.nbytes

    def _expect(self, batch: Batch, source: int, tag: int, what: str) -> tuple:
        """The receive of `batch`'s activation from `source`, posted: its header first (waited
        for) when no batch of the same shapes came before."""
        key = self._batch_key(batch)
        if key not in self._in_shapes:
            header = np.empty(HEADER, np.int64)
            self.transport.recv(header, source, tag, what)
            ndim = int(header[1])
            self._in_shapes[key] = (tuple(int(s) for s in header[2:2 + ndim]), DTYPES[int(header[0])])
        shape, dtype = self._in_shapes[key]
        buf = np.empty(math.prod(shape), self.stage.wire_dtype(dtype))
        return shape, dtype, buf, self.transport.post_recv(buf, source, tag + 1, what)

    def _take(self, expected: tuple):
        """A posted activation receive, waited for, as the engine's array."""
        shape, dtype, buf, posted = expected
        posted.wait()
        return self.stage.from_numpy(buf, shape, dtype)

    # -- the update ----------------------------------------------------------------------
    def step(self, engine: Engine, lr: float) -> StepStats:
        t0 = time.perf_counter()
        grads, loss_sum, metrics = self.stage.take()
        count, self._count = self._count, 0
        sent, self._bytes = self._bytes, 0
        if count <= 0 or grads is None:  # alike on every rank: every rank gathered every micro-batch
            return nothing_to_learn(self.world.allreduce_sum([loss_sum])[0])
        named = dict(zip(self.stage.names, grads, strict=True))
        sent += self._share_gradients(named)
        last = self.size - 1
        flat_metrics = self.world.bcast((metrics.names(), metrics.flat(count)) if self.rank == last else None, last)
        g = {n: named[n].reshape(-1) * (1.0 / count) for n in self.mine}
        squares = sum(self.ops.squares(g[n], self.piece[n]) for n in self.mine)
        loss_sum, squares = self.world.allreduce_sum([loss_sum, squares])
        norm = math.sqrt(squares) if squares >= 0 else float("nan")
        stats = StepStats(loss_sum, count, norm, skipped=False)
        stats.metrics = means(flat_metrics[0], flat_metrics[1])
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            stats.skipped = True  # every rank saw the same sums: all skip together
            return stats
        clip = self.cfg.train.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        t = self.t + 1
        for n in self.mine:
            p, self.state[n] = self.ops.update(self.weights[n].reshape(-1), self.state[n], g[n], self.piece[n],
                                               lr, t, coef)
            self.weights[n] = p.reshape(self.shapes[n])
        self.t = t
        sent += self._share_weights()
        stats.sync_seconds, stats.sync_bytes = time.perf_counter() - t0, sent
        return stats

    def _share_gradients(self, named: dict) -> int:
        """A shared weight's copies send their gradients to its owner, which adds them; returns
        the bytes this rank sent."""
        sent = 0
        for n in self.shared:
            owner, readers = self.owner[n], self.readers[n]
            if self.rank in readers[1:]:
                wait_sent([self.transport.send(self.ops.numpy(named[n]).reshape(-1), owner, GRAD_TAG,
                                               f"gradient of {n} to its owner, rank {owner}")])
                sent += 4 * self.sizes[n]
            elif self.rank == owner:
                for q in readers[1:]:
                    buf = np.empty(self.sizes[n], np.float32)
                    self.transport.recv(buf, q, GRAD_TAG, f"gradient of {n} from rank {q}")
                    named[n] = named[n] + self.ops.array(buf.reshape(self.shapes[n]))
        return sent

    def _share_weights(self) -> int:
        """A shared weight's owner sends the updated weight to the ranks holding copies; returns
        the bytes this rank sent."""
        sent = 0
        for n in self.shared:
            owner, readers = self.owner[n], self.readers[n]
            if self.rank == owner:
                flat = self.ops.numpy(self.weights[n]).reshape(-1)
                wait_sent([self.transport.send(flat, q, WEIGHT_TAG, f"{n} to rank {q}") for q in readers[1:]])
                sent += 4 * self.sizes[n] * len(readers[1:])
            elif self.rank in readers:
                buf = np.empty(self.sizes[n], np.float32)
                self.transport.recv(buf, owner, WEIGHT_TAG, f"{n} from its owner, rank {owner}")
                self.weights[n] = self.ops.array(buf.reshape(self.shapes[n]))
        return sent

    # -- evaluation ----------------------------------------------------------------------
    def eval_losses(self, engine: Engine, batches: list[Batch], metrics: MetricSums) -> list[tuple[float, int]]:
        """Every rank's evaluation batches through the pipeline, forward only; the last rank's
        losses and metrics handed to rank 0, which reports them for all (the others none)."""
        with self.world.watch("gathering the evaluation batches (pipeline)"):
            every = [b for mine in self.world.allgather(list(batches)) for b in mine]
        weights, r, last = self._run_weights(), self.rank, self.size - 1
        losses, found = [], MetricSums()
        for j, batch in enumerate(every):
            x = self.stage.input_of(batch) if self.stage.is_first else \
                self._take(self._expect(batch, r - 1, 3 * j, f"evaluation activation {j} from rank {r - 1}"))
            if self.stage.is_last:
                losses.append((self.stage.forward_loss(weights, x, batch, found), int(batch.count)))
            else:
                self._send_array(self.stage.forward_eval(weights, x, batch), batch, r + 1, 3 * j,
                                 f"evaluation activation {j} to rank {r + 1}")
        wait_sent(self._sent)
        self._sent, self._bytes = [], 0
        losses, sums = self.world.bcast((losses, found.sums) if r == last else None, last)
        if r != 0:
            return []
        for name, (total, count) in sums.items():
            metrics.add({name: (total, count)}, float)
        return losses

    # -- checkpoints ---------------------------------------------------------------------
    @contextmanager
    def whole_model(self, engine: Engine, ranks: Collection[int]) -> Iterator[None]:
        """Every rank's owned weights gathered on each of `ranks`, set whole in its engine for
        the duration; let go after."""
        mine = self._flat_owned({n: self.ops.numpy(self.weights[n]) for n in self.mine}, self.mine)
        with lent_whole(self, engine, ranks, lambda root: self.transport.gather(
                mine, self.ranges, self.total, root, "weight gather for the checkpoint"), keep=self.keeps):
            yield

    def before_save(self, engine: Engine, step: int) -> list[Decision]:
        """The optimizer's state of every rank's weights to each writer, set in its engine, which
        saves it as data parallel's `<state>.<param>`."""
        for root, writes in enumerate(self.writes):
            if not writes:
                continue
            full = [self.transport.gather(self._flat_owned({n: self.ops.numpy(self.state[n][k]) for n in self.mine},
                                                           self.mine), self.ranges, self.total, root,
                                          "optimizer state gather for the checkpoint")
                    for k in range(len(self.optimizer.state_names))]
            if root == self.rank:
                engine.set_optimizer_state({k: v for name, a in zip(self.optimizer.state_names, full, strict=True)
                                            for k, v in self._unflatten(a, f"{name}.").items()}, self.t)
        return []

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        """Every rank holds the whole model and optimizer state now (rank 0's, broadcast): keep
        this rank's run of the weights and its owned state, let the engine's go."""
        whole = engine.get_weights()
        self.weights = {n: self.ops.array(np.array(whole[n], np.float32)) for n in self.stage.names}
        del whole
        state, count = engine.get_optimizer_state()
        keys = self.optimizer.state_names
        fresh = any(f"{k}.{n}" not in state for k in keys for n in self.mine)
        self.state = {n: tuple(self.ops.array(np.zeros(self.sizes[n], np.float32) if fresh else
                                              np.array(state[f"{k}.{n}"], np.float32).reshape(-1)) for k in keys)
                      for n in self.mine}
        del state
        self.t = int(count)
        if not self.keeps:
            self.ops.release()
            self.ops.drop_moments(self.t)
        a, b = self.cuts[self.rank]
        return [Decision("pipeline", None, {"step": step, "rank": self.rank, "stages": [a, b],
                                            "cuts": [list(c) for c in self.cuts],
                                            "owned_elements": [b - a for a, b in self.ranges],
                                            "frozen_bytes_here": self.stage.frozen_bytes})]

    def close(self) -> None:
        wait_sent(self._sent)
        self._sent = []
