"""Tasks for tests/test_pipeline.py, imported by `task.factory: pipeline_tasks:...` from the tests
directory (the working directory of those runs)."""

from __future__ import annotations

import numpy as np

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
    """A three-stage MLP (each stage one Linear) on `PoisonedRegression`."""

    def build(ctx):
        import mlx.nn as nn

        class Staged(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

            def __call__(self, x):
                for _, run in self.stages():
                    x = run(x)
                return x

            def stages(self):
                return [(["inp.weight", "inp.bias"], lambda x: nn.relu(self.inp(x))),
                        (["mid.weight", "mid.bias"], lambda h: nn.relu(self.mid(h))),
                        (["out.weight", "out.bias"], self.out)]

        return Staged()

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    return mlxdist.Task(build=build, loss=loss, dataset=PoisonedRegression(n, bad),
                        eval_dataset=PoisonedRegression(16, -1, seed=1))
