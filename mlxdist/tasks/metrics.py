"""A task's metrics beside its loss: `loss(model, batch)` may return `(sum, {"name": value})`.

A value is a scalar *sum* over the batch's units (accuracy as the number right), divided by
the cluster's units of the step, or a pair `(sum, count)` divided by the cluster's summed
count (exact-match over puzzles when the units are cells). Summed over every rank's
micro-batches first and divided once, so a metric of 3+5 equals the one of 8, as the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import TaskError


def split_loss(out: Any, task: str) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """(loss, {name: (sum, count or None)}) from what `loss(model, batch)` returned."""
    if not isinstance(out, tuple):
        return out, {}
    if len(out) != 2 or not isinstance(out[1], dict):
        raise TaskError(f"task {task}: loss(model, batch) returned a tuple of {len(out)}; return the summed loss, "
                        "or (summed loss, {name: summed metric, ...})")
    metrics = {}
    for name, value in out[1].items():
        total, count = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        for part in (total, count):
            n = _size(part)
            if n != 1:
                raise TaskError(f"task {task}: metric {name!r} is {_shape(part)}, not a scalar; return its sum over "
                                "the batch (e.g. (pred == y).sum()) or a (sum, count) pair")
        metrics[str(name)] = (total, count)
    return out[0], metrics


def _size(x: Any) -> int:
    if x is None or isinstance(x, (int, float)):
        return 1
    numel = getattr(x, "numel", None)
    n = numel() if callable(numel) else getattr(x, "size", None)
    return n if isinstance(n, int) else -1


def _shape(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"shape {tuple(shape)}" if shape is not None else type(x).__name__


class MetricSums:
    """Per name: the summed metric and its count (None: the units) over micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, list] = {}

    def add(self, metrics: dict[str, tuple[Any, Any]], to_float: Callable[[Any], float]) -> None:
        for name, (total, count) in metrics.items():
            entry = self.sums.setdefault(name, [0.0, None if count is None else 0.0])
            entry[0] += to_float(total)
            if count is not None:
                entry[1] = (entry[1] or 0.0) + to_float(count)

    def flat(self, units: float, names: list[str] | None = None) -> list[float]:
        """[sum, count] per name in name order (the same on every rank), count = units when unnamed;
        `names` (e.g. rank 0's) gives zeros for a name this rank never saw."""
        out = []
        for name in sorted(self.sums) if names is None else names:
            total, count = self.sums.get(name, (0.0, None))
            out += [total, units if count is None else count]
        return out

    def names(self) -> list[str]:
        return sorted(self.sums)


def means(names: list[str], flat: list[float]) -> dict[str, float]:
    """{name: sum / count} from `MetricSums.flat` summed over ranks."""
    return {n: flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else float("nan") for i, n in enumerate(names)}
