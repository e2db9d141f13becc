"""Sharded data parallel (`dist.shard=optimizer`, ZeRO-1; `dist.shard=gradients`, ZeRO-2), both
engines.

Every rank computes on its own samples as in data parallel, but the optimizer's state (AdamW's
moments m, v; Lion's m: `mlxdist.optim`) is split:
the trainable parameters, flattened in the engine's order (in checkpoint layout) into one
fp32 vector of N elements, are cut into contiguous ranges, rank r owning [a_r, b_r). The
ranges are sized to each rank's memory budget (memory limit x memory_target: the run plan's
`shard_bounds`, from `control/split.py`, the split the memory plan counts), so a 128 GB Studio
holds more of the optimizer state than a 16 GB MacBook. A step:

1. the summed gradients are reduce-scattered (the transport's `reduce_scatter`, unequal ranges,
   in `dist.bucket_mb` buckets where it cuts them): each rank receives the cluster's sum of
   its own range only;
2. loss, count and metrics are all-reduced as in data parallel, the shard divided by the
   cluster's count; the global gradient norm comes from the shards' squared norms;
3. a non-finite loss or norm skips the update (as the engine does); otherwise each rank
   clips by `train.grad_clip` and applies the engine's optimizer (`mlxdist.optim`: the
   formula data parallel runs, decay only on >= 2-D parameters) to its range, with its state
   (fp32) for that range only;
4. the updated ranges are all-gathered and every rank sets the whole model. The update runs in
   `dist.bucket_mb` chunks, and each chunk's new weights leave on a background channel while
   the next chunk is computed (`_plan_chunks`), so the link is not idle during the update.

Each step records its seconds by phase (flatten, reduce_scatter, scalars, norm, update,
all_gather, unpack) in a `shard_phases` event, which `python -m mlxdist.bench shard` prints
beside data parallel's compute and all-reduce.

One sharding for both engines: each lends a few operations (`engine.shard_ops()`,
`engine.base.ShardOps`) that keep the math on its own device (MLX, or torch on MPS/CUDA/CPU),
and only flat numpy crosses between ranks, through the transport (`cluster/transport.py`,
any `dist.backend`), so the exchange knows no framework. Each engine's shard update is its own
unsharded update, element for element (the optimizer's `update`, written once in
`mlxdist.optim`): that is what makes a sharded run equal data parallel on either engine. The
flat vector is in checkpoint layout (the torch engine holds LoRA factors transposed), so
gathered state is the checkpoint's `m.<param>`/`v.<param>` as it is.

On the wire this is what data parallel sends: an all-reduce is a reduce-scatter followed by
an all-gather; here the all-gather carries new weights instead of summed gradients (between
two ranks each sends 4 N bytes a step either way). Which collectives carry it is the
transport's choice (mpi4py: the pipelined ring between hosts and for half-precision wires,
Open MPI's Reduce/Allgatherv on one host; mlx-*: MLX's all_sum/all_gather). The gradients'
wire format is `dist.wire_dtype`'s codec (`cluster/codec.py`). The results equal data
parallel's to fp32 rounding (DESIGN promise 9): the norm's sum is taken per parameter piece,
then over ranks in float64.

Memory. ZeRO-1 saves 8 N (1 - f) bytes per rank (f: the rank's fraction) of the 16 N that
weights, gradients and moments take in data parallel (the all-gather keeps a 4 N buffer, as
data parallel's reducer keeps its result buffers). Both let go of the local gradients before
the update (only the summed shard is needed): ZeRO-1 once the reduce-scatter is done, ZeRO-2
each array as soon as its last bucket is sent (where the transport cuts buckets: Open MPI's
collectives on one host; the ring and MLX send all at once). Held
through the update, they cost ZeRO-1 a tenth of its step rate between hosts (the update's and
the all-gather's fresh buffers could not reuse theirs). Backward still builds the whole
gradient (`value_and_grad`'s tree; torch's `.grad` of every parameter) before any exchange
begins. Sharding gradients during backward would need per-layer hooks, which MLX has not (torch has
them: not used yet). A torch fp16 run is refused: its GradScaler's scaled gradients would
need unscaling and overflow skips here too.

Checkpoints are data parallel's: before a save the writers (rank 0; with
`checkpoint.on_every_host` each host's first rank) gather the moments and hand them to the
engine, which saves `m.<param>`/`v.<param>` as always; after a restore, every rank cuts its
range out of the engine's (broadcast) moments, and the engine's copy is dropped. So a
sharded run and an unsharded one, on any number of ranks, resume each other.

The engine's own moments are never allocated (MLX: lazy zeros, no memory until evaluated;
torch: no optimizer state), except around a save (the writers), a restore and a drift repair
(`share_state` broadcasts the engine's moments, whole), until the next step drops them.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

from ..cluster.codec import make_codec
from ..cluster.transport import Transport
from ..cluster.world import World
from ..config import Config
from ..control.memory_plan import Bytes, RankNeed
from ..control.run_plan import RunPlan
from ..control.step_plan import Decision
from ..engine.base import Engine, Piece, ShardOps, StepStats, nothing_to_learn
from ..tasks.metrics import means
from .data_parallel import DataParallel

LEVELS = {"optimizer": "ZeRO-1", "gradients": "ZeRO-2", "weights": "ZeRO-3"}
MB = 2**20


def check_shardable(cfg: Config, world: World, engine: Engine, shard: str | None = None) -> None:
    """One line for what sharding cannot do (yet); `shard`: the mode as resolved (the run plan's)."""
    shard = shard or cfg.dist.shard
    if engine.capabilities.own_optimizer:
        raise world.agreed_error(f"dist.shard={shard} shards mlxdist's optimizer; this task brings its own optimizer "
                             "(Task.optimizer): drop it or set dist.shard=none")
    if engine.capabilities.loss_scaling:
        raise world.agreed_error(f"dist.shard={shard}: model.dtype=float16 on the torch engine scales the loss "
                                 "(GradScaler), which the sharded update does not undo; use model.dtype=bfloat16 "
                                 "or float32, or dist.shard=none")


def shard_ops(world: World, engine: Engine, shard: str) -> ShardOps:
    """The engine's `Sharding` interface, or one line where its capabilities offer none."""
    if not engine.capabilities.shards:
        raise world.agreed_error(f"dist.shard={shard}: the {engine.name} engine does not shard (its capabilities "
                                 "offer no shard_ops()); set dist.shard=none")
    return engine.shard_ops()


def bucket_counts(bounds: list[tuple[int, int]], lo: int, hi: int) -> list[int]:
    """Elements of [lo, hi) each rank owns."""
    return [max(0, min(b, hi) - max(a, lo)) for a, b in bounds]


class _Sender:
    """One daemon thread running jobs (the chunks' all-gathers) in order. A daemon: a peer
    that died mid-exchange must not keep this process from exiting."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="weight-all-gather").start()

    def _run(self) -> None:
        while True:
            job, done = self._jobs.get()
            if job is None:
                return
            try:
                job()
                done.put(None)
            except BaseException as e:  # noqa: BLE001 - handed to the step's thread, which raises it
                done.put(e)

    def submit(self, job) -> queue.Queue:
        """A queue that gets None when `job` is done, or what it raised."""
        done: queue.Queue = queue.Queue(1)
        self._jobs.put((job, done))
        return done

    def close(self) -> None:
        self._jobs.put((None, None))


class ShardedDataParallel(DataParallel):
    """Data parallel whose exchange and update are sharded; the rest (buffers, meeting every
    step, rollback, the model's weights in checkpoints) is data parallel's."""

    gradient_wire = "summable"  # its reduce-scatter adds payloads hop by hop

    @classmethod
    def check(cls, cfg: Config, world: World, engine: Engine, plan: RunPlan) -> None:
        check_shardable(cfg, world, engine, plan.shard)

    @classmethod
    def memory(cls, need: RankNeed) -> Bytes:
        """Data parallel's weights; the optimizer state's shard (S N f); at the update the
        reduced shard (4 N f; ZeRO-1 still holds the whole gradients too, 4 N), then the shard's
        p, the decay mask and the new p and state beside the old, (9 + S) N f, or the
        all-gathered weights set beside the old ones (4 N + N f), whichever is higher."""
        n, shard, s = need.n, need.shard, need.state_bytes
        gradients = 4 * n + 4 * shard if need.mode == "optimizer" else 4 * shard
        return Bytes((4 + need.copy) * n, gradients, s * shard, need.activations,
                     max((9 + s) * shard, 4 * n + shard), 4 * n)

    def __init__(self, cfg: Config, world: World, engine: Engine, plan: RunPlan, reducer=None,
                 transport: Transport | None = None):
        super().__init__(cfg, world, engine, plan)  # every rank sets the same gathered weights: drift check on
        self.cfg, self.hosts = cfg, list(plan.hosts)
        self.level = plan.shard
        self.ops = shard_ops(world, engine, self.level)
        self.names: list[str] = list(self.ops.names)
        self.shapes = dict(zip(self.names, self.ops.shapes, strict=True))  # checkpoint layout
        sizes = [math.prod(self.shapes[n]) for n in self.names]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        self.total = self.offsets[-1]
        self.bounds = list(plan.shard_bounds)  # control/split.py's shard_bounds, as the memory plan counts
        if not self.bounds or self.bounds[-1][1] != self.total:
            split = self.bounds[-1][1] if self.bounds else 0
            raise RuntimeError(f"dist.shard={self.level}: the run plan splits {split} elements but the engine "
                               f"trains {self.total}; report this as a bug")
        self.lo, self.hi = self.bounds[world.rank]
        self.counts = [b - a for a, b in self.bounds]
        self.bucket = max(1, int(cfg.dist.bucket_mb * MB / 4))
        self.writes = world.allgather(world.rank == 0 or (cfg.checkpoint.on_every_host and world.local_rank == 0))
        self.pieces = tuple(Piece(i, a, b, self.offsets[i] + a - self.lo) for i, _, a, b in self._mine())
        self.optimizer = self.ops.optimizer
        self.transport = transport
        self._plan_chunks(world.size > 1 and self.level != "weights")
        self.state = [self._zero_state(a, b) for a, b in self.chunks]  # per chunk: this range of each state array
        self.t = 0
        self._full: np.ndarray | None = None  # the all-gather's buffer, as data parallel's reducer keeps its own
        self.wire = plan.wire_dtype
        self.codec = make_codec(self.wire, "dist.wire_dtype", summable=True)
        self.ops.drop_moments(self.t)
        self.phases: dict[str, float] = {}  # this step's seconds by phase: the `shard_phases` event

    def _lap(self, phase: str, t0: float) -> float:
        """Adds the seconds since `t0` to `phase`; returns now (the next phase's start)."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - t0
        return now

    # -- layout -----------------------------------------------------------------------
    def _zeros(self):
        return self.ops.array(np.zeros(self.hi - self.lo, np.float32))

    def _zero_state(self, a: int, b: int) -> tuple:
        """Fresh optimizer state for elements [a, b) of this rank's range (one chunk)."""
        return tuple(self.ops.array(np.zeros(b - a, np.float32)) for _ in self.optimizer.state_names)

    def _plan_chunks(self, pipelined: bool) -> None:
        """The update runs chunk by chunk (`dist.bucket_mb` each), and each chunk's new weights
        go out in their own all-gather while the next chunk is computed, on a background
        thread with its own channel: so the link carries weights during the update, as an
        all-reduce's second half starts while its first still runs, instead of waiting for the
        whole shard (the update was ~10-20% of a ZeRO-1 step at 1 Gbit/s, the link idle).
        Chunk k of every rank's shard travels in all-gather k: all ranks cut the same bounds
        alike. One chunk (the whole shard) on one rank and in ZeRO-3, which publishes into
        its own buffers."""
        counts = self.counts if pipelined else [self.hi - self.lo if r == self.world.rank else 0
                                                for r in range(len(self.counts))]
        size = self.bucket if pipelined else max(1, self.hi - self.lo)
        mine = counts[self.world.rank]
        self.chunks = [(a, min(a + size, mine)) for a in range(0, mine, size)] or [(0, 0)]
        self.chunk_pieces = [tuple(Piece(i, x, y, self.offsets[i] + x - self.lo - a)
                                   for i, _, x, y in self._mine(self.lo + a, self.lo + b)) for a, b in self.chunks]
        rounds = max(-(-c // size) for c in counts) if pipelined else 0
        self.gather_owners = [[(a + min(k * size, c), a + min((k + 1) * size, c)) for (a, _), c
                               in zip(self.bounds, self.counts, strict=True)] for k in range(rounds)]
        self._channel: Transport | None = None
        self._gatherer: _Sender | None = None
        if pipelined:
            self._channel = self.transport.channel()
            self._gatherer = _Sender()

    def _mine(self, lo: int | None = None, hi: int | None = None):
        """(index, name, start, end) of each parameter's part within [lo, hi) (default: this rank's
        range), start/end counted within the flattened parameter."""
        lo, hi = (self.lo, self.hi) if lo is None else (lo, hi)
        for i, n in enumerate(self.names):
            a, b = max(self.offsets[i], lo), min(self.offsets[i + 1], hi)
            if a < b:
                yield i, n, a - self.offsets[i], b - self.offsets[i]

    def _slice(self, arrays: dict, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """Elements [lo, hi) (default: this rank's range) of the flattened `arrays` (by name)."""
        parts = [np.asarray(arrays[n], np.float32).reshape(-1)[a:b] for _, n, a, b in self._mine(lo, hi)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _unflatten(self, flat: np.ndarray, prefix: str = "") -> dict[str, np.ndarray]:
        return {prefix + n: flat[self.offsets[i]:self.offsets[i + 1]].reshape(self.shapes[n])
                for i, n in enumerate(self.names)}

    def shard_bytes(self) -> list[int]:
        """Bytes of optimizer state (fp32) each rank holds."""
        return [self.optimizer.state_bytes * c for c in self.counts]

    def optimizer_state_bytes(self, engine: Engine, rank: int) -> int:
        return self.shard_bytes()[rank]

    def describe(self) -> str | None:
        per = self.optimizer.state_bytes
        share = ", ".join(f"rank {r} {c} ({c / max(self.total, 1):.0%}) {per * c / MB:.3g} MB"
                          for r, c in enumerate(self.counts))
        how = "in equal shards (dist.shard_split=equal)" if self.cfg.dist.shard_split == "equal" \
            else "by memory budget"
        wire = "; exchange: " + self.transport.exchange(self.codec.wire_dtype.itemsize * self.total,
                                                        self.codec.wire_dtype)
        if self.wire != "float32":
            wire += f", gradients {self.wire} on the wire (weights fp32)"
        return (f"sharded data parallel, {LEVELS[self.level]} (dist.shard={self.level}): "
                f"{self.optimizer.title} state of {self.total} parameters {how}: {share} (data parallel: "
                f"{per * self.total / MB:.3g} "
                f"MB on every rank){wire}")

    # -- collectives ------------------------------------------------------------------
    def _reduce_scatter(self, grads: list[np.ndarray]) -> np.ndarray:
        """This rank's range of the sum over ranks of `grads` (flat fp32, in name order).
        ZeRO-2 drops each gradient once its last element is sent."""
        return self._sum_ranges(grads, range(len(grads)), self.transport,
                                f"gradient reduce-scatter ({LEVELS[self.level]})", consume=self.level == "gradients")

    def _ranges(self, i: int) -> list[tuple[int, int]]:
        """Each rank's range of parameter `i`, counted within it ((0, 0): none)."""
        a0, b0 = self.offsets[i], self.offsets[i + 1]
        return [(max(a, a0) - a0, min(b, b0) - a0) if min(b, b0) > max(a, a0) else (0, 0) for a, b in self.bounds]

    def _sum_ranges(self, grads: list, indices, transport: Transport, what: str, consume: bool = False) -> np.ndarray:
        """The reduce-scatter of the gradients (no packed copy at fp32) of the parameters
        `indices`, each one's ranges by owner, over `transport`; with `dist.wire_dtype` the
        gradients go as bf16/fp16 (a half-size copy; each hop's sum rounded to it, as data
        parallel's ring does). Returns this rank's ranges, parameter after parameter, fp32."""
        srcs = grads
        if self.codec.wire_dtype != np.float32:
            srcs = [self.codec.to_wire(x) for x in grads]
            if consume:
                grads[:] = [None] * len(grads)  # the half-size copies are what is sent
        owners = [self._ranges(i) for i in indices]
        mine = np.empty(sum(o[transport.rank][1] - o[transport.rank][0] for o in owners), self.codec.wire_dtype)
        transport.reduce_scatter(srcs, owners, mine, what, consume=consume, bucket=self.bucket)
        return self.codec.from_wire(mine)

    def _allgather(self, shard: np.ndarray, keep: bool = True) -> np.ndarray:
        """The whole flat vector from every rank's `shard`; `keep`: into the buffer kept
        between steps (a fresh one costs a page fault per 4 KiB, every step)."""
        if self.transport.size == 1:
            return shard
        if keep and self._full is None:
            self._full = np.empty(self.total, np.float32)
        full = self._full if keep else np.empty(self.total, np.float32)
        full[self.lo:self.hi] = shard
        self.transport.all_gather([full], [self.bounds], f"weight all-gather ({LEVELS[self.level]})",
                                  bucket=self.bucket)
        return full

    def _gather(self, shard: np.ndarray, root: int, what: str = "optimizer state") -> np.ndarray | None:
        return self.transport.gather(shard, self.bounds, self.total, root, f"{what} gather for the checkpoint",
                                     bucket=self.bucket)

    # -- the step ---------------------------------------------------------------------

    def step(self, engine: Engine, lr: float) -> StepStats:
        self.world.rendezvous("waiting for the other ranks to finish computing")
        self.phases = {}
        t0 = time.perf_counter()
        local = engine.take_gradients()
        # Flat numpy before the clock starts: MLX finishes backward here, torch copies off its device.
        grads = [self.ops.flat(i, g) for i, g in enumerate(local.arrays)]
        local.arrays = []
        t0 = self._lap("flatten", t0)
        summed = self._reduce_scatter(grads)
        del grads  # only the summed shard is needed now (ZeRO-2 let each go as it was sent)
        rs_seconds = time.perf_counter() - t0
        t0 = self._lap("reduce_scatter", t0)
        loss_sum, count, *metrics = self.world.allreduce_sum([local.loss_sum, local.count,
                                                              *local.metrics.flat(local.count)])
        self._lap("scalars", t0)
        stats = self._update(engine, summed, loss_sum, int(count), lr)
        stats.metrics = means(local.metrics.names(), metrics)
        self.state_sync(engine.model_state, local.count)
        stats.sync_seconds += rs_seconds
        stats.sync_bytes += (4 if self.wire == "float32" else 2) * self.total  # the reduce-scatter's
        return stats

    def _update(self, engine: Engine, summed: np.ndarray, loss_sum: float, count: int, lr: float) -> StepStats:
        if count <= 0:
            return nothing_to_learn(loss_sum)
        t0 = time.perf_counter()
        g = self.ops.array(summed) * (1.0 / max(count, 1))
        del summed
        # Summed per parameter piece in fp32 as the engine sums (one fp32 sum over a long range
        # drifts: 4e-4 relative over 600k elements on the CPU), then in float64.
        norm = math.sqrt(self.world.allreduce_sum([self.ops.squares(g, self.pieces)])[0])
        self._lap("norm", t0)
        stats = StepStats(loss_sum, count, norm, skipped=False)
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            stats.skipped = True
            return stats
        clip = self.cfg.train.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        t = self.t + 1
        if self._gatherer is None:
            t0 = time.perf_counter()
            p, self.state[0] = self.ops.update(self._shard_weights(), self.state[0], g, self.chunk_pieces[0], lr, t,
                                               coef)
            del g
            self._lap("update", t0)
            stats.sync_seconds, stats.sync_bytes = self._publish(engine, p)
        else:
            stats.sync_seconds, stats.sync_bytes = self._update_while_gathering(engine, g, lr, t, coef)
        self.t = t
        self.ops.drop_moments(t)
        return stats

    def _update_while_gathering(self, engine: Engine, g, lr: float, t: int, coef: float) -> tuple[float, int]:
        """The update chunk by chunk, each chunk's weights all-gathered on the background
        channel while the next is computed (`_plan_chunks`); then into the engine. Seconds:
        from the first chunk's all-gather to the last's end (the exchange in flight; the
        `all_gather` phase is what the update did not hide)."""
        if self._full is None:
            self._full = np.empty(self.total, np.float32)
        full, w, sent, t_first = self._full, self._shard_weights(), [], None
        what = f"weight all-gather ({LEVELS[self.level]})"
        for k, owners in enumerate(self.gather_owners):
            if k < len(self.chunks) and self.chunks[k][1] > self.chunks[k][0]:
                t0 = time.perf_counter()
                a, b = self.chunks[k]
                p, self.state[k] = self.ops.update(w[a:b], self.state[k], g[a:b], self.chunk_pieces[k], lr, t, coef)
                full[self.lo + a:self.lo + b] = self.ops.numpy(p)
                del p
                self._lap("update", t0)
            t_first = t_first or time.perf_counter()
            sent.append(self._gatherer.submit(partial(self._channel.all_gather, [full], [owners], what,
                                                      bucket=self.bucket)))
        del w, g
        t0 = time.perf_counter()
        with self.transport.watch(what):
            errors = [done.get() for done in sent]
        if any(errors):
            raise next(e for e in errors if e)
        t1 = self._lap("all_gather", t0)
        engine.set_weights(self._unflatten(full))
        self._lap("unpack", t1)
        return t1 - (t_first or t1), 4 * self.total

    def _shard_weights(self):
        """This rank's range of the weights: the engine's (a restore or a drift repair may
        have set them)."""
        return self.ops.weights(self.pieces)

    def _publish(self, engine: Engine, p) -> tuple[float, int]:
        """Every rank's updated range to every rank, and into the engine: (seconds, bytes)."""
        t0 = time.perf_counter()
        full = self._allgather(self.ops.numpy(p))
        seconds = time.perf_counter() - t0
        t1 = self._lap("all_gather", t0)
        engine.set_weights(self._unflatten(full))
        self._lap("unpack", t1)
        return seconds, 4 * self.total

    def after_step(self, engine: Engine, step: int, samples: int, last: bool) -> list[Decision]:
        """This step's seconds by phase (flatten, reduce_scatter, scalars, norm, update,
        all_gather, unpack) as a `shard_phases` event: where a sharded step's time goes beside
        data parallel's compute_s and sync_s (`python -m mlxdist.bench shard` prints them)."""
        phases, self.phases = self.phases, {}  # ZeRO-3's step, its own, records some of them too
        if not phases:
            return []
        return [Decision("shard_phases", None, {"step": step, **{k: round(v, 6) for k, v in phases.items()}})]

    def before_last_backward(self, engine: Engine) -> None:
        """The exchange starts after backward: MLX builds the whole backward graph lazily, and
        torch's per-parameter hooks (data parallel's overlap) would only start it earlier."""

    # -- checkpoints ------------------------------------------------------------------
    def before_save(self, engine: Engine, step: int) -> list[Decision]:
        """Gather the optimizer state to every checkpoint writer and hand it to its engine, which
        saves it as data parallel's `m.<param>`/...; dropped again at the next step."""
        mine = [np.concatenate([self.ops.numpy(c[j]) for c in self.state]) for j in range(len(self.state[0]))]
        for root, writes in enumerate(self.writes):
            if not writes:
                continue
            full = [self._gather(a, root) for a in mine]
            if root == self.world.rank:
                engine.set_optimizer_state({k: v for name, a in zip(self.optimizer.state_names, full, strict=True)
                                            for k, v in self._unflatten(a, f"{name}.").items()}, self.t)
        return []

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        """Every rank holds the checkpoint's whole optimizer state now (rank 0's, broadcast): keep
        this rank's range, drop the engine's copy. A fresh run: zeros."""
        state, count = engine.get_optimizer_state()  # count: the checkpoint's, or 0
        keys = self.optimizer.state_names
        if any(f"{k}.{n}" not in state for k in keys for n in self.names):
            self.state = [self._zero_state(a, b) for a, b in self.chunks]
        else:
            mine = [self._slice({n: state[f"{k}.{n}"] for n in self.names}) for k in keys]
            self.state = [tuple(self.ops.array(x[a:b]) for x in mine) for a, b in self.chunks]
            del mine
        del state
        self.t = int(count)
        self.ops.drop_moments(self.t)
        return [Decision("shard", None, {"step": step, "mode": self.level, "rank": self.world.rank,
                                         "elements": self.counts, "bounds": [list(b) for b in self.bounds],
                                         "optimizer_bytes": self.shard_bytes(),
                                         "optimizer_bytes_here": self.shard_bytes()[self.world.rank]})]

    def close(self) -> None:
        """The background all-gather's thread and channel (the transport is the run's)."""
        if self._gatherer is not None:
            self._gatherer.close()
            self._channel.close()
            self._gatherer = self._channel = None
