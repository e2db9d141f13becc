"""`dist.mode=diloco` as a sync strategy: local inner steps, DiLoCo's outer step.

Each rank steps on its own gradients (no per-step collective); after each step
`after_step` syncs the fragments DiLoCo says are due, blocking or on a worker thread
(`dist.overlap_steps`), and writes the new weights back into the engine. Ranks meet for
control numbers every `control.balance_interval` steps and at the end: between meetings
no rank waits for a slower one, and a stop request takes at most that many steps. The
drift check does not apply: ranks differ between outer syncs by design.

With a time box (`dist.sync_every_s`) a round is as many of the cluster's steps as the
fastest rank fits in the box; a slower rank trains on fewer of them and sits the rest out
(`trains`), so every rank reaches the outer sync at the same time with as many inner
steps as its speed allowed. The step counter, learning-rate schedule, data stream,
evaluations and checkpoints stay the cluster's, the same on every rank; the ranks meet
only where rounds end (a meeting mid-round would make the fast ones wait).

The outer state is split the way it lives: what every rank shares (outer momentum,
fragment cursor, the time box's plan; the anchors are the checkpoint's model weights) goes
into the run's checkpoint, what is each rank's own (local weights, AdamW moments, wire
residuals, round position) into a per-rank file (`state/rank_state.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..cluster.transport import Transport
from ..cluster.world import World
from ..config import Config, ConfigError, DistConfig
from ..control.run_plan import RunPlan
from ..control.step_plan import Decision
from ..engine.base import Engine, StepStats, local_step
from .comm import allgather_from_transport, allreduce_from_transport
from .diloco import DiLoCo, OuterStats
from .fragments import TimeBox
from .model_state import StateSync
from .overlap import OverlappedSync
from .strategy import Strategy, load_rank_files, save_rank_file


class DiLoCoStrategy(Strategy):
    """Ranks differ between outer syncs by design: no drift check (`Strategy`'s default)."""

    title = "DiLoCo"
    ranks_differ = True  # each rank its own weights and optimizer between outer syncs
    gradient_wire = "none"  # it sends pseudo-gradients, on dist.outer_wire
    wire_key = "dist.outer_wire"
    time_box = True

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        # With dist.sync_every_s, dist.inner_steps is the first round's length (every rank trains
        # on every step while the paces are timed); the checks below hold for it as for any round.
        d = cfg.dist
        if d.fragments > d.inner_steps:
            raise ConfigError(f"dist.fragments: {d.fragments} exceeds dist.inner_steps ({d.inner_steps}); "
                              "each fragment needs at least one inner step per round")
        if d.overlap_steps >= d.inner_steps:
            raise ConfigError(f"dist.overlap_steps: {d.overlap_steps} must be below dist.inner_steps "
                              f"({d.inner_steps}): a fragment's sync must land before its next one starts")
        if d.sync_every_s is not None and cfg.control.balance:
            raise ConfigError("dist.sync_every_s: the time box already gives a faster node more work (more inner "
                              "steps per round); set control.balance=false or remove dist.sync_every_s")

    def __init__(self, cfg: Config, world: World, engine: Engine, plan: RunPlan, reducer=None,
                 transport: Transport | None = None):
        self.world, self.hosts, self.dist = world, list(plan.hosts), cfg.dist
        self.meet_every, self.steps = cfg.control.balance_interval, cfg.train.steps
        self.outer = OuterSync(cfg.dist, plan.outer_wire, engine.get_weights(), transport)
        d = cfg.dist
        # A round must give each fragment a step of its own, and an overlapped sync must
        # land before its fragment's next one starts.
        self.box = (TimeBox(d.sync_every_s, world.rank, world.size, d.inner_steps,
                            max(d.fragments, d.overlap_steps + 1)) if d.sync_every_s else None)
        self.round_start = 0  # the step the round in progress began after
        self._rollback_wanted = False
        self._working = True
        self._last = StepStats(0.0, 0, 0.0, False, local=True)
        # Buffers (running statistics) are agreed once a round, when the round closes, weighted
        # by each rank's samples in it; between rounds each rank keeps its own, as its weights.
        self.state_sync, self._round_samples = StateSync(world), 0

    def describe(self) -> str:
        return describe(self.dist)

    def trains(self, step: int) -> bool:
        """Every step without a time box; with one, the steps of the round this rank's
        share of the plan spreads evenly over it."""
        self._working = self.box.start_step(self.outer.dl.round_steps) if self.box is not None else True
        return self._working

    def step(self, engine: Engine, lr: float) -> StepStats:
        if self._working:
            self._last = local_step(engine, lr)
        if self.box is not None:
            self.box.computed()
        return self._last  # a step sat out: nothing new; the loop neither judges nor reports it

    def meets(self, step: int) -> bool:
        if step >= self.steps:
            return True
        if self.box is not None:  # where the round ends: there the ranks arrive together
            return step == self.round_start + self.outer.dl.period
        return step % self.meet_every == 0

    def agree_on_rollback(self, wanted: bool, step: int) -> bool:
        """A rank's wish (its own loss blew up) waits for the next meeting, where any rank's
        wish rolls all of them back."""
        self._rollback_wanted = self._rollback_wanted or wanted
        if not self.meets(step):
            return False
        agreed = any(self.world.allgather(self._rollback_wanted))
        self._rollback_wanted = False
        return agreed

    def after_step(self, engine: Engine, step: int, samples: int, last: bool) -> list[Decision]:
        worked = self._working
        stats, closed = self.outer.after_step(engine, samples if worked else 0, int(worked), last)
        self._round_samples += samples if worked else 0
        events = [self._event(step, s) for s in stats]
        if closed is not None:
            self.state_sync(engine.model_state, self._round_samples)
            self._round_samples = 0
            events.append(self._close_round(step, *closed))
        if self.box is not None:
            self.box.step_done(synced=bool(events))
        return events

    def before_save(self, engine: Engine, step: int) -> list[Decision]:
        if self.box is not None:
            self.box.skip_step()  # a checkpoint is no measure of this rank's pace
        return [self._event(step, s) for s in self.outer.drain(engine)]

    def model_weights(self, engine: Engine) -> dict[str, np.ndarray]:
        return self.outer.anchors()

    def state_dict(self, engine: Engine) -> dict[str, np.ndarray]:
        return self.outer.shared_state() | (self.box.state_dict() if self.box is not None else {})

    def save_rank_state(self, root: Path, step: int, engine: Engine, keep: int) -> None:
        save_rank_file(self.world, self.hosts, root, step, self.outer.rank_arrays(engine), keep,
                       engine.get_optimizer_state()[1])

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        """Exact when every rank finds its own file of that step from this same cluster;
        otherwise (fewer hosts, a file lost with its host) from the shared state alone.
        A time-boxed round in progress replays the counts its plan saved, not new timings."""
        if shared is None:  # a fresh run: the round starts from the weights every rank now holds
            self.outer.restore({}, None, engine, optimizer_step)
            if self.box is not None:
                self.box.restart_clock(resume=True)
            self.round_start = 0
            return []
        w = self.world
        own, own_step, why = load_rank_files(w, self.hosts, root, step)
        events = []
        if why:
            events.append(Decision("diloco_resume", f"diloco: resuming from the shared outer state only "
                                   f"({why}); each rank restarts its round from the last synced weights"))
        period = int(own["rank.round"][1]) if own is not None and "rank.round" in own else None
        if self.box is not None:
            replayed = self.box.load_state_dict(shared, period or self.outer.dl.period)
            period = self.box.plan.steps
            if not replayed and w.is_main:
                events.append(Decision("diloco_resume", "diloco: no time-box plan for this many ranks in the "
                                       "checkpoint; every rank trains on every step of this round, the next "
                                       "one is timed"))
        self.outer.restore(shared, own, engine, own_step if own is not None else optimizer_step, period)
        if self.box is None and self.outer.dl.period != self.dist.inner_steps:
            self.outer.dl.set_period(self.dist.inner_steps)  # a time-boxed checkpoint, resumed step-counted
        self.round_start = step - self.outer.dl.round_steps
        return events

    def close(self) -> None:
        self.outer.close()

    def _close_round(self, step: int, ticks: int, inner: int, samples: int) -> Decision:
        """The round's counts (all-gathered under a time box, where the plan of the next one
        is made from them) as a `diloco_round` event; the round's steps start over."""
        started, self.round_start = self.round_start, step
        if self.box is None:
            n = self.world.size
            return Decision("diloco_round", None, dict(
                step=step, round_steps=ticks, inner_steps=[inner] * n, samples=[samples] * n))
        gathered = self.world.allgather(self.box.report(samples, inner))
        done, nxt = self.box.close(gathered, step, ticks)
        self.outer.dl.set_period(nxt.steps)
        counts = [g["inner"] for g in gathered]
        arrived = [g["arrived"] for g in gathered]
        waited = [max(arrived) - a for a in arrived]
        seconds = [g["seconds"] for g in gathered]
        return Decision(
            "diloco_round",
            f"diloco: round {self.box.rounds} (steps {started + 1}-{step}, {self.box.seconds:g}s box): inner steps "
            f"per rank {counts}, {max(seconds):.2f}s; waited up to {max(waited):.2f}s at the sync; next round "
            f"{nxt.steps} steps, inner steps {nxt.inner}",
            dict(step=step, round=self.box.rounds, round_steps=ticks, inner_steps=counts,
                 samples=[g["samples"] for g in gathered], seconds=seconds, waited_s=waited,
                 planned=done.inner, next_round_steps=nxt.steps, next_inner_steps=nxt.inner,
                 pace_s=list(self.box.pace), idle_s=list(self.box.idle), box_s=self.box.seconds))

    def _event(self, step: int, s: OuterStats) -> Decision:
        d = self.dist
        return Decision(
            "outer_sync", f"diloco: step {step}: fragment {s.fragment + 1}/{d.fragments} synced, "
            f"{s.bytes / 1e6:.2f} MB in {s.seconds:.2f}s; pseudo-gradient norm {s.pseudo_grad_norm:.4g}; "
            f"{s.inner_steps} inner steps, {s.samples} of {s.total_samples} samples here",
            dict(step=step, fragment=s.fragment, seconds=s.seconds, bytes=s.bytes,
                 pseudo_grad_norm=s.pseudo_grad_norm, inner_steps=s.inner_steps, samples=s.samples,
                 total_samples=s.total_samples, prepare_s=s.prepare_seconds, outer_s=s.outer_seconds,
                 main_s=s.main_seconds, wait_s=s.wait_seconds))


class OuterSync:
    """Between the engine's weights (by name) and DiLoCo's flat parameter list."""

    def __init__(self, cfg: DistConfig, wire: str, weights: dict[str, np.ndarray], transport: Transport):
        self.names = sorted(weights)
        self.dl = DiLoCo([weights[n] for n in self.names], inner_steps=cfg.inner_steps, outer_lr=cfg.outer_lr,
                         outer_momentum=cfg.outer_momentum, wire=wire, fragments=cfg.fragments)
        self.overlap: OverlappedSync | None = None
        if cfg.overlap_steps:
            # The worker thread gets a channel of its own: its messages never meet the loop's.
            channel = transport.channel()
            self.overlap = OverlappedSync(self.dl, allreduce_from_transport(channel), allgather_from_transport(channel),
                                          delay=cfg.overlap_steps, alpha=cfg.overlap_alpha)
        self.allreduce, self.allgather = allreduce_from_transport(transport), allgather_from_transport(transport)
        self._handover: dict[int, float] = {}  # training-thread seconds of a sync in flight, by fragment

    # -- per step ---------------------------------------------------------------------
    def after_step(self, engine, samples: int, inner: int, last: bool
                   ) -> tuple[list[OuterStats], tuple[int, int, int] | None]:
        """Count one step of the round (`inner`: whether this rank trained in it, on
        `samples` samples) and sync what is due. On the last step of the run every fragment
        not yet synced this round syncs too, in-flight ones land, and every rank takes the
        anchors: the run ends on the one model all ranks agree on. Also returns, when this
        step closed the round, its steps and this rank's inner steps and samples in it."""
        due = self.dl.advance(samples, inner)
        if last and self.dl.round_steps:
            due = list(range(self.dl.cursor, self.dl.fragments))
        closed = ((self.dl.round_steps, self.dl.inner[-1], self.dl.samples[-1])
                  if self.dl.fragments - 1 in due else None)
        if self.overlap is None:
            stats = self._blocking(engine, due)
        else:
            self.overlap.step()
            t0 = time.perf_counter()
            weights = engine.get_weights() if due else None
            for k in due:
                self.overlap.submit(k, self._fragment(weights, k))
            for k in due:
                self._handover[k] = (time.perf_counter() - t0) / len(due)
            stats = self._land(engine, drain=last)
        if last:  # what is evaluated, saved and exported is the model the ranks agree on
            engine.set_weights(self.anchors())
        return stats, closed

    def drain(self, engine) -> list[OuterStats]:
        """Land every sync in flight (before a checkpoint: its state must be whole)."""
        return self._land(engine, drain=True) if self.overlap is not None else []

    def _blocking(self, engine, due: list[int]) -> list[OuterStats]:
        if not due:
            return []
        t0 = time.perf_counter()
        weights, stats = engine.get_weights(), []
        for k in due:
            new = self.dl.outer_step(k, self._fragment(weights, k), self.allreduce, self.allgather)
            self._put(weights, k, new)
            stats.append(self.dl.last)
        engine.set_weights(weights)
        for s in stats:
            s.main_seconds = (time.perf_counter() - t0) / len(stats)
        return stats

    def _land(self, engine, drain: bool) -> list[OuterStats]:
        t0 = time.perf_counter()
        current: dict[str, np.ndarray] = {}

        def fetch(idx: list[int]) -> list[np.ndarray]:
            if not current:
                current.update(engine.get_weights())
            return [current[self.names[i]] for i in idx]

        landed = self.overlap.ready(fetch, drain=drain)
        if not landed:
            return []
        weights = current or engine.get_weights()
        for k, new, _ in landed:
            self._put(weights, k, new)
        engine.set_weights(weights)
        for k, _, s in landed:
            s.main_seconds = self._handover.pop(k, 0.0) + (time.perf_counter() - t0) / len(landed)
        return [s for _, _, s in landed]

    def _fragment(self, weights: dict[str, np.ndarray], k: int) -> list[np.ndarray]:
        return [weights[self.names[i]] for i in self.dl.fragment_params(k)]

    def _put(self, weights: dict[str, np.ndarray], k: int, new: list[np.ndarray]) -> None:
        for i, w in zip(self.dl.fragment_params(k), new, strict=True):
            weights[self.names[i]] = np.asarray(w, np.float32).reshape(weights[self.names[i]].shape)

    # -- checkpoints ------------------------------------------------------------------
    def anchors(self) -> dict[str, np.ndarray]:
        """The model every rank agrees on (at the last sync of each fragment): what a
        checkpoint calls the model's weights."""
        return dict(zip(self.names, self.dl.anchor_weights(), strict=True))

    def shared_state(self) -> dict[str, np.ndarray]:
        """Outer momentum and cursor, for the run's checkpoint (anchors travel as its weights)."""
        return {k: v for k, v in self.dl.state_dict().items()
                if k.startswith("global.") and not k.startswith("global.anchor.")}

    def rank_arrays(self, engine) -> dict[str, np.ndarray]:
        """This rank's own: local weights (`weights.<param>`), DiLoCo's `rank.*` and, under the
        rest of the names, the optimizer's state as the engine gives it (whatever its
        `state_names`, or a task's own optimizer's)."""
        opt, _ = engine.get_optimizer_state()
        own = {k: v for k, v in self.dl.state_dict().items() if k.startswith("rank.")}
        clash = [k for k in opt if k.startswith(("weights.", "rank."))]
        if clash:
            raise ValueError(f"diloco: the optimizer's state names {clash[0]!r} as this rank's file names its "
                             "weights or round; rename the optimizer's state")
        return {**{f"weights.{k}": v for k, v in engine.get_weights().items()}, **opt, **own}

    def restore(self, shared: dict[str, np.ndarray], own: dict[str, np.ndarray] | None, engine,
                optimizer_step: int, period: int | None = None) -> None:
        """After the loop made the engine hold the checkpoint's weights (the anchors) on every
        rank: take the shared state, and with `own` (this rank's file; every rank must have
        one) its local weights, moments and round position. Without it the round restarts
        from the anchors: local progress since the last sync is dropped. `period`: the
        round's length in steps when the shared state decides it (a time box's plan)."""
        if self.overlap is not None:
            self.overlap.forget()  # a rollback: what was in flight belongs to the abandoned steps
        if period is not None:
            self.dl.period, self.dl.next_period = period, None
        state = dict(shared)
        weights = engine.get_weights()
        state.update({f"global.anchor.{i}": weights[n] for i, n in enumerate(self.names)})
        if not state.keys() & {"global.cursor"}:  # a DDP checkpoint: start the outer loop from its weights
            state["global.cursor"] = np.array([0, self.dl.fragments], np.int64)
        if own is not None:
            state.update({k: v for k, v in own.items() if k.startswith("rank.")})
        self.dl.load_state_dict(state, rank_state=own is not None)
        if own is not None:
            engine.set_weights({k[len("weights."):]: v for k, v in own.items() if k.startswith("weights.")})
            engine.set_optimizer_state({k: v for k, v in own.items() if not k.startswith(("weights.", "rank."))},
                                       optimizer_step)

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()


def describe(cfg: DistConfig) -> str:
    lag = f", overlapped {cfg.overlap_steps} steps" if cfg.overlap_steps else ""
    rounds = (f"time box {cfg.sync_every_s:g}s per round (the first {cfg.inner_steps} steps, then as many as "
              "each rank fits)" if cfg.sync_every_s else f"{cfg.inner_steps} inner steps")
    return (f"DiLoCo: {rounds}, outer lr {cfg.outer_lr} Nesterov {cfg.outer_momentum}, "
            f"wire {cfg.outer_wire}, {cfg.fragments} fragment(s){lag}")
