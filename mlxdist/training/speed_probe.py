"""Each rank's compute speed, measured once at start, for a strategy that gives a faster rank
more of the work (`Strategy.speed_weighted`: a pipeline's cut).

Why a forward pass: every engine runs one (`eval_loss`), it needs no gradients (a model that a
pipeline cuts is whole on each rank only now, and its gradients might not fit beside it), and
backward's time follows forward's on the same hardware. Every rank times the same sample at the
same moment; the median of repeats over a fraction of a second, so a small model's millisecond
passes are not one noisy reading. Speeds within 15% of each other are read as alike: on a shared
machine that much is noise, not a slower Mac.
"""

from __future__ import annotations

import statistics
import time

from ..cluster.world import World
from ..engine.base import Engine

ALIKE = 1.15  # the fastest rank's speed over the slowest's below which all count as one


def speeds_from(seconds: list[float]) -> list[float]:
    """Relative speeds (the fastest 1) from each rank's seconds for the same work."""
    fastest = min(seconds)
    speeds = [fastest / s for s in seconds]
    if min(speeds) * ALIKE >= 1.0:
        return [1.0] * len(seconds)
    return [round(s, 2) for s in speeds]


def time_forward(engine: Engine, batch, budget_s: float = 0.3, most: int = 20) -> float:
    """The median seconds of `engine.eval_loss(batch)` after one warm-up: at least 3 passes,
    more while `budget_s` lasts (at most `most`)."""
    engine.eval_loss(batch)
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < end and len(times) < most):
        t0 = time.perf_counter()
        engine.eval_loss(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_speeds(world: World, engine: Engine, batch, hosts: list[str]) -> tuple[list[float], str]:
    """Every rank's speed (collective), and the line the start prints of it."""
    with world.watch("timing a forward pass on every rank (dist.measure_speed)"):
        seconds = world.allgather(time_forward(engine, batch))
    speeds = speeds_from(seconds)
    each = ", ".join(f"rank {r} ({h}) {s:g} ({t * 1e3:.3g} ms)" for r, (h, s, t) in
                     enumerate(zip(hosts, speeds, seconds, strict=True)))
    alike = " (all within 15%: alike)" if len(set(speeds)) == 1 else ""
    return speeds, (f"speeds measured at start (a forward pass of one sample): {each}{alike}; "
                    "nodes: {HOST: {speed: ...}} sets them instead, dist.measure_speed=false makes them alike")
