"""How ranks agree: the one object the loop holds for it, and never inspects.

A strategy owns the exchange of a step (gradients now, or nothing until an outer sync),
when the ranks meet to share control numbers (stop requests, re-plans, rollback), whether
the weight-drift check applies, what a checkpoint calls the model's weights, its own
checkpoint state, its start-up checks and `close`. `Strategy` answers every hook as data
parallel does, so a strategy writes only what it changes. Adding one is a module with a
subclass and `@register(name)` (or a "module:Class" entry in `STRATEGIES`, `mlxdist/registry.py`);
`strategy_name` maps the config to a name. What a strategy cannot be combined with it declares
(`ranks_differ`, `shardable`, `gradient_wire`, `time_box`), and the config checks the declarations
in one place (`config.check_pieces`); what its rank keeps alone goes through `save_rank_file` /
`load_rank_files`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TypeVar

import numpy as np

from .. import registry
from ..cluster.transport import Transport
from ..cluster.world import World
from ..config import Config, ConfigError
from ..control.memory_plan import MODES, Bytes, MemoryLine, RankNeed
from ..control.run_plan import RunPlan
from ..control.step_plan import Decision
from ..engine.base import Engine, StepStats
from ..registry import SHARD_NAMES, STRATEGIES
from ..state import rank_state
from ..tasks import Batch
from ..tasks.metrics import MetricSums


class Strategy(ABC):
    """The loop's contract with a way of training. Built as `cls(cfg, world, engine, plan,
    reducer, transport)` after `cls.check(cfg, world, engine, plan)` passed on every rank; `reducer` is the
    engine's gradient sum (data parallel's exchange; others may ignore it)."""

    drift_check: bool = False  # whether all ranks should hold bit-identical weights after every step
    redo_after_oom: bool = True  # the loop may redo a step's micro-batches smaller after an out-of-memory
    # What it cannot be combined with, declared, and checked in one place (`config.check_pieces`):
    ranks_differ: bool = False  # ranks hold different weights between meetings: no one model each step
    #                             to average (train.ema) or to normalise over ranks (train.sync_batchnorm)
    shardable: bool = False  # dist.shard may run it sharded (zero1/2/3: data parallel's sharded forms);
    #                          otherwise dist.shard is refused with it, never put in its place
    gradient_wire: str = "any"  # the dist.wire_dtype codecs it takes: "any" (its gradients go through the
    #                             run's reducer, which all-gathers a codec that is not summable), "summable"
    #                             (its exchange adds payloads on the wire), "none" (it sends no gradients)
    wire_key: str | None = None  # the key that names its own exchange's codec (DiLoCo: dist.outer_wire)
    time_box: bool = False  # it takes dist.sync_every_s (a time box of its local phase)
    speed_weighted: bool = False  # it gives a faster rank more work by RunPlan.speeds (nodes: speed, or
    #                               measured at start: training/speed_probe.py)
    title: str = ""  # as refusals name it ("DiLoCo"); empty: dist.mode=NAME

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Refuse, from the config alone, what this strategy's own keys cannot be: one
        `ConfigError` line naming the key (`load_config` calls it for the mode's strategy)."""
        return None

    @classmethod
    def probe(cls, cfg: Config, world: World, engine: Engine, sample: Callable[[], Batch], plan: RunPlan) -> RunPlan:
        """What this strategy measures at start, before `check` (collective: every rank calls
        it), as the run plan carries it; `sample()` gives a batch of one sample. Measure nothing
        where `check` will refuse: it says why."""
        return plan

    @classmethod
    def check(cls, cfg: Config, world: World, engine: Engine, plan: RunPlan) -> None:
        """Refuse, before anything is built, what this strategy cannot run: one line through
        `world.agreed_error` (every rank decides alike)."""
        return None

    @classmethod
    def memory(cls, need: RankNeed) -> Bytes:
        """This strategy's line of the memory plan (`python -m mlxdist.plan`; the table in
        `control/memory_plan.py`): what one rank holds. Data parallel's: the whole weights
        (and the compute copy), gradients (and the reducer's summed copy on 2+ ranks) and
        optimizer state; the update's new p and state beside the old."""
        n, s = need.n, need.state_bytes
        return Bytes((4 + need.copy) * n, 4 * n * (2 if need.ranks > 1 else 1), s * n, need.activations,
                     (4 + s) * n, 4 * n)

    def describe(self) -> str | None:
        """A banner line, or None when there is nothing to say."""
        return None

    def trains(self, step: int) -> bool:
        """Whether this rank computes step `step` (1-based, about to run). Data parallel:
        always. Time-boxed DiLoCo: a slower rank sits some steps of a round out, so all ranks
        reach the outer sync together. A step sat out computes nothing, `step` returns the
        last stats unchanged, and the loop neither judges nor reports it."""
        return True

    def forward_backward(self, engine: Engine, batches: list[Batch]) -> float:
        """The loop's forward-backward phase: this rank's micro-batches of the step, their
        gradients left in the engine for `step`. Returns the seconds of it spent waiting for
        other ranks, which the loop does not count as compute (none here: data parallel
        exchanges in `step`, or beside the last backward without waiting)."""
        for i, batch in enumerate(batches):
            if i == len(batches) - 1:
                self.before_last_backward(engine)
            engine.micro_step(batch)
        return 0.0

    @abstractmethod
    def step(self, engine: Engine, lr: float) -> StepStats:
        """Exchange what this strategy exchanges per step, then update the engine."""

    def before_last_backward(self, engine: Engine) -> None:
        """The step's last micro-batch comes next: a strategy may start its exchange while
        that backward runs (torch data parallel sends buckets as gradients become final)."""
        return None

    def meets(self, step: int) -> bool:
        """Whether the ranks exchange control numbers after `step` (data parallel: they meet in
        every step's exchange anyway)."""
        return True

    def agree_on_rollback(self, wanted: bool, step: int) -> bool:
        """Whether every rank rolls back after `step`; all ranks return the same answer. By
        default every rank saw the same loss and norm, so the verdicts agree already."""
        return wanted

    def after_step(self, engine: Engine, step: int, samples: int, last: bool) -> list[Decision]:
        """After the update of a step of `samples` samples here: anything due (outer syncs).
        `last`: the run reaches train.steps; it must end on one model."""
        return []

    def before_save(self, engine: Engine, step: int) -> list[Decision]:
        """Make the state whole for a checkpoint (land exchanges in flight)."""
        return []

    def whole_model(self, engine: Engine, ranks: Collection[int]) -> AbstractContextManager:
        """The whole model in the engine of `ranks` for the duration (a checkpoint's writers, a
        hook's rank): ZeRO-3 gathers its shards there, then lets go; the others hold it anyway.
        Collective, entered alike on every rank."""
        return nullcontext()

    def eval_losses(self, engine: Engine, batches: list[Batch], metrics: MetricSums) -> list[tuple[float, int]]:
        """(summed loss, units) of each of this rank's evaluation batches; collective where the
        strategy must take part (ZeRO-3 gathers each stage's weights on every rank)."""
        return [engine.eval_loss(b, metrics) for b in batches]

    def model_weights(self, engine: Engine) -> dict[str, np.ndarray]:
        """The weights a checkpoint saves as the model's: the ones every rank agrees on."""
        return engine.get_weights()

    def optimizer_state_bytes(self, engine: Engine, rank: int) -> int:
        """Bytes of mlxdist's optimizer state (fp32: `train.optimizer`'s) `rank` holds: all of it
        by default."""
        return engine.optimizer.state_bytes * int(sum(engine.gradient_sizes()))

    def state_dict(self, engine: Engine) -> dict[str, np.ndarray]:
        """Shared state for the run's checkpoint (identical on every rank)."""
        return {}

    def save_rank_state(self, root: Path, step: int, engine: Engine, keep: int) -> None:
        """State that is this rank's own, written by every rank beside the run."""
        return None

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        """After the engine holds the checkpoint's weights on every rank (collective); `shared`
        None: a fresh run, starting from the weights every rank now holds."""
        return []

    def close(self) -> None:
        """Let go of what the strategy holds (threads, communicators)."""
        return None


S = TypeVar("S", bound=type[Strategy])


def register(name: str) -> Callable[[S], S]:
    """A class decorator: the strategy under `name` in `STRATEGIES` (`mlxdist/registry.py`);
    dist.mode=NAME trains with it. A name is registered once (a built-in's too)."""
    return registry.registrar(STRATEGIES, "strategy", name)


def strategy_class(name: str) -> type[Strategy]:
    return registry.load(STRATEGIES, "sync strategy", name)


def mode_strategy(cfg: Config) -> type[Strategy]:
    """The strategy dist.mode names (before dist.shard is looked at)."""
    return strategy_class(registry.mode_strategy_name(cfg.dist.mode))


def strategy_name(cfg: Config, shard: str | None = None) -> str:
    """The registered name a run trains with: dist.mode's strategy, or with dist.shard (`auto`
    resolved before: `shard_plan.resolve_shard`) the sharded strategy for it, when dist.mode's
    strategy declares itself `shardable`; a mode that is not is refused, never replaced."""
    shard = shard or cfg.dist.shard
    mode = registry.mode_strategy_name(cfg.dist.mode)
    if shard in SHARD_NAMES or shard == "auto":
        refusal = shard_refusal(strategy_class(mode), cfg.dist.mode, shard)
        if refusal:
            raise ConfigError(refusal)
        return SHARD_NAMES.get(shard, mode)
    return mode


def shard_refusal(cls: type[Strategy], mode: str, shard: str) -> str | None:
    """The line refusing dist.shard with dist.mode's strategy `cls`, or None where it may be sharded."""
    if shard == "none" or cls.shardable:
        return None
    why = "keeps each rank's own optimizer" if cls.ranks_differ else "does not run sharded"
    return f"dist.shard={shard} shards data parallel's optimizer; dist.mode={mode} {why}: set dist.shard=none"


def memory_lines() -> dict[str, MemoryLine]:
    """Each dist.shard mode's line of the memory plan, its strategy's `memory` (handed to
    `control.memory_plan.plan`, which imports no strategy)."""
    return {mode: strategy_class(SHARD_NAMES.get(mode, "data_parallel")).memory for mode in MODES}


def make_strategy(cfg: Config, world: World, engine: Engine, reducer, plan: RunPlan,
                  transport: Transport) -> Strategy:
    """The run's strategy, checked, then built (every rank alike). `plan`: the run plan (its
    `shard` is dist.shard resolved); `transport`: the run's data plane
    (`cluster.transport.make_transport`), which strategies that own their exchange use; data
    parallel's goes through `reducer`."""
    try:
        name = strategy_name(cfg, plan.shard)
    except ConfigError as e:
        raise world.agreed_error(str(e)) from None
    cls = strategy_class(name)
    cls.check(cfg, world, engine, plan)
    return cls(cfg, world, engine, plan, reducer, transport)


def share_state(world: World, engine: Engine, root: int = 0) -> None:
    """Make weights, the rest of the model's state (buffers), moments and the update count on
    every rank equal `root`'s: at the start
    of a run (a model initialised without a seed differs per rank), after a restore, and to
    repair drift."""
    if world.size == 1:
        return
    mine = world.rank == root  # only the root's are read (ZeRO-3's other ranks hold none)
    opt, opt_step = engine.get_optimizer_state() if mine else ({}, None)
    weights = world.broadcast_arrays(engine.get_weights() if mine else {}, root)
    opt = world.broadcast_arrays(opt, root)
    state = world.broadcast_arrays(engine.model_state.get_state() if mine else {}, root)
    engine.set_weights(weights)
    engine.set_optimizer_state(opt, world.bcast(opt_step, root))
    engine.model_state.set_state(state)


def save_rank_file(world: World, hosts: list[str], root: Path, step: int, arrays: dict[str, np.ndarray],
                   keep: int, optimizer_step: int | None = None) -> Path:
    """What this rank keeps alone (its own weights, optimizer state, a wire's residuals) in its
    file of `step` beside the run (`state/rank_state.py`), the newest `keep` kept."""
    info = rank_state.RankStateInfo(step, world.rank, world.size, list(hosts),
                                    step if optimizer_step is None else int(optimizer_step))
    return rank_state.save(root, info, arrays, keep)


def load_rank_files(world: World, hosts: list[str], root: Path, step: int
                    ) -> tuple[dict[str, np.ndarray] | None, int | None, str]:
    """This rank's file of `step`, on every rank or on none (collective: the ranks must agree on
    what they resume from): (arrays, the optimizer's update count saved with them, "") when every
    rank of this same cluster found a whole file, else (None, None, the first reason a rank gave)."""
    own, own_step, why = None, None, ""
    try:
        own, own_step = rank_state.load(root, step, world.rank, world.size, list(hosts))
    except rank_state.RankStateMissing as e:
        why = str(e)
    reasons = [r for r in world.allgather(why) if r]
    if reasons:
        return None, None, reasons[0]
    return own, own_step, ""
