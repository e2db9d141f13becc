"""Which `dist.shard` a run trains with, and whether it fits: decided at start, before the
sharded strategy (`sharded.py`) is built, from every rank's memory limit."""

from __future__ import annotations

from ..cluster.world import World
from ..config import Config
from ..engine.base import Engine


def resolve_shard(cfg: Config, world: World, engine: Engine, hosts: list[str], builtin_lm: bool) -> list[str]:
    """With `dist.shard` set: every rank's bytes under each mode against its budget
    (`control/memory_plan.py`, the table `python -m mlxdist.plan` prints); `auto` becomes the
    least sharding that fits every rank, and a run that fits nowhere stops before step 1 with
    one line. Every rank decides alike from the gathered limits. Returns the banner lines."""
    if cfg.dist.shard == "none":
        return []
    from ..control.memory_plan import lm_facts, plan

    facts = lm_facts(cfg) if builtin_lm else None
    limits = world.allgather(int(engine.memory().limit))
    mp = plan(cfg, list(zip(hosts, limits, strict=True)), int(sum(engine.gradient_sizes())),
              facts.activation_bytes_per_sample if facts else None, gather_params=facts.gather_params if facts else 0)
    if cfg.dist.shard == "auto":
        if mp.choice is None:
            raise world.agreed_error(mp.no_fit_line())
        built = ("none", "optimizer", "gradients") if engine.name == "mlx" else ("none",)
        if mp.choice not in built:
            raise world.agreed_error(f"{mp.choice_line()}; that is not there yet (the {engine.name} engine shards "
                                     f"{' or '.join(built[1:]) or 'nothing yet'}): lower the micro-batches "
                                     "(nodes.HOST.batch_size), data.seq_len or the model, or set "
                                     "model.grad_checkpoint_every")
        cfg.dist.shard = mp.choice
    return mp.banner_lines()
