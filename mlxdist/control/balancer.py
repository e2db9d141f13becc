"""Rebalance per-rank shares of the global batch so all ranks finish compute together.

Every rank runs an identical balancer on identical all-gathered numbers, so all
ranks reach the same decision without extra communication. This only holds if
every rank calls ``observe`` at the same steps with the same lists, and if every
decision is a deterministic function of them: no clocks, no randomness, no
iteration over unordered containers.

Why a model of step time and not "shares proportional to samples/s": a host's
per-sample time depends on its share. A bigger micro-batch is cheaper per sample
(BLAS, a GPU), a smaller one still pays the step's fixed costs (kernel launches,
Python, the optimizer's per-step work). Rates measured at one split then mispredict
the next, and the proportional rule reaches its fixed point only by creeping toward
it one re-split at a time (issue 27: four in a row, each further toward the fast host).
Modelling each host's compute time as ``a + c * share`` and fitting it to the
splits already tried lets the balancer jump to the split that minimises the
slowest host's predicted time, usually in two moves.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from .split import proportional_split

# The median of n readings has a standard error of ~1.2533 sigma / sqrt(n) (normal
# noise), and sigma ~ the interquartile range / 1.349. The quartiles ignore a lone spike
# but, unlike the median absolute deviation, still see two alternating levels when
# one of them holds a majority of the readings.
_MEDIAN_SE = 1.2533 / 1.349
# A median of identical readings would claim no noise at all and infinite weight in
# the fit; timers and schedulers are never that good.
_SE_FLOOR = 0.005
# A gain must beat this many relative standard errors of the noisiest rank's median:
# about one standard error of the difference of two such medians (sqrt 2). Stricter
# gates left a 20% imbalance standing under a loaded machine's 25% step-to-step noise;
# the return margin and the escalating threshold catch the false moves this admits.
_NOISE_Z = 1.5


@dataclass(frozen=True)
class Point:
    """One rank's compute time at one share: the median of its readings there."""

    share: int
    seconds: float
    se: float  # standard error of `seconds`
    readings: int = 1


@dataclass(frozen=True)
class StepModel:
    """Compute time of one rank as a function of its share: ``fixed + per_sample * share``."""

    fixed: float
    per_sample: float

    def time(self, share: int | float) -> float:
        return self.fixed + self.per_sample * share


def summarise(share: int, seconds: list[float]) -> Point:
    """Median and its standard error: one slow step (a GC, a neighbour's burst) cannot
    move the median, and the error says how far to trust it."""
    med = statistics.median(seconds)
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else (med, med, med)
    se = _MEDIAN_SE * (q3 - q1) / math.sqrt(len(seconds))
    return Point(share, med, max(se, _SE_FLOOR * med), len(seconds))


def fit_line(points: list[Point]) -> tuple[float, float, float, float] | None:
    """Weighted least squares ``seconds = a + c * share``: (a, c, standard error of a,
    chi-square per degree of freedom), or None with fewer than two distinct shares.

    Weights are 1/se^2, so a noisy split counts less than a steady one. With more
    points than parameters the errors are scaled up by the misfit: points that do not
    lie on one line make the intercept less certain, not more.
    """
    if len({p.share for p in points}) < 2:
        return None
    w = [1.0 / (p.se * p.se) for p in points]
    sw = sum(w)
    sb = sum(wi * p.share for wi, p in zip(w, points, strict=True))
    sbb = sum(wi * p.share * p.share for wi, p in zip(w, points, strict=True))
    sy = sum(wi * p.seconds for wi, p in zip(w, points, strict=True))
    sby = sum(wi * p.share * p.seconds for wi, p in zip(w, points, strict=True))
    det = sw * sbb - sb * sb
    if det <= 0:
        return None
    a = (sbb * sy - sb * sby) / det
    c = (sw * sby - sb * sy) / det
    dof = len(points) - 2
    chi2 = (sum(wi * (p.seconds - a - c * p.share) ** 2 for wi, p in zip(w, points, strict=True)) / dof
            if dof > 0 else 0.0)
    return a, c, math.sqrt(sbb / det * max(1.0, chi2)), chi2


def fixed_range(points: list[Point], prior_fixed: float = 0.0, max_fixed: float = 0.8,
                z: float = 1.0) -> tuple[float, float]:
    """Plausible fixed cost of one rank, in seconds: (low, high), from its readings at the
    splits tried (oldest first).

    The fit's estimate minus and plus `z` standard errors, both capped to [0, `max_fixed`
    x the newest time]. With one share tried there is nothing to fit, and both are the
    prior (`prior_fixed` of the time; 0 is "time proportional to share", which never
    overshoots when the true fixed cost is >= 0). Points that no line fits with a
    positive slope and a non-negative fixed cost (the host got faster or slower between
    splits, not the share that changed it) are dropped oldest first, down to the newest.
    """
    if not points:
        raise ValueError("no readings for this rank")
    anchor = points[-1]
    lo = hi = prior_fixed * anchor.seconds
    for k in range(len(points), 1, -1):
        fit = fit_line(points[-k:])
        if fit is None:
            continue
        a, c, se_a, chi2 = fit
        if c <= 0 or a + 2 * se_a < -0.02 * anchor.seconds or chi2 > 9.0:
            continue  # not one line: a change in the host, not in its share
        lo, hi = a - z * se_a, a + z * se_a
        break
    cap = max_fixed * anchor.seconds
    return min(max(lo, 0.0), cap), min(max(hi, 0.0), cap)


def anchored(point: Point, fixed: float) -> StepModel:
    """The line through `point` with that fixed cost.

    Through the newest point, because that is what the host does now: a fit through
    older readings may say how time grows with share, but must not overrule it."""
    return StepModel(fixed, max((point.seconds - fixed) / max(point.share, 1), 1e-12))


def min_max_split(models: list[StepModel], total: int, minimum: int = 1) -> list[int]:
    """Integer shares summing to `total`, each >= `minimum`, minimising the largest
    predicted time (the step waits for its slowest rank).

    Continuous answer first: one finishing time T for all, share_i = (T - fixed_i) /
    per_sample_i, clipped at `minimum`; T by bisection. Its floors are never above an
    optimal integer split, and from there adding one unit at a time to the rank that
    would finish soonest (ties: lowest rank) reaches one. Deterministic, O(n log)."""
    n = len(models)
    if n == 0 or total < n * minimum:
        raise ValueError(f"cannot give {n} ranks {minimum} each out of {total}")

    def shares_at(t: float) -> list[float]:
        return [max(float(minimum), (t - m.fixed) / m.per_sample) for m in models]

    lo = min(m.time(minimum) for m in models)
    hi = max(m.time(total) for m in models)
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(shares_at(mid)) > total:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    shares = [max(minimum, math.floor(s)) for s in shares_at(lo)]
    while sum(shares) > total:  # only float rounding can get here; take from the fastest to finish
        i = min((j for j in range(n) if shares[j] > minimum), key=lambda j: (models[j].time(shares[j]), j))
        shares[i] -= 1
    while sum(shares) < total:
        i = min(range(n), key=lambda j: (models[j].time(shares[j] + 1), j))
        shares[i] += 1
    return shares


class LoadBalancer:
    """Give faster ranks more samples so all ranks finish compute together.

    The input must be each rank's own compute time (forward/backward), never wall
    time that includes waiting for peers: a fast rank that waits would look slow,
    and the split would chase its own shadow.

    Each rank's time at the current split is the median of its last ``window``
    readings, and again of all its readings there (up to ``long_window``, default 4 x
    window): the second sees a small steady imbalance through noise, the first a host
    that changed, sooner (it must show twice the gain, as a real change does). A decision needs ``min_observations`` readings from every rank.
    When the split changes, the medians are kept (up to ``memory`` splits per rank) and a line
    ``time = fixed + per_sample * share`` is fitted through them (`fixed_range`). The
    proposal is the split that minimises the slowest rank's predicted time
    (`min_max_split`) under the least fixed cost the readings allow: believing too much
    fixed cost overshoots, too little stops short and the next reading finishes the job.
    Its gain is judged less hopefully: a rank that gives work away is credited with the
    fit's central estimate of its fixed cost, not the low one (each sample it sheds saves
    less), so a move is made only when the readings, not the caution, say it pays.

    Guards, each against a way a balancer wastes time:
    - ``hysteresis``: a move must shorten the predicted step by more than this
      fraction (moving work costs new shapes and a restarted prefetch), and by more
      than the noise of the current medians (`_NOISE_Z`), so noise alone cannot pay
      for it.
    - ``return_margin``: a move back toward the split just left must clear that many
      times the threshold, so noise that alternates cannot flip the cluster between
      two splits. A move less than halfway back is a correction (a first move made on a
      few noisy readings went too far) and needs only the plain threshold.
    - ``free_moves``: after that many moves in a row the threshold doubles with each
      further one, so a drifting load cannot keep the split creeping; it relaxes
      by one step for every ``4 x window`` readings a split holds, so a host that really
      changes later is still followed.
    - ``warmup``: the first readings after start and after each change are dropped:
      they include compilation and allocation for the new shapes.
    """

    def __init__(
        self,
        global_batch: int,
        n_ranks: int,
        hysteresis: float = 0.05,
        *,
        min_share: int = 1,
        interval: int = 1,
        warmup: int = 2,
        initial_shares: list[int] | None = None,
        window: int = 5,
        min_observations: int = 3,
        return_margin: float = 3.0,
        prior_fixed: float = 0.0,
        max_fixed: float = 0.8,
        memory: int = 3,
        free_moves: int = 2,
        long_window: int | None = None,
    ) -> None:
        if n_ranks < 1 or global_batch < n_ranks * min_share:
            raise ValueError(
                f"global_batch {global_batch} cannot give {n_ranks} ranks {min_share} each"
            )
        if hysteresis < 0 or interval < 1 or warmup < 0 or return_margin < 1:
            raise ValueError("need hysteresis >= 0, interval >= 1, warmup >= 0, return_margin >= 1")
        if not 1 <= min_observations <= window:
            raise ValueError(f"need 1 <= min_observations ({min_observations}) <= window ({window})")
        if not 0 <= prior_fixed <= max_fixed < 1 or memory < 1 or free_moves < 0:
            raise ValueError("need 0 <= prior_fixed <= max_fixed < 1, memory >= 1, free_moves >= 0")
        self.global_batch, self.n_ranks = global_batch, n_ranks
        self.hysteresis, self.return_margin = hysteresis, return_margin
        self.min_share, self.interval, self.warmup = min_share, interval, warmup
        self.window, self.min_observations = window, min_observations
        self.prior_fixed, self.max_fixed = prior_fixed, max_fixed
        self.memory, self.free_moves = memory, free_moves
        self.long_window = max(long_window or 4 * window, window)
        if initial_shares is None:
            initial_shares = proportional_split(global_batch, [1.0] * n_ranks, min_share)
        if len(initial_shares) != n_ranks or sum(initial_shares) != global_batch:
            raise ValueError(
                f"initial_shares {initial_shares} must have {n_ranks} entries summing to {global_batch}"
            )
        self._shares = list(initial_shares)
        self._times: list[list[float]] = [[] for _ in range(n_ranks)]  # seconds at this split, newest last
        self._history: list[list[Point]] = [[] for _ in range(n_ranks)]  # earlier splits, oldest first
        self._left: list[int] | None = None  # the split the last change moved away from
        self._settle = warmup
        self._streak = 0  # moves since the split last held for a while
        self._held = 0  # readings taken since the last move
        self.changes = 0
        self.last_gain: float | None = None  # predicted gain of the last move
        self.last_rates: list[float | None] = []  # samples/s per rank the last move was decided on

    @property
    def shares(self) -> list[int]:
        return list(self._shares)

    @property
    def rates(self) -> list[float | None]:
        """Samples/s per rank at the current split, from its last ``window`` readings (None
        until a reading there exists)."""
        return [s / statistics.median(t[-self.window :]) if t else None
                for s, t in zip(self._shares, self._times, strict=True)]

    def models(self, worst_for: list[int] | None = None, recent: int | None = None) -> list[StepModel]:
        """Each rank's step-time model from its readings so far (raises before any), with the
        least fixed cost the readings allow; given a proposal, the ranks it takes work from
        get the central estimate instead, so that the proposal's gain is not overstated.
        `recent`: how many of the current split's readings to use (default ``window``)."""
        models = []
        for i in range(self.n_ranks):
            points = self._points(i, recent or self.window)
            lo, hi = fixed_range(points, self.prior_fixed, self.max_fixed)
            loses_work = worst_for is not None and worst_for[i] < self._shares[i]
            models.append(anchored(points[-1], (lo + hi) / 2 if loses_work else lo))
        return models

    def predicted_step_time(self, shares: list[int]) -> float:
        """Compute time of the slowest rank: the step waits for it at the all-reduce."""
        if any(not t and not h for t, h in zip(self._times, self._history, strict=True)):
            raise ValueError("no time measured yet for some rank")
        return max(m.time(s) for m, s in zip(self.models(), shares, strict=True))

    def observe(
        self, step: int, samples: list[int], compute_seconds: list[float]
    ) -> list[int] | None:
        """Feed one step's per-rank samples and compute time (no sync, no data wait).

        Returns new shares to use from the next step on, or None to keep them.
        """
        if len(samples) != self.n_ranks or len(compute_seconds) != self.n_ranks:
            raise ValueError(
                f"expected {self.n_ranks} entries, got {len(samples)} and {len(compute_seconds)}"
            )
        if self._settle > 0:
            self._settle -= 1
            return None
        self._held += 1
        for times, n, sec in zip(self._times, samples, compute_seconds, strict=True):
            if n > 0 and sec > 0 and math.isfinite(sec):
                times.append(float(sec))
                del times[: -self.long_window]
        held = min(len(t) for t in self._times)
        if step % self.interval != 0 or held < self.min_observations:
            return None
        # All readings since the split was adopted see a small steady imbalance through
        # noise; the last `window` see a host that changed, sooner. A change shows as a
        # large gain, so the few recent readings alone must show twice the gain to decide.
        for recent, strictness in ((held, 1.0), (self.window, 2.0))[: 1 + (held > self.window)]:
            proposal, gain = self._proposal(recent)
            if proposal is not None and gain > strictness * self._threshold(proposal, recent):
                self._move(proposal, recent)
                self.last_gain = gain
                return self.shares
        return None

    def _proposal(self, recent: int) -> tuple[list[int] | None, float]:
        """The split the models favour and its predicted gain (None: the current one)."""
        models = self.models(recent=recent)
        proposal = min_max_split(models, self.global_batch, self.min_share)
        if proposal == self._shares:
            return None, 0.0
        now = max(m.time(s) for m, s in zip(models, self._shares, strict=True))
        worst = self.models(worst_for=proposal, recent=recent)
        return proposal, 1 - max(m.time(s) for m, s in zip(worst, proposal, strict=True)) / now

    def _threshold(self, proposal: list[int], recent: int) -> float:
        """The predicted gain a move to `proposal` must beat (see the class's guards)."""
        streak = self._streak_now()
        bar = self.hysteresis * 2.0 ** max(0, streak - self.free_moves + 1)
        if self._moves_back(proposal):
            bar *= self.return_margin
        return max(bar, _NOISE_Z * max(self._noise(i, recent) for i in range(self.n_ranks)))

    def _noise(self, rank: int, recent: int) -> float:
        """Relative standard error of the rank's current median. A spread read from a few
        readings can come out small by chance, so it is never taken below the typical
        spread of the rank's earlier splits (scaled to this many readings)."""
        now = summarise(self._shares[rank], self._times[rank][-recent:])
        earlier = [p.se / p.seconds * math.sqrt(p.readings / recent) for p in self._history[rank]]
        return max(now.se / now.seconds, statistics.median(earlier) if earlier else 0.0)

    def _streak_now(self) -> int:
        """Moves in a row, forgiving one for every 4 x window readings the split held."""
        return max(0, self._streak - self._held // (4 * self.window))

    def _move(self, proposal: list[int], recent: int) -> None:
        self.last_rates = self.rates
        for i, (share, times) in enumerate(zip(self._shares, self._times, strict=True)):
            kept = [p for p in self._history[i] if p.share != share]  # the newest reading of a share wins
            self._history[i] = [*kept, summarise(share, times[-recent:])][-self.memory :]
        self._streak = self._streak_now() + 1
        self._held = 0
        self._left, self._shares = self._shares, list(proposal)
        self._times = [[] for _ in range(self.n_ranks)]  # times at the old split are history now
        self._settle = self.warmup
        self.changes += 1

    def _points(self, rank: int, recent: int) -> list[Point]:
        """The rank's points, oldest first, the current split's (its last `recent` readings)
        last, if read yet."""
        times = self._times[rank][-recent:]
        current = [summarise(self._shares[rank], times)] if times else []
        return [p for p in self._history[rank] if not current or p.share != self._shares[rank]] + current

    def _moves_back(self, proposal: list[int]) -> bool:
        """Whether `proposal` goes at least halfway back to the split the last change left
        (projected on the line between the two)."""
        if self._left is None:
            return False
        away = [o - c for o, c in zip(self._left, self._shares, strict=True)]
        step = [p - c for p, c in zip(proposal, self._shares, strict=True)]
        return 2 * sum(a * s for a, s in zip(away, step, strict=True)) >= sum(a * a for a in away) > 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "shares": self.shares,
            "rates": self.rates,
            "times": [list(t) for t in self._times],
            "history": [[[p.share, p.seconds, p.se, p.readings] for p in h] for h in self._history],
            "left": None if self._left is None else list(self._left),
            "settle": self._settle,
            "changes": self.changes,
            "streak": self._streak,
            "held": self._held,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Also reads checkpoints of the older balancers: the rate-median one kept samples/s
        readings, the EMA one a smoothed rate per rank; both become times at the saved split."""
        shares = [int(s) for s in d["shares"]]
        if len(shares) != self.n_ranks or sum(shares) != self.global_batch:
            raise ValueError(f"balancer state has shares {shares}; this run needs {self.n_ranks} "
                             f"ranks summing to {self.global_batch}")
        self._shares = shares
        if "times" in d:
            self._times = [[float(x) for x in t][-self.long_window :] for t in d["times"]]
        else:
            rates = d["readings"] if "readings" in d else [[] if r is None else [r] for r in
                                                           d.get("rates", [None] * self.n_ranks)]
            self._times = [[s / float(r) for r in rs if float(r) > 0][-self.window :]
                           for s, rs in zip(shares, rates, strict=True)]
        self._history = [[Point(int(p[0]), float(p[1]), float(p[2]), int(p[3])) for p in h]
                         for h in d.get("history", [[] for _ in range(self.n_ranks)])]
        left = d.get("left")
        self._left = None if left is None else [int(s) for s in left]
        self._settle = int(d.get("settle", self.warmup))
        self.changes = int(d.get("changes", 0))
        self._streak, self._held = int(d.get("streak", 0)), int(d.get("held", 0))
