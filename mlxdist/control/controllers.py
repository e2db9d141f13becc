"""The run's decision policies and the step plan they shape, built from the config and
saved/restored as one unit.

Plain Python like the policies themselves: the loop asks them, they never touch arrays.
Their checkpoint state holds every rank's batch-size controller, so saving it gathers
across ranks through the `gather` it is given (the world's all-gather).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import Config
from . import (
    AccumulationController,
    BatchSizeController,
    EarlyStopping,
    HealthMonitor,
    LoadBalancer,
    LRSchedule,
    ReduceOnPlateau,
)
from .step_plan import StepPlan


@dataclass
class Controllers:
    schedule: LRSchedule
    health: HealthMonitor
    plateau: ReduceOnPlateau | None
    stopper: EarlyStopping
    balancer: LoadBalancer
    batch: BatchSizeController  # this rank's micro-batch size
    accum: AccumulationController
    plan: StepPlan  # the cluster's split of the step, the same on every rank
    rank: int = 0
    gather: Callable[[Any], list[Any]] = field(default=lambda x: [x], repr=False)
    collective = True  # its checkpoint state gathers every rank's batch size

    @classmethod
    def build(cls, cfg: Config, plan: StepPlan, my_micro: int, memory_target: float,
              world_size: int, rank: int = 0, gather: Callable[[Any], list[Any]] = lambda x: [x]) -> Controllers:
        c, t = cfg.control, cfg.train
        accum = AccumulationController(plan.global_batch, t.max_accum)
        accum.plan(plan.shares, plan.micro)
        return cls(
            schedule=LRSchedule(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, t.schedule),
            health=HealthMonitor(window=c.health_window, variance_warn=c.loss_variance_warn,
                                 max_bad_steps=c.max_bad_steps, max_nonfinite_steps=c.max_nonfinite_steps),
            plateau=ReduceOnPlateau(c.plateau_patience, c.plateau_factor) if c.plateau_patience else None,
            stopper=EarlyStopping(t.early_stop_patience, t.early_stop_min_delta),
            balancer=LoadBalancer(plan.global_batch, world_size, hysteresis=c.balance_hysteresis,
                                  interval=c.balance_interval, initial_shares=plan.shares),
            batch=BatchSizeController(my_micro, min(c.min_batch, my_micro), max(c.max_batch, my_micro),
                                      target_fraction=memory_target),
            accum=accum,
            plan=plan,
            rank=rank,
            gather=gather,
        )

    def state_dict(self) -> dict[str, Any]:
        batch_states = self.gather(self.batch.state_dict())  # they differ by node
        state = {"balancer": self.balancer.state_dict(), "health": self.health.state_dict(),
                 "early_stop": self.stopper.state_dict(), "batch_size": batch_states,
                 "shares": self.plan.shares, "micro": self.plan.micro}
        if self.plateau is not None:
            state["plateau"] = self.plateau.state_dict()
        return {"controllers": state, "global_batch": self.plan.global_batch}

    def load_state_dict(self, saved: dict[str, Any], *, same_cluster: bool, rolling_back: bool) -> None:
        """From a checkpoint's flat state. Split and per-rank batch sizes only carry over onto
        the very same cluster; on a different one they start afresh from its `nodes:` settings."""
        state = saved.get("controllers", {})
        if "early_stop" in state:
            self.stopper.load_state_dict(state["early_stop"])
        if self.plateau is not None and "plateau" in state:
            self.plateau.load_state_dict(state["plateau"])
        if "health" in state and not rolling_back:  # a rollback starts a clean window
            self.health.load_state_dict(state["health"])
        if same_cluster and "balancer" in state:
            self.balancer.load_state_dict(state["balancer"])
            self.batch.load_state_dict(state["batch_size"][self.rank])
            self.plan = StepPlan(self.plan.global_batch, list(state["shares"]), list(state["micro"]))
            self.accum.plan(self.plan.shares, self.plan.micro)
