"""Fully sharded data parallel (`dist.shard=weights`, ZeRO-3, FSDP's idea), both engines.

ZeRO-2 (`sharded.py`) with the weights cut too: rank r keeps only its range [a_r, b_r) of the
fp32 weights, beside its range of the moments and of the summed gradient, cut by memory budget
as ZeRO-1/2 cut them. So between steps a rank holds 16 N f bytes (f: its fraction) where data
parallel holds 16 N, and a model bigger than any one Mac fits across several.

To compute, the model runs stage by stage (`model.stages()`: the built-in LM's embedding, each
block, its head). A stage's weights are all-gathered just before it runs and let go after, in
the forward pass and again in the backward pass (which recomputes the stage from its input, as
`model.grad_checkpoint_every=1` does); its gradient is reduce-scattered as soon as backward
leaves it, each rank adding its range into its gradient shard. So in a step a rank holds one
stage's weights and gradient, the stages' inputs, and its shards.

The loop's forward-backward phase runs it (`forward_backward`, the strategy's hook): every rank
must take part in every gather, whatever its micro-batches (3+5 samples may be one micro-batch
here and two there), so the phase agrees on the most any rank has, and a rank with fewer joins
the remaining rounds' exchanges with zero gradients, computing nothing. Stages run in the same
order everywhere, so the exchanges pair up. The step phase is then only the update.

On the wire a micro-batch moves the weights twice (forward and backward) and the gradients
once: 1.5 times the bytes of data parallel's all-reduce, per micro-batch (data parallel sends
once per step). The exchanges run on a transport channel of their own (`Transport.channel`,
pipelined: under mpi4py the ring, one host too, a stage one ring collective; mx.distributed
has no second channel, so under mlx-* backends they go over mpi4py's ring). The update is
ZeRO-1/2's on the shard, with no all-gather after it: the next step's forward gathers what it
needs.

Evaluation runs stage by stage too (`eval_losses`, forward only, rounds agreed as in the
step). The whole model exists only where something reads it whole: a checkpoint's writers
(rank 0; with `checkpoint.on_every_host` each host's first rank) gather it with the moments
for the save (12 N bytes there, for that phase), and rank 0 for a task's `on_eval` hook
(`whole_model`); they let go after. No other rank ever holds it. A checkpoint is data
parallel's, so a ZeRO-3 run resumes on any number of ranks, sharded or not, and the other way
round.

Each engine runs the stages its own way (`staged_step`: MLX with `mx.vjp` per stage, torch
with `torch.autograd.grad`), through `engine.shard_ops()` (`engine.base.StagedOps`), so this
module knows neither framework. Not here (one line at start instead): models without stages
(`models/stages.py`: a task's model with no `stages()`, a pretrained base of a family it does not
know), LoRA, models with buffers, `train.ema`, a task's own optimizer, torch's fp16 GradScaler.
An out-of-memory in the forward-backward phase is not retried with a smaller micro-batch (the
computing happens inside the exchange, where ranks cannot redo alone); the planner sizes it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..cluster.transport import Transport
from ..cluster.world import World
from ..config import Config
from ..control.memory_plan import Bytes, RankNeed
from ..control.run_plan import RunPlan
from ..engine.base import Engine, StepStats
from ..tasks import Batch
from ..tasks.metrics import means
from .sharded import ShardedDataParallel, shard_ops


def check_stageable(cfg: Config, world: World, engine: Engine) -> list[list[str]]:
    """The model's stages, or one line for what ZeRO-3 cannot run."""
    why = "dist.shard=weights (ZeRO-3) runs the model a stage at a time"
    if cfg.finetune.method != "full":
        raise world.agreed_error(f"dist.shard=weights with finetune.method={cfg.finetune.method}: only the adapters "
                                 "train, and they are small; use dist.shard=gradients (or none)")
    if cfg.train.ema:
        raise world.agreed_error("dist.shard=weights with train.ema: the average is a whole copy of the weights on "
                                 "every rank, which ZeRO-3 exists to avoid; drop train.ema or use dist.shard=gradients")
    if engine.model_state.has_state():
        raise world.agreed_error(f"{why}; this model has buffers or frozen arrays besides its trained weights "
                                 "(BatchNorm's statistics, ...), which it does not shard: use dist.shard=gradients")
    if not engine.capabilities.staged:
        raise world.agreed_error(f"{why}, but {type(engine.model).__name__} has no stages() (the built-in LM's presets "
                                 "and mlx-lm Llama/Mistral/Qwen/GPT-2 bases do); use dist.shard=gradients, or give the model a stages() method (docs/"
                                 "bigger-than-one-mac.md)")
    names = shard_ops(world, engine, "weights").stage_names()
    trained, seen = set(engine.trained_names), {n for stage in names for n in stage}
    if seen != trained:
        odd = sorted(trained - seen)[:3] or sorted(seen - trained)[:3]
        raise world.agreed_error(f"{type(engine.model).__name__}.stages() do not name each trained parameter: "
                                 f"{', '.join(odd)} (stages must cover the trained parameters, nothing else)")
    return names


@contextmanager
def lent_whole(strategy: Any, engine: Engine, ranks: Collection[int], gather: Callable[[int], np.ndarray],
               keep: bool = False) -> Iterator[None]:
    """What ZeRO-3 and a pipeline share: the whole model (`gather(root)`, every rank taking part
    for each root) set in the engines of `ranks` for the duration. The outermost of nested entries
    lets go after (the weights and the moments a writer was handed), unless `keep`."""
    for root in sorted(set(ranks)):
        full = gather(root)
        if root == strategy.world.rank:
            engine.set_weights(strategy._unflatten(full))
        del full
    strategy._depth += 1
    try:
        yield
    finally:
        strategy._depth -= 1
        if strategy._depth == 0 and not keep and not strategy.ops.released:
            strategy.ops.release()
            strategy.ops.drop_moments(strategy.t)


class ExchangeThread:
    """ZeRO-3's exchanges on a thread of their own, so the next stage's gather and the reduce
    of the stage just left run while the compute works on the stage at hand. One round at a
    time, in a schedule every rank runs alike; at most two stages' gathered weights wait at
    once (the one computing and the next), so the prefetch costs a stage's memory, not the
    model's. Only this thread uses the strategy's transport channel."""

    def __init__(self, gather: Callable[[int], list], reduce: Callable[[int, list | None], None], watch):
        self._gather, self._reduce, self._watch = gather, reduce, watch
        self._rounds: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._grads: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(2)
        self._holding = False
        self._done = threading.Event()
        self._done.set()
        self.error: BaseException | None = None
        self.busy_s = self.waited_s = 0.0
        threading.Thread(target=self._run, daemon=True, name="zero3-exchanges").start()

    def reset_clock(self) -> None:
        self.busy_s = self.waited_s = 0.0

    def _run(self) -> None:
        while True:
            schedule, joining = self._rounds.get()
            try:
                for kind, s in schedule:
                    if kind == "gather":
                        if not joining:
                            self._slots.acquire()
                        t0 = time.perf_counter()
                        out = self._gather(s)
                        self.busy_s += time.perf_counter() - t0
                        if not joining:
                            self._ready.put((s, out))
                    else:
                        flats = keep = None
                        if not joining:
                            got, flats, keep = self._grads.get()  # keep: the arrays `flats` may view
                            assert got == s, f"reduce of stage {got} where stage {s} is due"
                        t0 = time.perf_counter()
                        self._reduce(s, flats)
                        self.busy_s += time.perf_counter() - t0
                        del flats, keep
            except BaseException as e:  # noqa: BLE001 - handed to the compute's thread, which raises it
                self.error = e
                self._ready.put(None)
            finally:
                self._done.set()

    def start(self, schedule: list[tuple[str, int]], joining: bool) -> None:
        """A round's exchanges; `joining`: this rank has no micro-batch for it (zero gradients,
        nothing taken)."""
        self._done.clear()
        self._rounds.put((schedule, joining))

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._slots.release()

    def take(self, s: int) -> list[np.ndarray]:
        """Stage s's gathered weights (waiting for them if they are not there yet); the stage
        taken before is done with."""
        self._release()
        t0 = time.perf_counter()
        with self._watch(f"weight all-gather of stage {s} (ZeRO-3, ring)"):
            got = self._ready.get()
        self.waited_s += time.perf_counter() - t0
        if got is None:
            raise self.error
        self._holding = True
        return got[1]

    def give(self, s: int, flats: list[np.ndarray], keep) -> None:
        """Stage s's gradients (flat views of `keep`) to reduce; the stage is done with."""
        self._release()
        self._grads.put((s, flats, keep))

    def finish(self, what: str) -> None:
        """Wait for the round's last exchanges."""
        self._release()
        t0 = time.perf_counter()
        with self._watch(what):
            self._done.wait()
        self.waited_s += time.perf_counter() - t0
        if self.error is not None:
            raise self.error


class FullyShardedDataParallel(ShardedDataParallel):
    """ZeRO-2 whose weights are sharded too; the model computed stage by stage."""

    redo_after_oom = False  # a rank cannot redo its stages alone: the others are in the exchange

    @classmethod
    def check(cls, cfg: Config, world: World, engine: Engine, plan: RunPlan) -> None:
        check_stageable(cfg, world, engine)
        super().check(cfg, world, engine, plan)

    @classmethod
    def memory(cls, need: RankNeed) -> Bytes:
        """ZeRO-2's shards plus the weights' (4 N f), one gathered stage (fp32 and its compute
        copy) and its gradient (4 G), only the stages' inputs kept for backward. The update's p
        is the shard held anyway: the mask and the new p and state, (5 + S) N f. Whole: every
        rank builds the whole model at start (4 N) before it cuts its slice; the checkpoint
        writer gathers the weights and state to save them ((4 + S) N)."""
        shard, s, g = need.shard, need.state_bytes, need.gather
        act = need.activations if need.staged_activations is None else need.staged_activations
        return Bytes(4 * shard + (4 + need.copy) * g, 4 * shard, s * shard, act, (5 + s) * shard, 4 * g,
                     (4 + s) * need.n if need.writer else 4 * need.n)

    def __init__(self, cfg: Config, world: World, engine: Engine, plan: RunPlan, reducer=None,
                 transport: Transport | None = None):
        super().__init__(cfg, world, engine, plan, reducer, transport)
        stage_names = self.ops.stage_names()
        # ZeRO-3's many small exchanges (a stage at a time) run on the exchange thread.
        self.channel = self.transport.channel(pipelined=True)
        self.drift_check = False  # one copy of each weight: nothing to drift apart
        index = {n: i for i, n in enumerate(self.names)}
        self.stages = [[index[n] for n in names] for names in stage_names]
        self.owners = [self._ranges(i) for i in range(len(self.names))]
        self.p = self._zeros()  # this rank's range of the weights: set by load_state_dict
        self.grad = np.zeros(0, np.float32)
        self.rounds_run = 0
        self._depth = 0  # whole_model's nesting
        self.exchanges = ExchangeThread(self._gather_stage, self._reduce, world.watch)

    def describe(self) -> str | None:
        line = (super().describe().replace(f"{self.optimizer.title} state of",
                                              f"weights, gradients and {self.optimizer.title} state of")
                + f"; {len(self.stages)} stages, gathered one at a time; no weight-drift check (one copy of "
                "each weight)")
        if self.cfg.model.grad_checkpoint_every:
            line += "; model.grad_checkpoint_every does nothing here (every block is recomputed anyway)"
        return line

    # -- a stage's exchanges (run on the exchange thread) --------------------------------
    def _gather_stage(self, s: int) -> list[np.ndarray]:
        """Stage s's whole weights (flat fp32), every rank's range of them."""
        mine = self.ops.numpy(self.p)
        outs = []
        for i in self.stages[s]:
            buf = np.empty(self.offsets[i + 1] - self.offsets[i], np.float32)
            a, b = self.owners[i][self.world.rank]
            buf[a:b] = mine[self.offsets[i] + a - self.lo:self.offsets[i] + b - self.lo]
            outs.append(buf)
        self.channel.all_gather(outs, [self.owners[i] for i in self.stages[s]])
        return outs

    def _reduce(self, s: int, flats: list[np.ndarray] | None) -> None:
        """Stage s's gradients (None: zeros, a round this rank joins) summed over ranks; this
        rank's ranges added into its gradient shard."""
        idx = self.stages[s]
        if flats is None:
            flats = [np.zeros(self.offsets[i + 1] - self.offsets[i], np.float32) for i in idx]
        got = self._sum_ranges(flats, idx, self.channel, f"gradient reduce-scatter of stage {s}")
        at = 0
        for i in idx:
            a, b = self.owners[i][self.world.rank]
            start = self.offsets[i] + a - self.lo
            self.grad[start:start + b - a] += got[at:at + b - a]
            at += b - a

    def _schedule(self, backward: bool = True) -> list[tuple[str, int]]:
        """A round's exchanges, in the order every rank runs them: the forward's gathers, then
        backward's, each stage's gather before the reduce of the stage after it, so it runs
        while that stage's backward computes (the last stage is gathered once for both)."""
        last = len(self.stages) - 1
        order = [("gather", s) for s in range(last + 1)]
        if backward:
            for s in range(last, -1, -1):
                order += ([("gather", s - 1)] if s > 0 else []) + [("reduce", s)]
        return order

    # -- the compute's side ---------------------------------------------------------------
    def _fetch(self, s: int) -> list:
        return [self.ops.array(buf.reshape(self.shapes[self.names[i]]))
                for i, buf in zip(self.stages[s], self.exchanges.take(s), strict=True)]

    def _hand(self, s: int, grads: list) -> None:
        self.exchanges.give(s, [self.ops.flat(i, g) for i, g in zip(self.stages[s], grads, strict=True)], grads)

    def _rounds(self, batches: list, run, backward: bool) -> list:
        """`run(batch)` for each of this rank's batches, with their exchanges on the exchange
        thread; as many rounds as the rank with the most batches (this one joins the rest)."""
        rounds = max(self.world.allgather(len(batches)))  # every rank runs as many, so exchanges pair up
        self.rounds_run, out = rounds, []
        for k in range(rounds):
            mine = k < len(batches)
            self.exchanges.start(self._schedule(backward), joining=not mine)
            if mine:
                out.append(run(batches[k]))
            self.exchanges.finish("the exchanges of a micro-batch another rank still computes" if not mine
                                  else "the last exchanges of this micro-batch")
        return out

    # -- the loop's phases --------------------------------------------------------------
    def forward_backward(self, engine: Engine, batches: list[Batch]) -> float:
        """The step's micro-batches a stage at a time, each stage's gather and reduce-scatter on
        the exchange thread beside the compute; the gradients land in this rank's shard.
        Returns the seconds the compute waited: for the other ranks to arrive, and for
        exchanges the compute could not hide."""
        t0 = time.perf_counter()
        self.world.rendezvous("waiting for the other ranks to finish reading their batches")
        arrived = time.perf_counter() - t0
        self.grad = np.zeros(self.hi - self.lo, np.float32)
        self.exchanges.reset_clock()
        self._rounds(batches, lambda b: self.ops.staged(b, self._fetch, self._hand), backward=True)
        return arrived + self.exchanges.waited_s

    def step(self, engine: Engine, lr: float) -> StepStats:
        """The update of this rank's shard from the gradients `forward_backward` reduced."""
        local = self.ops.totals()
        loss_sum, count, *metrics = self.world.allreduce_sum([local.loss_sum, local.count,
                                                              *local.metrics.flat(local.count)])
        summed, self.grad = self.grad, np.zeros(0, np.float32)
        stats = self._update(engine, summed, loss_sum, int(count), lr)
        stats.metrics = means(local.metrics.names(), metrics)
        stats.sync_seconds = self.exchanges.busy_s  # the exchanges' own time, mostly beside the compute
        # Per round, the schedule's: each stage's weights twice (the last once) and its gradients
        # once, a tied embedding in both its stages; this rank's link carries about (1 - f) of it.
        wire = 4 if self.wire == "float32" else 2
        stats.sync_bytes = self.rounds_run * sum((4 if kind == "gather" else wire) * self._size(s)
                                                 for kind, s in self._schedule())
        return stats

    def _size(self, s: int) -> int:
        return sum(self.offsets[i + 1] - self.offsets[i] for i in self.stages[s])

    def _shard_weights(self):
        return self.p

    def _publish(self, engine: Engine, p) -> tuple[float, int]:
        self.p = p  # the next forward pass gathers what it needs
        return 0.0, 0

    # -- the whole model, outside the step --------------------------------------------
    @contextmanager
    def whole_model(self, engine: Engine, ranks: Collection[int]) -> Iterator[None]:
        """Gathered into the engine of `ranks` only (a checkpoint's writers, the rank that runs
        a hook); the others hold their shards as before. Nested entries gather again (every
        rank alike) and only the outermost lets go."""
        with lent_whole(self, engine, ranks, lambda root: self._gather(self.ops.numpy(self.p), root, "weight")):
            yield

    def eval_losses(self, engine: Engine, batches: list, metrics) -> list[tuple[float, int]]:
        """Forward only, stage by stage, as many rounds on every rank as the step runs them."""
        return self._rounds(batches, lambda b: self.ops.staged_eval(b, self._fetch, metrics), backward=False)

    def load_state_dict(self, shared, root, step, engine, optimizer_step):
        """ZeRO-1/2's (the moments' range), then this rank's range of the weights every rank
        now holds whole; the engine lets go of the rest."""
        decisions = super().load_state_dict(shared, root, step, engine, optimizer_step)
        self.p = self.ops.array(np.array(self.ops.numpy(self.ops.weights(self.pieces)), np.float32))  # a copy
        self.ops.release()
        return decisions
