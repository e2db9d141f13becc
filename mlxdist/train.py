"""`python -m mlxdist.train`: the CLI and the training loop.

One loop for every engine and any number of ranks. Read `train()` top to bottom: it is the
algorithm. Decisions every rank must share (stop, rebalance, rollback) are taken from
all-gathered numbers, so all ranks take them at the same step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from .config import Config, ConfigError, load_config
from .control import BatchSizeError, micro_batches
from .controllers import Controllers
from .data import GlobalSampler, Prefetcher, build_datasets
from .engine import make_engine
from .events import EventLog, Progress
from .faults import Faults
from .memory import memory_reading, reset_peak
from .metrics import Metrics
from .models.presets import human, param_count, resolve
from .plan import BatchMaker, StepPlan
from .world import World, init_world, launched_by_mpirun, resolve_backend

# Nothing above imports MLX: `main` may still re-exec the process with OpenBLAS preloaded.

# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mlxdist.train",
        description="Train a transformer on one machine or, under mpirun, on several.",
        epilog="Overrides: dotted keys, e.g. train.lr=3e-4 train.steps=1000 model.preset=small",
    )
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--engine", choices=("mlx", "torch"), default="mlx")
    p.add_argument("--device", default="auto", help="torch engine: auto|cuda|mps|cpu")
    p.add_argument("--resume", help="shortcut for checkpoint.resume=VALUE (auto, none or a checkpoint dir)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    return p.parse_intermixed_args(argv)  # overrides may sit on either side of --options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine == "mlx":
        from .blas import ensure_openblas

        ensure_openblas()
    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return train(cfg, args.engine, args.device)
    except Exception as e:  # noqa: BLE001 - one line for the user, traceback on request
        expected = isinstance(e, (ConfigError, RuntimeError, ValueError, OSError))
        print(f"error: {e}" if expected else f"error: {type(e).__name__}: {e} "
              "(set MLXDIST_DEBUG=1 for the traceback)", file=sys.stderr)
        if os.environ.get("MLXDIST_DEBUG"):
            traceback.print_exc()
        _abort_peers(str(e))
        return 1


def _abort_peers(message: str) -> None:
    """Under mpirun, one rank's fatal error must end every rank, not leave them waiting."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(1)


# --------------------------------------------------------------------------- run state


@dataclass
class RunState:
    """What a checkpoint must hold besides weights for a resume to equal no interruption."""

    step: int = 0
    position: int = 0  # samples of the global stream consumed
    lr_scale: float = 1.0  # lowered by rollbacks
    plateau_scale: float = 1.0  # lowered by reduce-on-plateau
    eval_loss: float | None = None
    best_eval: float | None = None
    controllers: dict = field(default_factory=dict)


class Log:
    """Rank 0 talks to the terminal; other ranks write `logs/rankN.log` (same lines)."""

    def __init__(self, world, run_dir: Path):
        self.world = world
        self.file = None
        if not world.is_main:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            self.file = open(run_dir / "logs" / f"rank{world.rank}.log", "a", buffering=1)
        self.progress = None

    def __call__(self, text: str) -> None:
        if self.file:
            self.file.write(f"[{self.world.label}] {text}\n")
        elif self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the loop


def train(cfg: Config, engine_name: str = "mlx", device: str = "auto") -> int:
    backend = resolve_backend(cfg.dist.backend)
    if engine_name == "torch":
        from .engine.torch_engine import check_single_node

        if launched_by_mpirun():
            check_single_node(int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")), device)
        world = World()
    else:
        world = init_world(backend)
    run_dir = Path(cfg.train.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = Log(world, run_dir)
    world.install_signal_handlers()
    world.start_watchdog(cfg.dist.stall_timeout_s)

    # Model, data, engine
    args = resolve(cfg.model)
    train_set, eval_set = build_datasets(cfg.data, cfg.train.seed, cfg.model.vocab_size)
    sampler = GlobalSampler(len(train_set), cfg.train.seed)
    if engine_name == "mlx":
        from .collective import make_collective

        engine = make_engine("mlx", args, cfg, world=world,
                             collective=make_collective(world, backend, cfg.dist.ring_connections))
    else:
        engine = make_engine("torch", args, cfg, device)
    if world.is_main:
        from .blas import status as blas_status

        log(f"mlxdist: {world.size} rank(s), engine {engine.describe()}"
            + (f", dist backend {backend}" if world.size > 1 else ""))
        if engine_name == "mlx":
            log(blas_status())
        log(f"model: preset {cfg.model.preset}, {human(param_count(args))} parameters "
            f"(dim {args.dim}, {args.n_layers} layers, {args.n_heads}/{args.n_kv_heads} heads); "
            f"data: {cfg.data.source}, {len(train_set)} windows of {cfg.data.seq_len}")

    # Who does how much: per-node micro-batch from `nodes:`, split of every global step
    my_micro = cfg.node_for(world.host, world.rank).batch_size if cfg.nodes else cfg.train.batch_size
    hosts = world.allgather(world.host)
    plan = StepPlan.initial(world.allgather(my_micro), cfg.train.accum, cfg.train.global_batch)
    node = cfg.node_for(world.host, world.rank)
    ctl = Controllers.build(cfg, plan, my_micro, node.memory_target, world.size)
    state = RunState()
    ckpt_dir = run_dir / "checkpoints"

    def restore(loaded: ckpt.Loaded | None, rolling_back: bool = False) -> None:
        """Rank 0 reads the checkpoint; every rank gets its contents by broadcast."""
        nonlocal state
        meta = None
        if world.is_main and loaded is not None:
            engine.set_weights(loaded.weights)
            engine.set_optimizer_state(loaded.optimizer, loaded.state["optimizer_step"])
            meta = loaded.state
            log(f"resumed from {loaded.path} (step {meta['step']}, saved by {meta.get('world_size', 1)} rank(s))")
        meta = world.bcast(meta)
        if meta is not None:
            state = RunState(meta["step"], meta["position"], meta.get("lr_scale", 1.0),
                             meta.get("plateau_scale", 1.0), meta.get("eval_loss"), meta.get("best_eval"),
                             meta.get("controllers", {}))
            if meta.get("global_batch") not in (None, plan.global_batch):
                log(f"resume: global batch {meta['global_batch']} -> {plan.global_batch} (this cluster's "
                    "node batch sizes x train.accum); set train.global_batch to keep it")
            same_cluster = meta.get("hosts") == hosts and meta.get("global_batch") == plan.global_batch
            ctl.load_state_dict(state.controllers, plan, world.rank, same_cluster=same_cluster,
                                rolling_back=rolling_back)
        if engine_name == "mlx":
            engine.broadcast_state(0)

    resume = cfg.checkpoint.resume
    loaded = None
    if world.is_main and resume != "none":
        loaded = ckpt.load_latest(ckpt_dir, warn=log) if resume == "auto" else ckpt.load(resume)
        if loaded is None:
            log(f"resume=auto: no checkpoint in {ckpt_dir}; starting fresh")
    restore(loaded)

    def save_checkpoint() -> None:
        batch_states = world.allgather(ctl.batch.state_dict())
        if world.is_main:
            write_checkpoint(batch_states)
        # Peers wait here, with a longer stall allowance, rather than in the next step's
        # all-reduce, where a big model's slow save would look like a dead rank.
        world.barrier("waiting for rank 0 to write a checkpoint", patience=10)

    def write_checkpoint(batch_states: list[dict]) -> None:
        t0 = time.perf_counter()
        opt, opt_step = engine.get_optimizer_state()
        meta = {"step": state.step, "position": state.position, "lr_scale": state.lr_scale,
                "plateau_scale": state.plateau_scale,
                "eval_loss": state.eval_loss, "best_eval": state.best_eval, "optimizer_step": opt_step,
                "controllers": ctl.state_dict(batch_states, plan), "world_size": world.size, "hosts": hosts,
                "engine": engine_name, "config": cfg.to_dict(), "global_batch": plan.global_batch}
        path = ckpt.save(ckpt_dir, state.step, engine.get_weights(), opt, meta, cfg.checkpoint.zstd_level)
        ckpt.apply_retention(ckpt_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best)
        seconds = time.perf_counter() - t0
        metrics.checkpoint_seconds.observe(seconds)
        events.write("checkpoint", step=state.step, path=str(path), seconds=seconds)
        log(f"checkpoint: {path} ({seconds:.2f}s)")

    # Observability
    metrics = Metrics(world.rank, world.host)
    metrics.set_build(engine=engine_name, backend=backend if world.size > 1 else "single",
                      world_size=str(world.size))
    warning = metrics.serve(cfg.metrics.port + world.local_rank if cfg.metrics.port else 0, cfg.metrics.bind)
    if warning:
        log(warning)
    events = EventLog(run_dir, world.rank, world.host)
    progress = Progress(cfg.train.steps, enabled=world.is_main and cfg.train.progress,
                        every=cfg.train.log_every)
    log.progress = progress
    if world.is_main:
        (run_dir / "config.yaml").write_text(__import__("yaml").safe_dump(cfg.to_dict(), sort_keys=False))
        log(f"plan: global batch {plan.global_batch} = shares {plan.shares} in micro-batches {plan.micro}"
            f" on {', '.join(hosts)}; metrics on :{cfg.metrics.port or 'off'}; run dir {run_dir}")

    make_batches = BatchMaker(train_set, sampler, world.rank)

    def start_prefetch() -> Prefetcher:
        """Batches for steps ahead are made with the plan as it is now; a new plan restarts this."""
        base_step, base_pos = state.step, state.position
        frozen = StepPlan(plan.global_batch, list(plan.shares), list(plan.micro))
        return Prefetcher(lambda s: make_batches(base_pos + (s - base_step) * frozen.global_batch, frozen),
                          start=state.step, depth=cfg.data.prefetch)

    def shrink_after_oom(error: BaseException) -> int:
        try:
            decision = ctl.batch.on_oom()
        except BatchSizeError as stuck:
            raise RuntimeError(f"{world.label}: out of memory at the smallest batch size "
                               f"(control.min_batch={cfg.control.min_batch}): {stuck}") from None
        metrics.decision("batch_size", "oom_shrink")
        log(f"oom: step {state.step}: {error}; micro-batch {decision.old} -> {decision.new}, retrying the step")
        events.write("oom", step=state.step, old=decision.old, new=decision.new)
        return decision.new

    def agree_on_plan(gathered: list) -> bool:
        """Apply micro-batch sizes and balancer shares that every rank computed the same way."""
        changed = False
        micro = [g["micro"] for g in gathered]
        if micro != plan.micro:
            log(f"batch: step {state.step}: micro-batches {plan.micro} -> {micro}")
            events.write("batch_size", step=state.step, old=plan.micro, new=micro)
            plan.micro, changed = micro, True
        if cfg.control.balance and world.size > 1:
            new = ctl.balancer.observe(state.step, [g["samples"] for g in gathered],
                                       [g["compute_s"] for g in gathered])
            if new is not None and new != plan.shares:
                log(f"balance: step {state.step}: shares {plan.shares} -> {new} "
                    f"(rates {[round(r or 0, 1) for r in ctl.balancer.rates]} samples/s)")
                events.write("balance", step=state.step, old=plan.shares, new=new)
                metrics.decision("balancer", "resplit")
                plan.shares, changed = new, True
        if changed:
            accum = ctl.accum.plan(plan.shares, plan.micro)
            events.write("accumulation", step=state.step, accum=accum)
        return changed

    faults = Faults.from_env()
    if faults.compute_scale != 1.0:
        log(f"rig: {world.label} computes x{faults.compute_scale:g} slower (MLXDIST_RIG_COMPUTE_SCALE)")
    prefetch = start_prefetch()
    stop_reason = None
    stats = None
    try:
        while state.step < cfg.train.steps and stop_reason is None:
            # 1. compute this rank's share of the step
            t_step = time.perf_counter()
            batches = prefetch.get(state.step)
            reset_peak(engine_name)
            t_compute = time.perf_counter()
            if faults.take_oom(world.rank, state.step):
                batches = [_InjectedOOM(), *batches]
            run_share(engine, batches, shrink_after_oom)
            faults.stretch_compute(time.perf_counter() - t_compute)  # rig: slower GPU, counted
            compute_s = time.perf_counter() - t_compute
            if faults.take_nan(state.step):
                engine.poison_loss()
            # 2. sync gradients and update (every rank sees the same loss and norm)
            lr = ctl.schedule(state.step, state.lr_scale * state.plateau_scale)
            stats = engine.step(lr)
            verdict = ctl.health.observe(state.step, stats.loss, stats.grad_norm)
            for w in verdict.warnings:
                log(f"health: {w}")
            if stats.skipped:
                metrics.nonfinite.inc()
                log(f"step {state.step}: non-finite loss/gradients; update skipped "
                    f"({ctl.health.nonfinite_total} so far)")
                events.write("skipped", step=state.step)
            if verdict.rollback:
                metrics.rollbacks.inc()
                prefetch.close()
                before = state.lr_scale
                latest = ckpt.load_latest(ckpt_dir, warn=log) if world.is_main else None
                if world.bcast(latest is not None):
                    restore(latest, rolling_back=True)
                    where = f"back to step {state.step}"
                else:
                    where = "no checkpoint yet, weights kept"
                # Compounds across rollbacks to the same checkpoint, so a repeating blow-up
                # meets an ever lower learning rate instead of looping forever.
                state.lr_scale = min(state.lr_scale, before) * cfg.control.rollback_lr_scale
                log(f"rollback: {cfg.control.max_bad_steps} bad steps in a row; {where}, "
                    f"learning rate x{state.lr_scale:g}")
                events.write("rollback", step=state.step, lr_scale=state.lr_scale)
                prefetch = start_prefetch()
                continue
            state.step += 1
            state.position += plan.global_batch
            if faults.drift_now(world.rank, state.step):
                engine.perturb_weights()

            # 3. adapt: memory -> micro-batch, speed -> shares (decided from all-gathered numbers)
            memory = memory_reading(engine_name)
            my_samples = plan.shares[world.rank]
            if cfg.control.adapt_batch:
                decision = ctl.batch.observe(memory.peak, memory.limit)
                if decision is not None:
                    metrics.decision("batch_size", "shrink" if decision.new < decision.old else "grow")
                    log(f"batch: rank {world.rank}: {decision.reason}; micro-batch {decision.old} -> {decision.new}")
            if cfg.control.clear_cache_every and state.step % cfg.control.clear_cache_every == 0:
                engine.clear_cache()
            gathered = world.allgather({"samples": my_samples, "compute_s": compute_s,
                                        "micro": ctl.batch.batch, "stop": world.stop_requested})
            if any(g["stop"] for g in gathered):
                stop_reason = "signal"
            if agree_on_plan(gathered):
                prefetch.close()
                prefetch = start_prefetch()
            every = cfg.dist.sync_weights_every
            if world.size > 1 and every and state.step % every == 0:
                bad = repair_drift(world, engine)
                if bad:
                    log(f"drift: step {state.step}: weights on rank(s) {bad} differ from rank 0; "
                        "repaired by broadcast from rank 0")
                    metrics.drift_repairs.inc()
                    events.write("drift_repair", step=state.step, ranks=bad)

            # 4. report
            step_s = time.perf_counter() - t_step
            data_wait, prefetch.wait_seconds = prefetch.wait_seconds, 0.0
            my_tokens = my_samples * cfg.data.seq_len
            cluster_tok_s = stats.tokens / max(step_s, 1e-9)
            metrics.observe_step(stats, lr=lr, step_s=step_s, samples=my_samples, tokens=my_tokens,
                                 micro=plan.micro[world.rank], accum=plan.accumulation(world.rank),
                                 data_wait=data_wait, memory=memory)
            events.write("step", step=state.step, loss=stats.loss, lr=lr, grad_norm=stats.grad_norm,
                         tokens_per_s=my_tokens / max(step_s, 1e-9), cluster_tokens_per_s=cluster_tok_s,
                         step_s=step_s, compute_s=compute_s, sync_s=stats.sync_seconds,
                         data_wait_s=data_wait, shares=plan.shares, micro=plan.micro,
                         global_batch=plan.global_batch, skipped=stats.skipped,
                         memory_active_bytes=memory.active, memory_peak_bytes=memory.peak,
                         memory_limit_bytes=memory.limit)
            progress.update(state.step, stats.loss, cluster_tok_s)

            # 5. evaluate, stop early, checkpoint
            last = state.step >= cfg.train.steps or stop_reason is not None
            if cfg.train.eval_every and (state.step % cfg.train.eval_every == 0 or last):
                state.eval_loss = evaluate(engine, world, eval_set, cfg.train, plan.micro[world.rank])
                metrics.eval_loss.set(state.eval_loss)
                events.write("eval", step=state.step, eval_loss=state.eval_loss)
                log(f"eval: step {state.step}: loss {state.eval_loss:.4f}")
                if state.best_eval is None or state.eval_loss < state.best_eval:
                    state.best_eval = state.eval_loss
                if ctl.plateau is not None:
                    scale = ctl.plateau.observe(state.eval_loss)
                    if scale != state.plateau_scale:
                        log(f"plateau: eval loss flat for {cfg.control.plateau_patience} evals; "
                            f"learning rate x{scale:g}")
                        metrics.decision("plateau", "reduce_lr")
                        state.plateau_scale = scale
                if ctl.stopper.observe(state.eval_loss):
                    stop_reason = stop_reason or "early stopping"
                    last = True
            every = cfg.checkpoint.every
            if (every and state.step % every == 0) or last:
                save_checkpoint()
    finally:
        prefetch.close()
        progress.close()
    if stop_reason == "signal":
        log(f"stopped by signal after step {state.step}; continue with --resume auto")
    elif stop_reason:
        log(f"stopped after step {state.step}: {stop_reason}")
    if world.is_main:
        log(f"done: step {state.step}, last loss {stats.loss:.4f}" if stats else f"done: step {state.step}")
    events.write("end", step=state.step, reason=stop_reason or "completed")
    events.close()
    return 0


def evaluate(engine, world, eval_set, train_cfg, micro: int) -> float:
    """Mean token loss on the same held-out windows whatever the cluster layout, so evals
    taken before and after a re-split, an OOM shrink, or a resume stay comparable."""
    loss_sum = tokens = 0.0
    b = train_cfg.batch_size
    for i in range(world.rank, train_cfg.eval_batches, world.size):
        idx = [(i * b + j) % len(eval_set) for j in range(b)]
        offset = 0
        for n in micro_batches(b, micro):
            ls, count = engine.eval_loss(eval_set.batch(idx[offset : offset + n]))
            loss_sum, tokens, offset = loss_sum + ls, tokens + count, offset + n
    loss_sum, tokens = world.allreduce_sum([loss_sum, tokens])
    return loss_sum / max(tokens, 1)


class _InjectedOOM:
    """Stands in the batch list to fail the first micro-step (MLXDIST_INJECT_OOM)."""


def run_share(engine, batches: list, shrink) -> None:
    """Forward/backward over this rank's share of the step; on out-of-memory, shrink the
    micro-batch (`shrink(error) -> new size`) and redo the same samples.

    Only this rank retries: its share is unchanged, so the peers simply wait in the
    all-reduce, and the new size reaches them at the next all-gather.
    """
    while True:
        try:
            for batch in batches:
                if isinstance(batch, _InjectedOOM):
                    raise MemoryError("injected out-of-memory (MLXDIST_INJECT_OOM)")
                engine.micro_step(batch)
            return
        except (MemoryError, RuntimeError) as e:
            if not isinstance(e, MemoryError) and not _looks_like_oom(e):
                raise
            engine.discard_gradients()
            engine.clear_cache()
            samples = np.concatenate([b for b in batches if not isinstance(b, _InjectedOOM)])
            sizes = micro_batches(len(samples), shrink(e))
            batches = np.split(samples, np.cumsum(sizes)[:-1])


def repair_drift(world, engine) -> list[int]:
    """All-gather weight checksums; broadcast rank 0's state if any differ. Returns the
    ranks that had drifted (empty when all agree)."""
    from .sync import checksum

    sums = world.allgather(checksum(engine.weight_arrays()))
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        engine.broadcast_state(0)
    return bad


def _looks_like_oom(e: Exception) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("out of memory", "outofmemory", "malloc", "failed to allocate"))


if __name__ == "__main__":
    sys.exit(main())
