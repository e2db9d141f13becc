"""The training loop: one for every engine, sync strategy and number of ranks.

Read `Trainer.run` top to bottom: it is the algorithm, a list of named phases. Each
component owns its state and its cadence (`Checkpointer.due`, `Evaluator.due`,
`Strategy.meets`); decisions every rank must share (stop, re-plan, rollback) are taken
from all-gathered numbers, so all ranks take them at the same step. The loop never asks
which engine or strategy it holds.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from ..cluster.awake import hold_awake
from ..cluster.drift import SelfCheck, drift_verdict
from ..cluster.world import World, resolve_backend
from ..config import Config, ConfigError, NodeConfig
from ..control import BatchSizeError, StepPlan, replan
from ..control.controllers import Controllers
from ..control.run_plan import RunPlan, build_run_plan, rank_nodes
from ..control.step_plan import Decision
from ..data import GlobalSampler
from ..data.batch import BatchMaker
from ..data.feed import StepFeed
from ..engine import make_engine
from ..engine.base import Engine, StepStats, set_model
from ..engine.memory import MemoryReading
from ..markers import RestartCounts, announce_complete
from ..models.build import lm_vocab_size
from ..state import checkpoint as ckpt
from ..state import run_lock
from ..state.checkpointer import (
    RUN_OUTPUTS,
    Checkpointer,
    claim_for_resume,
    describe,
    newest_whole,
    others_in,
    remove_interrupted_saves,
    remove_run,
)
from ..sync.batchnorm import install_sync_batchnorm
from ..sync.shard_plan import optimizer_state_bytes, resolve_shard
from ..sync.strategy import Strategy, make_strategy, mode_strategy, share_state
from ..tasks import Batch, Task
from ..tasks.fingerprint import check_same, fingerprint
from ..tasks.load import check_keys_apply, resolve_task
from ..telemetry.events import EventLog, Progress
from ..telemetry.metrics import Metrics
from ..telemetry.reporter import Log, Reporter
from ..telemetry.trackers import start_trackers
from . import faults
from .ema import EMA
from .evaluation import Evaluator
from .hooks import HookError, Hooks
from .next_steps import next_line, spelling
from .speed_probe import measure_speeds
from .states import ClusterInfo, ModelState, TaskState
from .wiring import make_data_plane, make_reducer, make_world


class Trainer:
    """Wires the components of one run together and runs the loop."""

    def __init__(self, cfg: Config, engine_name: str = "mlx", device: str = "auto", task: Task | None = None):
        """`task`: what `mlxdist.fit` was given; None: the config's (`task.factory` or the built-in LM).
        The ranks, then the run folder's lock, held until `run` ends (or the start fails)."""
        self.cfg = cfg
        self.world: World = make_world(engine_name, cfg, device)
        w = self.world
        self.run_dir = self._run_folder()
        run_id = w.bcast(ckpt.new_run_id() if w.is_main else None)
        self._lock, lock_notes = self._lock_run_dir(run_id)  # one run per folder, before anything else there
        try:
            self._start(run_id, lock_notes, task, engine_name, device)
        except BaseException:
            self.release()
            raise

    def _start(self, run_id: str, lock_notes: list[str], task: Task | None, engine_name: str, device: str) -> None:
        """The start, in order: the run folder; reporting; the task and its model on every rank;
        the run plan (what this run decides once, `self.run_plan`); then the parts that read it:
        the strategy, the data, the controllers, the checkpoints."""
        cfg, w = self.cfg, self.world
        claim_notes = lock_notes + self._claim_run_dir(run_id)  # before anything is written there
        self._start_rank()
        metrics, progress = self._start_reporting(claim_notes)
        self.hosts = w.allgather(w.host)
        nodes = self._rank_nodes()
        self.state = ckpt.RunState(run_id=run_id)
        self.task = self._resolve_task(task)
        progress.unit = self.task.unit
        self.engine: Engine = faults.wrap(make_engine(engine_name, cfg, device, self.task, w.local_rank,
                                                      nodes[w.rank].batch_size), w.rank, lambda: self.state.step)
        self._check_same_base()
        self.run_plan = self._make_run_plan(nodes)
        self.transport = t = make_data_plane(engine_name, cfg, w)  # the data plane, every collective
        reducer = make_reducer(engine_name, cfg, t, self.run_plan.wire_dtype)
        self.sync: Strategy = make_strategy(cfg, w, self.engine, reducer, self.run_plan, t)
        held = optimizer_state_bytes(self.engine, self.sync, w.rank)
        if held is not None:
            metrics.optimizer_state.set(held)
        self.evaluator = Evaluator(self.task, cfg.train, w)
        self.feed = self._make_feed()
        self._units = 0
        notes = self._make_controllers()
        self._make_state_parts()
        self.stop_reason: str | None = None
        self._gave_up = False  # this rank's updates were skipped control.max_nonfinite_steps times in a row
        self.self_check = SelfCheck(cfg.dist.sync_weights_every if self.sync.drift_check else 0)
        self._drift_restored_to: int | None = None
        self._announce(metrics, notes)

    # ------------------------------------------------------------------ start-up
    def _run_folder(self) -> Path:
        """`train.out_dir`, refused by every rank alike when no folder can have that name."""
        try:
            return run_lock.check_out_dir(self.cfg.train.out_dir)
        except ConfigError as e:
            raise self.world.agreed_error(str(e)) from None

    def _lock_run_dir(self, run_id: str) -> tuple[run_lock.RunLock | None, list[str]]:
        """The run folder's lock (`state/run_lock.py`): rank 0's first, then that of the first
        rank on every other host, on its own disk (replicas, rank state and logs go there; on a
        shared disk it finds rank 0's, which is this run's). Every rank learns every refusal and
        all stop together, so a refused start neither hangs nor leaves a lock behind."""
        w = self.world
        restarted = RestartCounts.from_env().restarts > 0
        lock, notes, refused = None, [], None
        if w.is_main:
            try:
                lock, notes = run_lock.take(self.run_dir, run_id, restarted=restarted)
            except ConfigError as e:
                refused = str(e)
        main_host, refused = w.bcast((w.host, refused))
        refusals = [refused] if refused else []
        if not refusals:
            if w.local_rank == 0 and not w.is_main and w.host != main_host:
                try:
                    lock, notes = run_lock.take(self.run_dir, run_id, restarted=restarted)
                except ConfigError as e:
                    refused = f"{e} (on {w.host})"
            refusals = [r for r in w.allgather(refused) if r]
        if refusals:
            if lock is not None:
                lock.release()
            raise w.agreed_error(refusals[0])
        return lock, notes

    def release(self) -> None:
        """The run folder is free again: on every way out of the run."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def _start_rank(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.world.install_signal_handlers()
        hold_awake(os.getpid())  # a MacBook that sleeps mid-run stalls the whole cluster
        self.world.start_watchdog(self.cfg.dist.stall_timeout_s)

    def _start_reporting(self, claim_notes: list[str]) -> tuple[Metrics, Progress]:
        cfg, w = self.cfg, self.world
        metrics = Metrics(w.rank, w.host)
        progress = Progress(cfg.train.steps, enabled=w.is_main and cfg.train.progress, every=cfg.train.log_every)
        self.report = Reporter(Log(w.rank, w.label, self.run_dir), EventLog(self.run_dir, w.rank, w.host),
                               metrics, progress, start_trackers(cfg, self.run_dir, w))
        for warning in cfg.warnings if w.is_main else ():
            self.report.say(f"config: {warning}")
        for note in claim_notes:
            self.report.say(note)
        return metrics, progress

    def _rank_nodes(self) -> list[NodeConfig]:
        """Every rank's `nodes:` settings; a host that matches no entry is named once."""
        unmatched = self.cfg.unmatched_nodes_warning(self.hosts)
        if self.world.is_main and unmatched:
            self.report.say(f"config: {unmatched}")
        return rank_nodes(self.cfg, self.hosts)

    def _resolve_task(self, given: Task | None) -> Task:
        """The task every rank trains, checked to be the same one on all of them."""
        cfg, w = self.cfg, self.world
        self._builtin_lm = given is None and not cfg.task.factory
        task = given or resolve_task(cfg, self.report.say if w.is_main else None)
        if not self._builtin_lm:
            check_keys_apply(cfg, task)
        check_same(w.allgather(fingerprint(task, cfg.task.args)), self.hosts, task.name)
        return task

    def _make_run_plan(self, nodes: list[NodeConfig]) -> RunPlan:
        """What this run decides once (`control/run_plan.py`), from the config and what every
        rank reports: its memory limit; `dist.shard=auto` resolved against them."""
        cfg, w, engine = self.cfg, self.world, self.engine
        limits = w.allgather(int(engine.memory.reading().limit))
        shard, lines = resolve_shard(cfg, w, engine, self.hosts, limits, self._builtin_lm)
        vocab = lm_vocab_size(cfg, engine.capabilities.base) if self._builtin_lm else None
        plan = build_run_plan(cfg, w.rank, nodes, self.hosts, limits, shard=shard,
                              n_trained=int(sum(engine.gradient_sizes())), vocab_size=vocab, notes=lines)
        return self._measure(plan, nodes)

    def _measure(self, plan: RunPlan, nodes: list[NodeConfig]) -> RunPlan:
        """What is measured at start on 2+ ranks: the ranks' speeds for a strategy that gives a
        faster rank more work (`training/speed_probe.py`), unless `nodes:` give speeds or
        dist.measure_speed is off; then the strategy's own probe (a pipeline's stage costs)."""
        cfg, w = self.cfg, self.world
        if w.size < 2:
            return plan
        strategy = mode_strategy(cfg)

        def sample():
            return self.task.make_batch(self.task.dataset, [0])

        if strategy.speed_weighted and cfg.dist.measure_speed and all(n.speed == 1.0 for n in nodes):
            speeds, line = measure_speeds(w, self.engine, sample(), self.hosts)
            plan = replace(plan, speeds=tuple(speeds), notes=(*plan.notes, line))
        return strategy.probe(cfg, w, self.engine, sample, plan)

    def _make_feed(self) -> StepFeed:
        data = self.task.dataset
        return StepFeed(BatchMaker(lambda idx: self.task.make_batch(data, idx),
                                   GlobalSampler(len(data), self.cfg.train.seed), self.world.rank),
                        self.cfg.data.prefetch)

    def _make_controllers(self) -> list[str]:
        """The step's split from every rank's micro-batch, and the policies that move it.
        Returns the notes of synchronised BatchNorm (train.sync_batchnorm, torch)."""
        cfg, w, run = self.cfg, self.world, self.run_plan
        plan = StepPlan.initial(list(run.micro_batches), cfg.train.accum, cfg.train.global_batch)
        self.ctl = Controllers.build(cfg, plan, run.micro_batch, run.memory_target, w.size, w.rank, w.allgather)
        return install_sync_batchnorm(cfg, w, self.engine, plan)

    def _make_state_parts(self) -> None:
        """What a checkpoint holds, by part, and who writes it."""
        cfg, w = self.cfg, self.world
        self.checkpoints = Checkpointer(cfg.checkpoint, self.run_dir, host=w.host, rank=w.rank,
                                        local_rank=w.local_rank)
        self.writers = [r for r, writes in enumerate(w.allgather(self.checkpoints.writes)) if writes]
        self.ema = EMA(cfg.train.ema, w) if cfg.train.ema else None
        self.task_state = TaskState(self.task, w) if self.task.state_dict is not None else None
        self.hooks = Hooks(self.task, w)
        self.parts = {"run": self.state, "controllers": self.ctl, "model": ModelState(self.engine, self.sync),
                      "cluster": ClusterInfo(w.size, self.hosts, cfg.to_dict())}
        self.parts |= {name: part for name, part in (("ema", self.ema), ("task", self.task_state)) if part}

    def _announce(self, metrics: Metrics, notes: list[str]) -> None:
        """The metrics endpoint, and the start-up banner with the plan's lines (rank 0)."""
        cfg, w = self.cfg, self.world
        devices = w.allgather(self.engine.device)
        backend = resolve_backend(cfg.dist.backend) if w.size > 1 else "single"
        metrics.set_build(engine=self.engine.name, backend=backend, world_size=str(w.size))
        warning = metrics.serve(cfg.metrics.port + w.local_rank if cfg.metrics.port else 0, cfg.metrics.bind)
        if warning:
            self.report.say(warning)
        if w.is_main:
            self._banner(backend, devices)
        for note in [*self.engine.capabilities.notes, *notes, *(self.run_plan.notes if w.is_main else [])]:
            self.report.say(note)

    @property
    def plan(self) -> StepPlan:
        return self.ctl.plan

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.release()

    def _run(self) -> int:
        self.restore(self.checkpoints.for_resume(self.report.say) if self.world.is_main else None)
        self.feed.restart(self.state.step, self.state.position, self.plan)
        stats = None
        try:
            while self.state.step < self.cfg.train.steps and self.stop_reason is None:
                t_step = time.perf_counter()
                trains = self.sync.trains(self.state.step + 1)  # time-boxed DiLoCo: a slower rank sits some out
                batches = self.feed.get(self.state.step)
                compute_s = self.forward_backward(batches) if trains else 0.0
                lr, stats = self.optimizer_step()
                if self.rolled_back(stats, trains):
                    continue
                self.advance()
                memory = self.adapt(compute_s)
                if self.check_drift():
                    continue
                self.after_step(stats)
                if trains:
                    self.report_step(stats, lr, compute_s, memory, time.perf_counter() - t_step)
                last = self.state.step >= self.cfg.train.steps or self.stop_reason is not None
                if self.evaluator.due(self.state.step, last):
                    last = self.evaluate() or last
                if self.checkpoints.due(self.state.step, last):
                    self.save_checkpoint()
        finally:
            self.feed.close()
        self.finish(stats)
        return 0

    # ------------------------------------------------------------------ phases
    def forward_backward(self, batches: list[Batch]) -> float:
        """This rank's share of the step, in micro-batches, run by the strategy (ZeRO-3: a
        stage at a time, beside its exchanges). Returns the seconds it computed: the phase,
        less what it waited for other ranks (the balancer compares ranks by it). On
        out-of-memory the micro-batch shrinks and the same samples are redone: the share is
        unchanged, so peers simply wait in the exchange, and the new size reaches them at the
        next all-gather. Not under a strategy whose ranks cannot redo alone (ZeRO-3)."""
        self.engine.memory.reset_peak()
        t0 = time.perf_counter()
        while True:
            try:
                waited = self.sync.forward_backward(self.engine, batches)
                self._units = sum(b.count for b in batches)
                return time.perf_counter() - t0 - waited
            except (MemoryError, RuntimeError) as e:
                if not isinstance(e, MemoryError) and not _looks_like_oom(e):
                    raise
                if not self.sync.redo_after_oom:
                    raise RuntimeError(self._no_redo_line(e)) from None
                batches = self._shrink_after_oom(e, batches)

    def _no_redo_line(self, error: BaseException) -> str:
        """Out of memory under a strategy whose ranks cannot redo a step alone (ZeRO-3, a
        pipeline): what ran out, and what the next start can change."""
        shard = self.run_plan.shard
        title = self.sync.title or (f"dist.shard={shard}" if shard != "none" else f"dist.mode={self.cfg.dist.mode}")
        return (f"{self.world.label}: out of memory in step {self.state.step + 1} ({str(error).strip() or 'MemoryError'}); "
                f"{title} cannot redo a step smaller on one rank: lower this host's micro-batch (train.batch_size or "
                f"nodes: batch_size) or its control.memory_target, then --resume auto (the last checkpoint is kept)")

    def optimizer_step(self) -> tuple[float, StepStats]:
        """The sync strategy's exchange and the update (data parallel: every rank sees the same
        loss and norm; DiLoCo's inner steps: each its own)."""
        lr = self.ctl.schedule(self.state.step, self.state.lr_scale * self.state.plateau_scale)
        stats = self.sync.step(self.engine, lr)
        if self.self_check.due(self.state.step + 1):  # before anything else can touch the weights
            self.self_check.remember(self.state.step + 1, self.engine.weight_checksum())
        return lr, stats

    def rolled_back(self, stats: StepStats, trained: bool = True) -> bool:
        """Health check of the step; after too many bad steps in a row, go back to the last
        checkpoint with a lower learning rate. True when it did. A step this rank sat out or
        that had nothing to learn is not judged, but the rank still takes part in agreeing."""
        wanted = False
        if trained and stats.skipped and stats.tokens == 0:
            self.report.emit("empty_step", f"step {self.state.step}: {stats.why_skipped}; update skipped",
                             step=self.state.step)
        elif trained:
            verdict = self.ctl.health.observe(self.state.step, stats.loss, stats.grad_norm)
            for warning in verdict.warnings:
                self.report.say(f"health: {warning}")
            if stats.skipped:
                self.report.emit("skipped", f"step {self.state.step}: {stats.why_skipped}; update skipped "
                                 f"({self.ctl.health.nonfinite_total} so far)", step=self.state.step)
            self._gave_up = self._gave_up or verdict.give_up  # held until the ranks next meet (DiLoCo: later)
            wanted = verdict.rollback
        if not self.sync.agree_on_rollback(wanted, self.state.step + 1):
            return False
        before = self.state.lr_scale
        latest = self.checkpoints.latest(self.report.say) if self.world.is_main else None
        if self.world.bcast(latest is not None):
            self.restore(latest, rolling_back=True)
            where = f"back to step {self.state.step}"
        else:
            where = "no checkpoint yet, weights kept"
        # Compounds across rollbacks to the same checkpoint, so a repeating blow-up meets an
        # ever lower learning rate instead of looping forever.
        self.state.lr_scale = min(self.state.lr_scale, before) * self.cfg.control.rollback_lr_scale
        self.report.emit("rollback", f"rollback: {self.cfg.control.max_bad_steps} bad steps in a row; {where}, "
                         f"learning rate x{self.state.lr_scale:g}", step=self.state.step,
                         lr_scale=self.state.lr_scale)
        self.feed.restart(self.state.step, self.state.position, self.plan)
        return True

    def advance(self) -> None:
        self.state.step += 1
        self.state.position += self.plan.global_batch

    def adapt(self, compute_s: float) -> MemoryReading:
        """Memory -> this rank's micro-batch; all-gathered numbers -> the cluster's plan and
        whether to stop. Every rank decides the same from the same gathered list."""
        memory = self.engine.memory.reading()
        if self.cfg.control.adapt_batch:
            d = self.ctl.batch.observe(memory.peak, memory.limit)
            if d is not None:
                self.report.emit("memory", f"batch: rank {self.world.rank}: {d.reason}; micro-batch {d.old} -> {d.new}",
                                 step=self.state.step, old=d.old, new=d.new,
                                 action="shrink" if d.new < d.old else "grow")
        every = self.cfg.control.clear_cache_every
        if every and self.state.step % every == 0:
            self.engine.memory.clear_cache()
        if not self.sync.meets(self.state.step):
            return memory
        gathered = self.world.allgather({"samples": self.plan.shares[self.world.rank], "compute_s": compute_s,
                                         "micro": self.ctl.batch.batch, "stop": self.world.stop_requested,
                                         "gave_up": self._gave_up})
        gave_up = [r for r, g in enumerate(gathered) if g["gave_up"]]
        if gave_up:
            self._stop_nonfinite(gave_up)
        if any(g["stop"] for g in gathered):
            self.stop_reason = "signal"
        balancer = self.ctl.balancer if self.cfg.control.balance and self.world.size > 1 else None
        plan, decisions = replan(self.plan, gathered, self.state.step, balancer, self.ctl.accum)
        self._report(decisions)
        if decisions:
            self.ctl.plan = plan
            self.feed.restart(self.state.step, self.state.position, self.plan)
        return memory

    def check_drift(self) -> bool:
        """Every `dist.sync_weights_every` steps (where the strategy keeps ranks identical):
        all-gather weight checksums and self-checks; where ranks differ, repair from the rank
        `drift_verdict` trusts (the majority, or the one that passed its own check), else from
        the latest checkpoint (DESIGN promise 3). True when it went back to a checkpoint (the
        step is then redone)."""
        if not self.self_check.due(self.state.step):
            return False
        step, mine = self.state.step, self.engine.weight_checksum()
        gathered = self.world.allgather((mine, self.self_check.verify(step, mine)))
        verdict = drift_verdict([g[0] for g in gathered], [g[1] for g in gathered], self.hosts)
        if verdict.in_sync:
            return False
        fields = dict(step=step, ranks=verdict.drifted_ranks, source=verdict.source_rank,
                      checkpoint=verdict.restore_from_checkpoint)
        if verdict.restore_from_checkpoint:
            latest = self.checkpoints.latest(self.report.say) if self.world.is_main else None
            found = self.world.bcast(latest.meta.run.step if latest is not None else None)
            if found is not None and found != self._drift_restored_to:
                self.report.emit("drift_repair", f"drift: step {step}: {verdict.message} (step {found})", **fields)
                self.restore(latest, rolling_back=True)
                self._drift_restored_to = found
                self.feed.restart(self.state.step, self.state.position, self.plan)
                return True
            why = "none saved yet" if found is None else "it drifted again since"
            share_state(self.world, self.engine, verdict.source_rank)
            self.report.emit("drift_repair", f"drift: step {step}: {verdict.message}: {why}, so continuing from "
                             f"rank {verdict.source_rank}'s weights", **fields)
            return False
        share_state(self.world, self.engine, verdict.source_rank)
        self.report.emit("drift_repair", f"drift: step {step}: {verdict.message}", **fields)
        return False

    def after_step(self, stats: StepStats) -> None:
        """Whatever the sync strategy has due after an update (DiLoCo: outer syncs; all of them
        when the run reaches train.steps, so it ends on one model), then the weights' average."""
        ended = self.state.step >= self.cfg.train.steps
        self._report(self.sync.after_step(self.engine, self.state.step, self.plan.shares[self.world.rank], ended))
        if self.ema is not None and not stats.skipped:
            self.ema.update(self.engine)

    def report_step(self, stats: StepStats, lr: float, compute_s: float, memory: MemoryReading,
                    step_s: float) -> None:
        rank, plan = self.world.rank, self.plan
        samples = plan.shares[rank]
        cluster_units = self._units * plan.global_batch / max(samples, 1) if stats.local else stats.tokens
        units = dict(unit=self.task.unit, units=self._units, units_per_s=self._units / max(step_s, 1e-9),
                     cluster_units_per_s=cluster_units / max(step_s, 1e-9))
        if self.task.unit == "tokens":
            units |= dict(tokens=units["units"], tokens_per_s=units["units_per_s"],
                          cluster_tokens_per_s=units["cluster_units_per_s"])
        self.report.emit(
            "step", step=self.state.step, loss=stats.loss, lr=lr, grad_norm=stats.grad_norm, step_s=step_s,
            compute_s=compute_s, sync_s=stats.sync_seconds, sync_bytes=stats.sync_bytes,
            sync_overlapped=stats.sync_overlapped,
            data_wait_s=self.feed.take_wait_seconds(), shares=plan.shares, micro=plan.micro,
            micro_batch=plan.micro[rank], accum=plan.accumulation(rank), samples=samples,
            global_batch=plan.global_batch, position=self.state.position, skipped=stats.skipped,
            memory_active_bytes=memory.active, memory_peak_bytes=memory.peak, memory_limit_bytes=memory.limit,
            metrics=stats.metrics, **units)
        self.report.progress.update(self.state.step, stats.loss, units["cluster_units_per_s"], metrics=stats.metrics)

    def evaluate(self) -> bool:
        """Held-out loss, then the policies that read it. True when early stopping says stop."""
        s = self.state
        try:
            with self.ema.applied(self.engine) if self.ema else nullcontext():
                s.eval_loss, metrics = self.evaluator.run(self.engine, self.plan.micro[self.world.rank], self.sync)
                shown = "".join(f", {k} {v:.4g}" for k, v in metrics.items())
                self.report.emit("eval", f"eval: step {s.step}: {'EMA ' if self.ema else ''}loss {s.eval_loss:.4f}"
                                 f"{shown}", step=s.step, eval_loss=s.eval_loss, metrics=metrics, ema=bool(self.ema))
                with self.sync.whole_model(self.engine, [0] if self.hooks.wants("on_eval") else []):
                    self.hooks.call("on_eval", self.engine.model, s.step, {"loss": s.eval_loss} | metrics,
                                    kept=f"a checkpoint of step {s.step} is written before the run stops")
        except HookError:
            self.save_checkpoint()
            raise
        if s.best_eval is None or s.eval_loss < s.best_eval:
            s.best_eval = s.eval_loss
        if self.ctl.plateau is not None:
            scale = self.ctl.plateau.observe(s.eval_loss)
            if scale != s.plateau_scale:
                self.report.emit("plateau", f"plateau: eval loss flat for {self.cfg.control.plateau_patience} evals; "
                                 f"learning rate x{scale:g}", step=s.step, scale=scale)
                s.plateau_scale = scale
        if self.ctl.stopper.observe(s.eval_loss):
            self.stop_reason = self.stop_reason or "early stopping"
            return True
        return False

    def save_checkpoint(self) -> None:
        """The writers' copies (ZeRO-3 gathers the whole model there only), then the hook."""
        step = self.state.step
        with self.sync.whole_model(self.engine, self.writers):
            self._report(self.sync.before_save(self.engine, step))
            self.sync.save_rank_state(self.run_dir / "rank_state", step, self.engine, self.cfg.checkpoint.keep_last)
            try:
                written, refused = self.checkpoints.save(step, self.parts), None
            except ckpt.NonFiniteError as e:
                written, refused = None, str(e)
            if written is not None:  # rank 0; with checkpoint.on_every_host each host's first rank too
                for note in written.notes:
                    self.report.say(note)
                self.report.emit("checkpoint", f"checkpoint: {written.path} ({written.seconds:.2f}s)", step=step,
                                 path=str(written.path), seconds=written.seconds)
            # Peers wait here, with a longer stall allowance, rather than in the next step's
            # exchange, where a big model's slow save would look like a dead rank.
            with self.world.watch("waiting for the checkpoint writers", patience=10):
                refusals = [r for r in self.world.allgather(refused) if r]
            if refusals:
                raise self._stopped(f"{refusals[0]}; {self._last_finite()}: the weights went non-finite "
                                    "without a non-finite loss (an overflow); resume it with a lower train.lr")
            self.hooks.call("on_checkpoint", self.engine.model, written.path if written else None, step,
                            kept=f"the checkpoint of step {step} was written before it")

    def restore(self, loaded: ckpt.Loaded | None, rolling_back: bool = False) -> None:
        """Rank 0 read the checkpoint (or nothing); every rank ends with rank 0's complete
        state: weights, optimizer moments and update count (a fresh run too: a model
        initialised without a seed differs per rank), run state, controllers, sync state."""
        state = None
        if self.world.is_main and loaded is not None:
            state = loaded.state
            self._check_checkpoint_task(loaded.path, state.get("config", {}).get("task"))
            self._check_checkpoint_base(loaded.path, loaded.meta)
            lacking = set_model(self.engine, loaded.weights)
            if lacking:
                self.report.say(f"{loaded.path} holds no {', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''} "
                                f"(saved before mlxdist kept buffers): {len(lacking)} kept as the model built them")
            self.engine.set_optimizer_state(loaded.optimizer, loaded.meta.optimizer_step)
            self.report.say(f"resumed from {loaded.path} (step {loaded.meta.run.step}, "
                            f"saved by {loaded.meta.world_size} rank(s))")
        share_state(self.world, self.engine, 0)
        self._restore_parts(loaded)
        state = self.world.bcast(state)
        if state is None:
            self.checkpoints.lineage = {self.state.run_id}
            self._report(self.sync.load_state_dict(None, self.run_dir / "rank_state", 0, self.engine, 0))
            return
        meta = ckpt.CheckpointMeta.from_dict(state)
        # A resume carries on the checkpoint's run id; one from before runs had ids keeps this
        # run's new one, and its checkpoints count as this run's (retention, rollback).
        theirs = state.get("run_id")
        self.state.load_state_dict(state | {"run_id": theirs or self.state.run_id})
        if not rolling_back:
            self.checkpoints.lineage = {self.state.run_id} | ({None} if theirs is None else set())
        if meta.global_batch not in (None, self.plan.global_batch):
            self.report.say(f"resume: global batch {meta.global_batch} -> {self.plan.global_batch} (this cluster's "
                            "node batch sizes x train.accum); set train.global_batch to keep it")
        same_cluster = meta.hosts == self.hosts and meta.global_batch == self.plan.global_batch
        self.ctl.load_state_dict(state, same_cluster=same_cluster, rolling_back=rolling_back)
        shared = self.world.bcast(loaded.sync if self.world.is_main else None)
        self._report(self.sync.load_state_dict(shared, self.run_dir / "rank_state", meta.run.step, self.engine,
                                               meta.optimizer_step))

    def _restore_parts(self, loaded: ckpt.Loaded | None) -> None:
        """The optional parts (the weights' average, the task's carried state) from rank 0's
        read of the checkpoint, or afresh."""
        extra = loaded.extra if loaded is not None else None
        notes = [self.ema.start(self.engine, None if extra is None else extra.get("ema", {})) if self.ema else None,
                 self.task_state.load(None if extra is None else extra.get("task", {})) if self.task_state else None]
        for note in notes:
            if note and self.world.is_main:
                self.report.say(note)

    def finish(self, stats: StepStats | None) -> None:
        s = self.state
        if self.world.is_main:
            adapters = self.engine.capabilities.adapters  # `engine.base.Adapters`
            adapter = self.engine.save_adapter(self.run_dir / "adapter") if adapters else None
            if adapter is not None:
                self.report.say(f"adapter: {adapter} (PEFT layout; `python -m mlxdist.generate --model "
                                f"{self.cfg.model.path} --adapter-path {adapter}`)")
        if self.stop_reason == "signal":
            self.report.say(f"stopped by signal after step {s.step}; continue with --resume auto")
        elif self.stop_reason:
            self.report.say(f"stopped after step {s.step}: {self.stop_reason}")
        if self.world.is_main:
            self.report.say(f"done: step {s.step}, last loss {stats.loss:.4f}" if stats else f"done: step {s.step}")
            self.report.say(next_line(self.cfg, world_size=self.world.size, builtin_lm=self._builtin_lm,
                                      stopped_by_signal=self.stop_reason == "signal"))
        self.sync.close()
        self.report.progress.close()
        self.report.emit("end", step=s.step, reason=self.stop_reason or "completed")
        self.report.close()
        if self.world.is_main:  # last line: launch/mlxrun exits 0 only after it
            announce_complete(s.step, self.stop_reason or "completed")

    # ------------------------------------------------------------------ helpers
    def _claim_run_dir(self, run_id: str) -> list[str]:
        """Lines to say once the log is open. A run that
        continues none of the checkpoints in train.out_dir (a fresh one, or --resume PATH of
        another run) would mix with them: retention would keep the other run's higher steps
        and delete its own newest, and --resume auto, generation and evaluation would read the
        other run. It is refused before it writes anything there, unless checkpoint.overwrite
        asks to delete them (a fresh run only). Every rank looks at its own disk (replicas);
        all decide alike from the gathered lists. An elastic restart skips this: its first job
        already claimed the folder, and the checkpoints there are the same run's. `--resume
        auto` over checkpoints none of which verifies is refused too (`claim_for_resume`): it
        would start over on top of them. Once the folder is this run's, the temporary folders of
        its interrupted saves go."""
        w, cp = self.world, self.cfg.checkpoint
        if RestartCounts.from_env().restarts and cp.resume != "auto":  # the supervisor chose what it resumes
            return self._remove_interrupted_saves()
        if cp.resume == "auto":
            refusals, notes = w.bcast(claim_for_resume(self.run_dir) if w.is_main else None)
            if refusals:
                _, overwrite = spelling()
                err = ConfigError(
                    f"train.out_dir {self.run_dir}: --resume auto found {len(refusals)} checkpoint(s) and none "
                    "verifies, so it will not start over on top of them; nothing was changed:\n  "
                    + "\n  ".join(refusals) + f"\nlook at them, then continue one with --resume PATH (one without "
                    f"a manifest loads; one that fails its sha256 check is damaged), or start afresh with {overwrite} "
                    "(deletes them)")
                err.all_ranks, err.quiet = True, not w.is_main
                raise err
            return (notes if w.is_main else []) + self._remove_interrupted_saves()
        fresh = cp.resume == "none"
        # --resume PATH: checkpoints of PATH's run are its own; those from before run ids cannot
        # be told apart, so only another id counts against it.
        lineage = None if fresh else {w.bcast(ckpt.run_id_of(cp.resume) if w.is_main else None), None}
        found = w.allgather((w.host, [str(p) for p in others_in(self.run_dir, lineage)]))
        where = next((r for r, (_, paths) in enumerate(found) if paths), None)  # rank 0's disk first
        if where is None:
            return self._remove_interrupted_saves()
        host, paths = found[where]
        seen = describe([Path(p) for p in paths], self.run_dir) + (f" on {host}" if where else "")
        if fresh and cp.overwrite:
            self._refuse_linked_outputs()
            removed = remove_run(self.run_dir) if w.local_rank == 0 else []
            w.barrier("removing the previous run's files (--overwrite)")
            return ([f"overwrite: removed the previous run's {', '.join(removed)} from {self.run_dir} "
                             f"({seen})"] if w.is_main and removed else [])
        what = "another run's checkpoints" if fresh else f"checkpoints of a run other than {cp.resume}'s"
        resume, overwrite = spelling()
        ways = (f"continue that run with {resume}, give this one a new train.out_dir, or replace that run "
                f"with {overwrite} (deletes its checkpoints and logs)" if fresh else
                f"give this run a new train.out_dir, or continue the run there with {resume}")
        err = ConfigError(f"train.out_dir {self.run_dir} holds {what} ({seen}); nothing was changed: {ways}")
        err.all_ranks = True  # every rank saw the same gathered lists: all stop, none aborts the others
        err.quiet = not w.is_main  # one line, from rank 0
        raise err

    def _refuse_linked_outputs(self) -> None:
        """`--overwrite` deletes the previous run's folders, never what a link among them points
        at (a `checkpoints/` linked to a bigger disk holds that disk's files): every rank learns
        of a link on any host's disk and all stop, before anything is deleted."""
        w = self.world
        linked = w.allgather((w.host, run_lock.linked_outputs(self.run_dir, RUN_OUTPUTS) if w.local_rank == 0 else []))
        where = next((r for r, (_, links) in enumerate(linked) if links), None)
        if where is None:
            return
        host, links = linked[where]
        name, target = links[0]
        shown = ", ".join(f"{n} -> {t}" for n, t in links)
        raise w.agreed_error(
            f"train.out_dir {self.run_dir}{f' on {host}' if where else ''}: {shown} "
            f"{'is a symbolic link' if len(links) == 1 else 'are symbolic links'}, and --overwrite does not delete "
            f"through a link; nothing was changed: empty {target} yourself (or remove the link: rm "
            f"{self.run_dir / name}) and start again, or give this run another train.out_dir")

    def _remove_interrupted_saves(self) -> list[str]:
        """The temporary folders of this run's saves cut short, gone from every host's disk."""
        w = self.world
        return remove_interrupted_saves(self.run_dir, w.host) if w.local_rank == 0 else []

    def _stop_nonfinite(self, ranks: list[int]) -> None:
        """Every rank, from the same gathered list: no checkpoint of this state is written."""
        who = ", ".join(f"rank {r} ({self.hosts[r]})" for r in ranks)
        k = self.cfg.control.max_nonfinite_steps
        self.report.emit("nonfinite_stop", step=self.state.step, ranks=ranks)
        raise self._stopped(f"step {self.state.step}: {k} updates in a row skipped for a non-finite loss or "
                            f"gradients on {who} (control.max_nonfinite_steps={k}); stopped without writing a "
                            f"checkpoint; {self._last_finite()}: resume it with a lower train.lr, or look at the "
                            f"data near sample position {self.state.position}")

    def _stopped(self, message: str) -> TrainingStopped:
        err = TrainingStopped(message)
        err.quiet = not self.world.is_main
        return err

    def _last_finite(self) -> str:
        latest = newest_whole(self.run_dir, lambda _: None, self.checkpoints.lineage, cached=True) \
            if self.world.is_main else None
        return f"the last checkpoint is {latest}" if latest else "no checkpoint was written before"

    def _report(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if d.fields:
                self.report.emit(d.kind, d.text, **d.fields)
            elif d.text:
                self.report.say(d.text)

    def _check_checkpoint_task(self, path: Path, saved: dict | None) -> None:
        mine = {"factory": self.cfg.task.factory, "args": self.cfg.task.args}
        saved = {"factory": None, "args": {}} | (saved or {})
        if saved != mine:
            raise ConfigError(f"checkpoint {path}: trained task.factory={saved['factory'] or 'none (built-in LM)'} "
                              f"with task.args={saved['args']}, this run has task.factory="
                              f"{mine['factory'] or 'none (built-in LM)'} with {mine['args']}; resume with the same task")

    def _check_checkpoint_base(self, path: Path, meta: ckpt.CheckpointMeta) -> None:
        mine = self.engine.capabilities.base_fingerprint
        if meta.base_fingerprint == mine:
            return
        if self.engine.capabilities.base is None and self.cfg.task.factory:  # a task's frozen weights
            raise ConfigError(f"checkpoint {path}: trained with {meta.base_fingerprint or 'no frozen weights'}, "
                              f"task {self.task.name} now has {mine or 'none'}; resume with the base it was "
                              "trained on (the same files the task loads)")
        if mine is None or meta.base_fingerprint is None:
            raise ConfigError(f"checkpoint {path}: trained on {'no' if meta.base_fingerprint is None else 'a'} "
                              f"pretrained base, but model.path is {self.cfg.model.path or 'unset'}")
        ours = dict(self.engine.capabilities.base.files)
        differ = sorted(f for f in set(ours) | set(meta.base_files) if ours.get(f) != meta.base_files.get(f))
        raise ConfigError(f"checkpoint {path}: its base differs from model.path {self.cfg.model.path}"
                          + (f" in {', '.join(differ)}" if differ else "") + "; resume with the base it was trained on")

    def _check_same_base(self) -> None:
        """Every rank must fine-tune the very same base: a host with another snapshot of the
        model would train something else under the same name."""
        prints = self.world.allgather(self.engine.capabilities.base_fingerprint)
        odd = [f"rank {r} ({self.hosts[r]})" for r, f in enumerate(prints) if f != prints[0]]
        if not odd:
            return
        err = ConfigError(f"task {self.task.name}: the frozen weights on {', '.join(odd)} differ from rank 0's "
                          f"({self.hosts[0]}); copy the same files the task loads (a pretrained checkpoint) to every "
                          "host" if self.engine.capabilities.base is None else
                          f"model.path {self.cfg.model.path}: the base weights on {', '.join(odd)} differ from "
                          f"rank 0's ({self.hosts[0]}); copy the same model directory to every host")
        err.all_ranks = True  # every rank saw the same gathered list: all stop, none aborts the others
        raise err

    def _shrink_after_oom(self, error: BaseException, batches: list[Batch]) -> list[Batch]:
        self.engine.discard_gradients()
        self.engine.memory.clear_cache()
        try:
            d = self.ctl.batch.on_oom()
        except BatchSizeError as stuck:
            raise RuntimeError(f"{self.world.label}: out of memory at the smallest batch size "
                               f"(control.min_batch={self.cfg.control.min_batch}): {stuck}") from None
        self.report.emit("oom", f"oom: step {self.state.step}: {error}; micro-batch {d.old} -> {d.new}, "
                         "retrying the step", step=self.state.step, old=d.old, new=d.new)
        return self.feed.maker.split(np.concatenate([b.indices for b in batches]), d.new)

    def _banner(self, backend: str, devices: list[str]) -> None:
        cfg, w, plan = self.cfg, self.world, self.plan
        say = self.report.say
        say(f"mlxdist: {w.size} rank(s), engine {self.engine.describe()}"
            + (f", dist backend {backend}" if w.size > 1 else ""))
        if w.size > 1:
            say("devices: " + ", ".join(f"rank {r} {d} ({h})" for r, (d, h) in enumerate(zip(devices, self.hosts,
                                                                                              strict=True))))
        strategy = self.sync.describe()
        if strategy:
            say(strategy)
        data = self.task.dataset
        what = self.task.data_summary or f"{len(data)} samples, loss per {self.task.unit.rstrip('s')}"
        say(f"{self.engine.capabilities.model_summary}; data: {what}")
        try:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        except OSError as e:
            raise ConfigError(f"train.out_dir {self.run_dir}: cannot write config.yaml ({e.strerror or e}); "
                              f"{run_lock.what_to_do(e)}") from None
        say(f"plan: global batch {plan.global_batch} = shares {plan.shares} in micro-batches {plan.micro}"
            f" on {', '.join(self.hosts)}; metrics on :{cfg.metrics.port or 'off'}; run dir {self.run_dir}")


class TrainingStopped(RuntimeError):
    """A run that cannot go on (its weights or updates are no longer finite). Every rank
    raises it together, from gathered numbers: nobody aborts the others."""

    all_ranks = True
    quiet = False


def _looks_like_oom(e: Exception) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("out of memory", "outofmemory", "malloc", "failed to allocate"))
