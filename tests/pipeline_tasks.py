"""Tasks for tests/test_pipeline.py, imported by `task.factory: pipeline_tasks:...` from the tests
directory (the working directory of those runs)."""

from __future__ import annotations

import numpy as np
from user_tasks import mlx_staged_mlp

import mlxdist


class PoisonedRegression:
    """8 features -> 3 targets; sample `bad`'s features are NaN, so the step that draws it has a
    non-finite loss (every sample is drawn within the first epoch)."""

    def __init__(self, n: int, bad: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, 8)).astype(np.float32)
        self.y = rng.normal(size=(n, 3)).astype(np.float32)
        if bad >= 0:
            self.x[bad] = np.nan

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i]}


def staged_poisoned(n: int = 8, bad: int = 5) -> mlxdist.Task:
    """user_tasks' three-stage MLP on `PoisonedRegression`."""
    task = mlx_staged_mlp()
    task.dataset, task.eval_dataset = PoisonedRegression(n, bad), PoisonedRegression(16, -1, seed=1)
    return task
