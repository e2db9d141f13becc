"""Training-health checks on the per-step loss and gradient norm."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HealthVerdict:
    step: int
    skip_update: bool  # do not apply this step's gradients
    rollback: bool  # restore the last good checkpoint
    warnings: list[str] = field(default_factory=list)
    nonfinite_total: int = 0
    rollbacks_total: int = 0
    give_up: bool = False  # so many skipped in a row that training cannot recover: stop the run
    nonfinite_streak: int = 0


class NonfiniteSteps:
    """Updates skipped for a non-finite loss or gradients: how many, how many in a row, and
    when to give up. One bad batch is worth skipping; `max_in_a_row` in a row mean the weights
    or the optimizer's state blew up and no later batch brings them back, so the run should
    stop rather than spin. The trainer (`HealthMonitor`) and a loop of the user's own
    (`mlxdist.torch`, `mlxdist.mlx`) keep this one count, so both stop at the same step."""

    def __init__(self, max_in_a_row: int = 10) -> None:
        if max_in_a_row < 1:
            raise ValueError("max_nonfinite_steps must be >= 1")
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.streak = 0

    def observe(self, finite: bool) -> bool:
        """True when this update is the `max_in_a_row`th skipped in a row: give up."""
        if finite:
            self.streak = 0
            return False
        self.total += 1
        self.streak += 1
        return self.streak >= self.max_in_a_row


class HealthMonitor:
    """Decide per step whether to apply, skip, or roll back.

    One non-finite loss or gradient is usually a bad batch: skipping the update
    is enough. ``max_bad_steps`` in a row means the weights or optimizer state
    are already damaged, so only a rollback helps. Warnings (noisy loss, rising
    trend) are edge-triggered - reported when a condition starts and again only
    after it has cleared - so a long bad stretch does not flood the log.
    """

    def __init__(
        self,
        window: int = 50,
        variance_warn: float | None = None,
        max_bad_steps: int = 3,
        trend_warn: float | None = 0.05,
        max_nonfinite_steps: int = 10,
    ) -> None:
        """``variance_warn`` is an absolute loss variance (None disables it: a
        sensible value depends on the loss scale). ``trend_warn`` fires when the
        fitted line rises by more than this fraction of the mean loss across a
        full window. ``max_nonfinite_steps`` skipped updates in a row end the run: a rollback
        resets the rollback streak but not this one, so a model that blows up again after every
        rollback (or has no checkpoint to go back to) stops instead of looping.
        """
        if window < 2 or max_bad_steps < 1 or max_nonfinite_steps < 1:
            raise ValueError("window must be >= 2, max_bad_steps and max_nonfinite_steps >= 1")
        self.window, self.variance_warn = window, variance_warn
        self.max_bad_steps, self.trend_warn = max_bad_steps, trend_warn
        self.nonfinite = NonfiniteSteps(max_nonfinite_steps)
        self._losses: deque[float] = deque(maxlen=window)
        self._bad_streak = 0
        self._active: set[str] = set()
        self.rollbacks_total = 0

    @property
    def max_nonfinite_steps(self) -> int:
        return self.nonfinite.max_in_a_row

    @property
    def nonfinite_total(self) -> int:
        return self.nonfinite.total

    @property
    def nonfinite_streak(self) -> int:
        return self.nonfinite.streak

    def observe(self, step: int, loss: float, grad_norm: float) -> HealthVerdict:
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        give_up = self.nonfinite.observe(finite)
        if not finite:
            self._bad_streak += 1
            if give_up:
                return self._verdict(step, True, False, [], give_up=True)
            rollback = self._bad_streak >= self.max_bad_steps
            if rollback:
                self.rollbacks_total += 1
                self._bad_streak = 0
                # The loop replays from the checkpoint; old losses would be counted twice.
                self._losses.clear()
                self._active.clear()
            return self._verdict(step, True, rollback, [])
        self._bad_streak = 0
        self._losses.append(float(loss))
        return self._verdict(step, False, False, self._warnings())

    def _warnings(self) -> list[str]:
        conditions: dict[str, str] = {}
        var = self.loss_variance()
        if self.variance_warn is not None and len(self._losses) >= 2 and var > self.variance_warn:
            conditions["variance"] = (
                f"loss variance {var:.4g} over last {len(self._losses)} steps > {self.variance_warn:.4g}"
            )
        if self.trend_warn is not None and len(self._losses) == self.window:
            rise = self.loss_trend() * (self.window - 1)
            mean = sum(self._losses) / self.window
            if rise > self.trend_warn * abs(mean):
                conditions["trend"] = (
                    f"loss rising: +{rise:.4g} over last {self.window} steps (mean {mean:.4g})"
                )
        new = [msg for key, msg in conditions.items() if key not in self._active]
        self._active = set(conditions)
        return new

    def _verdict(self, step: int, skip: bool, rollback: bool, warnings: list[str],
                 give_up: bool = False) -> HealthVerdict:
        return HealthVerdict(step, skip, rollback, warnings, self.nonfinite_total, self.rollbacks_total,
                             give_up, self.nonfinite_streak)

    def loss_variance(self) -> float:
        """Population variance of the finite losses in the window (0 if fewer than 2)."""
        n = len(self._losses)
        if n < 2:
            return 0.0
        mean = sum(self._losses) / n
        return sum((x - mean) ** 2 for x in self._losses) / n

    def loss_trend(self) -> float:
        """Least-squares slope of loss per observed finite step (0 if fewer than 2)."""
        n = len(self._losses)
        if n < 2:
            return 0.0
        x_mean = (n - 1) / 2
        y_mean = sum(self._losses) / n
        num = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(self._losses))
        den = sum((i - x_mean) ** 2 for i in range(n))
        return num / den

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self._losses),
            "bad_streak": self._bad_streak,
            "active": sorted(self._active),
            "nonfinite_total": self.nonfinite_total,
            "rollbacks_total": self.rollbacks_total,
            "nonfinite_streak": self.nonfinite_streak,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._losses = deque((float(x) for x in d["losses"]), maxlen=self.window)
        self._bad_streak = int(d["bad_streak"])
        self._active = set(d["active"])
        self.nonfinite.total = int(d["nonfinite_total"])
        self.rollbacks_total = int(d["rollbacks_total"])
        self.nonfinite.streak = int(d.get("nonfinite_streak", 0))  # absent in checkpoints before it


class ReduceOnPlateau:
    """Multiply the LR down when eval loss stops improving.

    Returns a scale for ``lr_at(..., scale=...)`` rather than touching the
    optimizer, so it composes with the schedule and checkpoints as one float.
    """

    def __init__(
        self, patience: int, factor: float = 0.5, min_delta: float = 0.0, min_scale: float = 0.01
    ) -> None:
        if patience < 1 or not 0 < factor < 1 or min_scale <= 0:
            raise ValueError("need patience >= 1, 0 < factor < 1, min_scale > 0")
        self.patience, self.factor = patience, factor
        self.min_delta, self.min_scale = min_delta, min_scale
        self.best: float | None = None
        self.bad_evals = 0
        self.scale = 1.0

    def observe(self, eval_loss: float) -> float:
        """Reduce after ``patience`` consecutive evals without a ``min_delta`` improvement."""
        if math.isfinite(eval_loss) and (
            self.best is None or eval_loss < self.best - self.min_delta
        ):
            self.best, self.bad_evals = float(eval_loss), 0
        else:
            self.bad_evals += 1
            if self.bad_evals >= self.patience:
                self.scale = max(self.min_scale, self.scale * self.factor)
                self.bad_evals = 0
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals, "scale": self.scale}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.best = d["best"]
        self.bad_evals = int(d["bad_evals"])
        self.scale = float(d["scale"])
