"""Which parameters sync together, and when: Streaming DiLoCo's fragments and the time box.

Streaming DiLoCo (arXiv 2501.18512) splits the model into F fragments and syncs them in
turn, H/F inner steps apart, so the link carries 1/F of the model at a time instead of
all of it in a burst every H steps. The schedule counts inner steps within a round of
H; fragment k is due once the round reaches (k+1)*H//F steps, so with F=1 it is plain
DiLoCo (sync after H, 2H, ...).

The time box (`dist.sync_every_s`) lets a fast node do more inner steps than a slow one
between syncs. A round is a number of the cluster's steps, the same on every rank (the
loop's step counter, learning-rate schedule, data stream and checkpoints stay in step);
each rank trains on as many of them as its speed fits in the box and sits the others out,
spread evenly over the round, so every rank reaches each step, and the outer sync, at
about the same time. The counts are decided at each round boundary from the paces all
ranks all-gathered, by one deterministic function, and saved: a resumed round replays
them instead of timing again.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np


def partition(sizes: list[int], fragments: int) -> list[list[int]]:
    """Split parameter indices into `fragments` groups of near-equal total size.

    Largest-first into the lightest group (ties to the lower group), indices sorted
    within each group. Deterministic, so every rank computes the same split.
    """
    if fragments < 1:
        raise ValueError(f"dist.fragments={fragments}: must be at least 1")
    if fragments > len(sizes):
        raise ValueError(f"dist.fragments={fragments} exceeds the model's {len(sizes)} parameter arrays; "
                         f"use at most {len(sizes)}")
    loads = [0] * fragments
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(fragments), key=lambda k: (loads[k], k))
        groups[k].append(i)
        loads[k] += sizes[i]
    return [sorted(g) for g in groups]


def threshold(fragment: int, period: int, fragments: int) -> int:
    """Steps into a round after which `fragment` syncs (the last one closes the round)."""
    return (fragment + 1) * period // fragments


def works(i: int, inner: int, steps: int) -> bool:
    """Whether a rank with `inner` inner steps in a round of `steps` trains at step `i`
    (0-based) of it. Spread evenly, so after any step of the round each rank has done its
    share of the work so far (a collective mid-round finds them together); the last step
    is always a working one when `inner` > 0."""
    return (i + 1) * inner // steps > i * inner // steps


@dataclass
class RoundPlan:
    """One round of the time box: its length in the cluster's steps and each rank's
    inner steps in it."""
    steps: int
    inner: list[int]

    def row(self) -> np.ndarray:
        return np.array([self.steps, *self.inner], np.int64)


def plan_round(pace: list[float], idle: list[float], seconds: float, *, min_steps: int,
               previous: RoundPlan) -> RoundPlan:
    """The next round from every rank's seconds per inner step (`pace`, its whole step:
    compute, update, bookkeeping) and per step sat out (`idle`); every rank computes the same.

    The fastest rank trains on every step, so the round lasts floor(seconds / its pace)
    steps (at least `min_steps`); each other rank gets as many inner steps as fit beside
    the steps it sits out: n * pace + (steps - n) * idle <= seconds, possibly 0 (it still
    joins the outer sync). A rank never measured keeps its count of `previous`.
    """
    def fits(seconds: float, each: float) -> int:
        return max(0, math.floor(seconds / each + 1e-9))  # 2.0 // 0.1 is 19 in binary floating point

    known = [p for p in pace if p > 0 and math.isfinite(p)]
    steps = max([min_steps, *(fits(seconds, p) for p in known)]) if known else max(min_steps, previous.steps)
    inner = []
    for r, p in enumerate(pace):
        if not (p > 0 and math.isfinite(p)):
            n = previous.inner[r] if r < len(previous.inner) else steps
        else:
            i = idle[r] if 0 <= idle[r] < p else 0.0
            n = fits(seconds - steps * i, p - i)
        inner.append(max(0, min(steps, n)))
    return RoundPlan(steps, inner)


@dataclass
class TimeBox:
    """One rank's side of `dist.sync_every_s`: which steps of the round it trains on, how
    long they took, and the plan every rank agreed on. The plan and the measured paces are
    the same on every rank (decided from all-gathered numbers), so they go into the run's
    checkpoint; the timings of the round in progress are this rank's and are not saved (a
    resumed round replays its counts, and the next round is planned from the steps timed
    since the resume)."""
    seconds: float
    rank: int
    size: int
    first_steps: int  # the first round, before anything is measured: every rank trains on every step
    min_steps: int
    plan: RoundPlan = field(init=False)
    pace: list[float] = field(init=False)
    idle: list[float] = field(init=False)
    rounds: int = 0
    history: list[np.ndarray] = field(default_factory=list)  # [end step, steps, inner per rank] per round
    _times: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    _start: float | None = None  # when the step in progress began (None: not timed yet)
    _working = False
    _computed = 0.0
    _left_out = 0.0  # of the step in progress: its meetings and outer syncs
    _warm = False  # the first step of a process compiles and allocates: not timed
    _counts = True  # False for a step with a checkpoint in it
    round_start: float = field(default_factory=time.perf_counter)
    arrived: float = 0.0

    def __post_init__(self) -> None:
        self.plan = RoundPlan(self.first_steps, [self.first_steps] * self.size)
        self.pace, self.idle = [0.0] * self.size, [0.0] * self.size

    def works(self, i: int) -> bool:
        return works(i, self.plan.inner[self.rank], self.plan.steps)

    def start_step(self, i: int) -> bool:
        """A step of the round begins: time the one before it, say whether this rank trains."""
        now = time.perf_counter()
        if self._start is not None:
            if self._warm and self._counts:
                self._times[self._working].append(now - self._start - self._left_out)
            self._warm = True
        self._start, self._working, self._left_out, self._counts = now, self.works(i), 0.0, True
        return self._working

    def skip_step(self) -> None:
        """Leave the step in progress out of the timings (a checkpoint is written in it)."""
        self._counts = False

    def computed(self) -> None:
        """This rank's part of the step is done (its arrival, if the step closes the round)."""
        self.arrived = time.time()
        self._computed = time.perf_counter()

    def step_done(self, synced: bool) -> None:
        """The step's strategy work is over. When it met the other ranks (an outer sync, the
        round's end), the time since `computed` is left out: a step's pace is its own work,
        logging and evaluations included, not the waits for others nor the syncs the box is
        meant to space."""
        if synced:
            self._left_out = time.perf_counter() - self._computed

    def _pace(self, times: list[float]) -> float:
        """Mean seconds per step, what a round's length adds up from; steps beyond 3x the
        median (an evaluation, a hiccup) left out."""
        if not times:
            return 0.0
        cap = 3 * statistics.median(times)
        kept = [t for t in times if t <= cap]
        return sum(kept) / len(kept)

    def report(self, samples: int, inner: int) -> dict:
        """What this rank tells the others when the round closes."""
        return {"pace": self._pace(self._times[True]), "idle": self._pace(self._times[False]), "arrived": self.arrived,
                "samples": samples, "inner": inner, "seconds": time.perf_counter() - self.round_start}

    def close(self, gathered: list[dict], step: int, steps: int) -> tuple[RoundPlan, RoundPlan]:
        """The round that ended at `step` after `steps` steps (its plan's, unless the run
        ended it early), as planned, and the plan of the next, from every rank's `report`."""
        for r, g in enumerate(gathered):
            if g["pace"] > 0:
                self.pace[r] = float(g["pace"])
            if g["idle"] > 0:
                self.idle[r] = float(g["idle"])
        done = self.plan
        self.history.append(np.array([step, steps, *(g["inner"] for g in gathered)], np.int64))
        self.plan = plan_round(self.pace, self.idle, self.seconds, min_steps=self.min_steps, previous=done)
        self.rounds += 1
        self.restart_clock()
        return done, self.plan

    def restart_clock(self, resume: bool = False) -> None:
        """Forget this rank's timings: at a new round (the step that closed the last one is
        still timed), or at a resume (only the steps since count)."""
        self._times = {True: [], False: []}
        if resume:
            self._start, self._warm = None, False
        self.round_start = time.perf_counter()

    def state_dict(self) -> dict[str, np.ndarray]:
        hist = np.stack(self.history) if self.history else np.zeros((0, 2 + self.size), np.int64)
        return {"global.timebox.plan": self.plan.row(), "global.timebox.rounds": np.array([self.rounds], np.int64),
                "global.timebox.pace": np.array([*self.pace, *self.idle], np.float64),
                "global.timebox.history": hist}

    def load_state_dict(self, state: dict[str, np.ndarray], steps: int) -> bool:
        """Take the saved plan if it was made for this many ranks (True); otherwise the round
        in progress, `steps` long, is trained on by every rank and the next one is planned
        from fresh timings."""
        self.restart_clock(resume=True)
        plan = state.get("global.timebox.plan")
        if plan is None or len(plan) != 1 + self.size:
            self.plan = RoundPlan(steps, [steps] * self.size)
            self.pace, self.idle, self.history = [0.0] * self.size, [0.0] * self.size, []
            return False
        self.plan = RoundPlan(int(plan[0]), [int(x) for x in plan[1:]])
        pace = [float(x) for x in state["global.timebox.pace"]]
        self.pace, self.idle = pace[: self.size], pace[self.size:]
        self.rounds = int(state["global.timebox.rounds"][0])
        self.history = list(np.asarray(state["global.timebox.history"], np.int64))
        return True
