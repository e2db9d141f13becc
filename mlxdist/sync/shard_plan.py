"""Which `dist.shard` a run trains with, and whether it fits: decided at start, before the
sharded strategy (`sharded.py`) is built, from every rank's memory limit."""

from __future__ import annotations

from ..cluster.world import World
from ..config import Config
from ..engine.base import Engine
from ..engine.registry import engine_spec


def resolve_shard(cfg: Config, world: World, engine: Engine, hosts: list[str], limits: list[int],
                  builtin_lm: bool) -> tuple[str, list[str]]:
    """With `dist.shard` set: every rank's bytes under each mode against its budget
    (`control/memory_plan.py`, the table `python -m mlxdist.plan` prints); `auto` becomes the
    least sharding that fits every rank, and a run that fits nowhere stops before step 1 with
    one line. Every rank decides alike from the gathered limits (`limits`, one per rank).
    Returns the mode the run trains with (for the run plan) and the banner lines.

    `dist.shard=none` (data parallel) is checked too: where its plan does not fit a rank, one
    warning line says so and what to set, and the run goes on (the plan is an estimate).
    A strategy that is not data parallel sharded or not (DiLoCo: each rank its own model and outer
    state, another plan; it declares itself not `shardable`) and a rank whose limit is unknown (0)
    are not checked."""
    from ..control.memory_plan import lm_facts, plan
    from .strategy import memory_lines, mode_strategy

    n_params = int(sum(engine.gradient_sizes()))
    shardable = mode_strategy(cfg).shardable
    if cfg.dist.shard == "none" and (not shardable or min(limits) <= 0 or n_params < 1):
        return "none", []
    facts = lm_facts(cfg) if builtin_lm else None
    mp = plan(cfg, list(zip(hosts, limits, strict=True)), n_params,
              facts.activation_bytes_per_sample if facts else None, memory=memory_lines(),
              gather_params=facts.gather_params if facts else 0,
              staged_act_per_sample=facts.staged_activation_bytes_per_sample if facts else None,
              shardable=shardable)
    spec = engine_spec(engine.name)  # which modes it shards (engine/registry.py)
    if cfg.dist.shard == "none":
        line = mp.unsharded_warning(can_shard=spec.shards, auto=spec.auto_shard)
        return "none", [line] if line else []
    if cfg.dist.shard != "auto":
        return cfg.dist.shard, mp.banner_lines()
    if mp.choice is None:
        raise world.agreed_error(mp.no_fit_line())
    built = ("none", "optimizer", "gradients") if spec.auto_shard else ("none",)
    if spec.auto_shard and engine.capabilities.staged and cfg.finetune.method == "full":
        built += ("weights",)  # ZeRO-3 runs a model with stages (models/stages.py), trained in full
    if mp.choice not in built:
        raise world.agreed_error(f"{mp.choice_line()}; this model cannot run it (the {engine.name} engine shards "
                                 f"{' or '.join(built[1:]) or 'nothing yet'} here): lower the micro-batches "
                                 "(nodes.HOST.batch_size), data.seq_len or the model, or set "
                                 "model.grad_checkpoint_every")
    return mp.choice, mp.banner_lines()


def optimizer_state_bytes(engine: Engine, sync, rank: int) -> int | None:
    """Optimizer state (fp32: AdamW 8 bytes a trained parameter, Lion 4) this rank holds: its
    shard's under `dist.shard` (the strategy's `optimizer_state_bytes`), else all of it (data
    parallel, DiLoCo's inner optimizer, one rank). None for a task's own optimizer: its state is
    the task's."""
    if engine.capabilities.own_optimizer:
        return None
    return int(sync.optimizer_state_bytes(engine, rank))
