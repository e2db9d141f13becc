"""Who processes which part of each global step, and how that plan changes.

A step always processes `global_batch` samples of the global stream. Rank r owns a
contiguous `shares[r]` of them and works through its part in micro-batches of at most
`micro[r]` (its memory-limited batch size). Shares may change (load balancing) and micro
sizes may change (memory), but the step's samples never do.

`replan` is the one place that changes a plan: every rank calls it with the same
all-gathered numbers, so every rank reaches the same plan without another message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .balancer import LoadBalancer
from .split import AccumulationController, micro_batches, proportional_split


@dataclass
class StepPlan:
    global_batch: int
    shares: list[int]
    micro: list[int]

    @classmethod
    def initial(cls, micro: list[int], accum: int, global_batch: int | None) -> StepPlan:
        total = global_batch or sum(micro) * accum
        if total < len(micro):
            raise ValueError(f"train.global_batch: {total} is smaller than the number of ranks ({len(micro)})")
        return cls(total, proportional_split(total, [float(m) for m in micro]), list(micro))

    def accumulation(self, rank: int) -> int:
        return len(micro_batches(self.shares[rank], self.micro[rank]))

    def copy(self) -> StepPlan:
        return StepPlan(self.global_batch, list(self.shares), list(self.micro))


@dataclass(frozen=True)
class Decision:
    """A change the loop reports: `kind` names the event, `text` is the log line (if any)."""

    kind: str
    text: str | None
    fields: dict[str, Any] = field(default_factory=dict)


def replan(plan: StepPlan, gathered: list[dict[str, Any]], step: int, balancer: LoadBalancer | None,
           accum: AccumulationController) -> tuple[StepPlan, list[Decision]]:
    """The plan for the next steps from every rank's `{"micro", "samples", "compute_s"}`.

    Micro-batch sizes are each rank's own (its memory controller decided them); shares come
    from the balancer when one is given. Returns the new plan (the same object's copy when
    nothing changed) and the decisions to report, in order.
    """
    new, decisions = plan.copy(), []
    micro = [int(g["micro"]) for g in gathered]
    if micro != plan.micro:
        decisions.append(Decision("batch_size", f"batch: step {step}: micro-batches {plan.micro} -> {micro}",
                                  {"step": step, "old": plan.micro, "new": micro}))
        new.micro = micro
    if balancer is not None:
        shares = balancer.observe(step, [g["samples"] for g in gathered], [g["compute_s"] for g in gathered])
        if shares is not None and shares != plan.shares:
            rates = [round(r or 0, 1) for r in balancer.last_rates]  # those it decided on
            gain = balancer.last_gain or 0.0
            decisions.append(Decision("balance", f"balance: step {step}: shares {plan.shares} -> {shares} "
                                      f"(rates {rates} samples/s; predicted compute step -{gain:.0%})",
                                      {"step": step, "old": plan.shares, "new": shares}))
            new.shares = list(shares)
    if decisions:
        decisions.append(Decision("accumulation", None, {"step": step, "accum": accum.plan(new.shares, new.micro)}))
    return new, decisions
