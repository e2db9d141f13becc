"""What a run decides at start, once, for one rank: the `RunPlan`.

The config says what the user asked for and is never written; the plan says what the run
resolved from it and from the facts every rank reported (its host, its memory limit, the
model's size): each rank's micro-batch and memory budget, the shard mode (`dist.shard=auto`
resolved) and each rank's shard, the vocabulary, the wire formats. Every rank builds the same
plan from the same all-gathered numbers, so components that read it agree without asking again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import Config, NodeConfig
from .split import shard_bounds

SHARDED = ("optimizer", "gradients", "weights")


@dataclass(frozen=True)
class RunPlan:
    """One rank's view of the run's start-up decisions (all but `rank` alike on every rank)."""

    rank: int
    hosts: tuple[str, ...]  # one per rank, in rank order
    micro_batches: tuple[int, ...]  # each rank's first micro-batch (`nodes:`, else train.batch_size)
    memory_targets: tuple[float, ...]  # each rank's memory_target (`nodes:`, else control.memory_target)
    memory_limits: tuple[int, ...]  # bytes each rank's engine measures against (0: unknown)
    shard: str  # dist.shard as the run trains: none, optimizer, gradients or weights (auto resolved)
    shard_bounds: tuple[tuple[int, int], ...]  # [a, b) of each rank's shard of the trained elements; () unsharded
    vocab_size: int | None  # the built-in LM's (a pretrained base's own); None for a task
    wire_dtype: str  # data parallel's and the shards' gradient wire (dist.wire_dtype)
    outer_wire: str  # DiLoCo's pseudo-gradient wire (dist.outer_wire)
    notes: tuple[str, ...] = ()  # what the start-up banner says of the shard choice and the memory plan
    speeds: tuple[float, ...] = ()  # each rank's relative compute speed (`nodes:` speed; a pipeline's cut reads it)
    stage_costs: tuple[float, ...] = ()  # each model stage's share of a forward pass, measured at start (a pipeline's)

    @property
    def micro_batch(self) -> int:
        return self.micro_batches[self.rank]

    @property
    def memory_target(self) -> float:
        return self.memory_targets[self.rank]

    @property
    def budgets(self) -> list[float]:
        """Each rank's bytes to plan for: its memory limit x its memory_target."""
        return [float(m) * t for m, t in zip(self.memory_limits, self.memory_targets, strict=True)]


def rank_nodes(cfg: Config, hosts: list[str]) -> list[NodeConfig]:
    """Each rank's `nodes:` settings, fallbacks filled in (`Config.node_for`)."""
    return [cfg.node_for(host, rank) for rank, host in enumerate(hosts)]


def build_run_plan(cfg: Config, rank: int, nodes: list[NodeConfig], hosts: list[str], memory_limits: list[int], *,
                   shard: str, n_trained: int, vocab_size: int | None, notes: Sequence[str] = ()) -> RunPlan:
    """The plan from the config and the gathered facts: `shard` as resolved
    (`sync/shard_plan.resolve_shard`), `n_trained` elements split by `split.shard_bounds`."""
    plan = RunPlan(rank, tuple(hosts), tuple(n.batch_size for n in nodes),
                   tuple(float(n.memory_target) for n in nodes), tuple(int(m) for m in memory_limits), shard, (),
                   vocab_size, cfg.dist.wire_dtype, cfg.dist.outer_wire, tuple(notes),
                   tuple(float(n.speed) for n in nodes))
    if shard not in SHARDED:
        return plan
    bounds = shard_bounds(n_trained, plan.budgets, cfg.dist.shard_split)
    return replace(plan, shard_bounds=tuple(bounds))
