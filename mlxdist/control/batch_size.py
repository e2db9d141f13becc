"""Memory-driven micro-batch size for one rank.

Each rank runs its own controller: micro-batch size only changes how many
accumulation steps a rank needs, never the global batch, so ranks may disagree.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any


class BatchSizeError(RuntimeError):
    """Raised when memory cannot be relieved because the batch is already minimal."""


@dataclass(frozen=True)
class Decision:
    old: int
    new: int
    reason: str


class BatchSizeController:
    """Shrink when memory runs hot, grow when there is clear headroom.

    Decisions use the mean of a full window of readings so a single spike does
    not trigger a change. Growth starts only below ``low_fraction * target``:
    the gap between the two thresholds is the hysteresis that stops flip-flop.
    After an OOM the failing size becomes a ceiling that growth never reaches
    again, otherwise the controller would walk back into the same crash.
    """

    def __init__(
        self,
        initial: int,
        min_batch: int,
        max_batch: int,
        target_fraction: float = 0.85,
        window: int = 5,
        shrink: float = 0.8,
        grow: float = 1.2,
        cooldown: int = 1,
        low_fraction: float = 0.8,
    ) -> None:
        if not 1 <= min_batch <= initial <= max_batch:
            raise ValueError(
                f"need 1 <= min_batch <= initial <= max_batch, got {min_batch}, {initial}, {max_batch}"
            )
        if window < 1 or cooldown < 0:
            raise ValueError("window must be >= 1 and cooldown >= 0")
        if not (0 < shrink < 1 < grow):
            raise ValueError("need 0 < shrink < 1 < grow")
        self.min_batch, self.max_batch = min_batch, max_batch
        self.window, self.shrink, self.grow = window, shrink, grow
        self.cooldown, self.low_fraction = cooldown, low_fraction
        self.batch = initial
        self.set_target(target_fraction)
        self.oom_ceiling: int | None = None  # smallest size that hit OOM
        self._readings: deque[float] = deque(maxlen=window)
        self._cooldown_left = 0
        self.shrinks = self.grows = self.ooms = 0

    def set_target(self, fraction: float) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"target fraction must be in (0, 1], got {fraction}")
        self.target = fraction

    @property
    def average(self) -> float | None:
        return sum(self._readings) / len(self._readings) if self._readings else None

    def observe(self, used_bytes: int, limit_bytes: int) -> Decision | None:
        """Record one step's peak memory; return a Decision when the size changes.

        The first ``cooldown`` readings after a change are dropped: the first
        step at a new shape pays for compilation and allocator growth.
        """
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        if self._cooldown_left > 0:
            self._cooldown_left -= 1
            return None
        self._readings.append(used_bytes / limit_bytes)
        if len(self._readings) < self.window:
            return None
        avg = self.average
        assert avg is not None
        if avg > self.target and self.batch > self.min_batch:
            self.shrinks += 1
            return self._change(self._shrunk(), f"memory {avg:.2f} > target {self.target:.2f}")
        low = self.low_fraction * self.target
        cap = (
            self.max_batch
            if self.oom_ceiling is None
            else min(self.max_batch, self.oom_ceiling - 1)
        )
        if avg < low and self.batch < cap:
            new = min(cap, max(self.batch + 1, math.floor(self.batch * self.grow)))
            self.grows += 1
            return self._change(
                new,
                f"memory {avg:.2f} < {low:.2f} ({self.low_fraction} x target {self.target:.2f})",
            )
        return None

    def on_oom(self) -> Decision:
        """Shrink at once: an OOM is certain evidence, no averaging needed."""
        self.ooms += 1
        if self.batch <= self.min_batch:
            raise BatchSizeError(
                f"out of memory at the minimum batch size {self.min_batch}; "
                "lower min_batch, the model size or the sequence length"
            )
        self.oom_ceiling = (
            self.batch if self.oom_ceiling is None else min(self.oom_ceiling, self.batch)
        )
        self.shrinks += 1
        return self._change(self._shrunk(), f"out of memory at batch {self.batch}")

    def _shrunk(self) -> int:
        # b - 1 guarantees progress where floor(b * shrink) == b for tiny b.
        return max(self.min_batch, min(self.batch - 1, math.floor(self.batch * self.shrink)))

    def _change(self, new: int, reason: str) -> Decision:
        decision = Decision(self.batch, new, reason)
        self.batch = new
        self._readings.clear()  # readings taken at the old size say nothing about the new one
        self._cooldown_left = self.cooldown
        return decision

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "target": self.target,
            "oom_ceiling": self.oom_ceiling,
            "readings": list(self._readings),
            "cooldown_left": self._cooldown_left,
            "shrinks": self.shrinks,
            "grows": self.grows,
            "ooms": self.ooms,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.batch = int(d["batch"])
        self.set_target(float(d["target"]))
        self.oom_ceiling = d["oom_ceiling"]
        self._readings = deque(d["readings"], maxlen=self.window)
        self._cooldown_left = int(d["cooldown_left"])
        self.shrinks, self.grows, self.ooms = int(d["shrinks"]), int(d["grows"]), int(d["ooms"])
