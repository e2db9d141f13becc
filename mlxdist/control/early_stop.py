"""Stop training when the monitored eval metric stops improving."""

from __future__ import annotations

import math
from typing import Any


class EarlyStopping:
    """Stop after ``patience`` consecutive evals without a ``min_delta`` improvement.

    ``patience=0`` disables stopping (but ``best`` is still tracked) so the
    loop can call it unconditionally. A non-finite value counts as a bad eval:
    it is never a new best.
    """

    def __init__(self, patience: int, min_delta: float = 0.0, mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if patience < 0 or min_delta < 0:
            raise ValueError("patience and min_delta must be >= 0")
        self.patience, self.min_delta, self.mode = patience, min_delta, mode
        self.best: float | None = None
        self.bad_evals = 0
        self.stopped = False

    def _improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def observe(self, value: float) -> bool:
        """Record one eval; True means stop (and stays True once reached)."""
        if self._improved(value):
            self.best, self.bad_evals = float(value), 0
        else:
            self.bad_evals += 1
        if self.patience > 0 and self.bad_evals >= self.patience:
            self.stopped = True
        return self.stopped

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals, "stopped": self.stopped}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.best = d["best"]
        self.bad_evals = int(d["bad_evals"])
        self.stopped = bool(d["stopped"])
