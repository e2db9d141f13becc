"""Tasks the benchmarks train: generated data, sizes where the step's compute, not Python,
sets the pace (`bench overhead --task mlxdist.bench.tasks:classifier`)."""

from __future__ import annotations

import numpy as np

from ..tasks import Task


class Blobs:
    """`classes` Gaussian clusters in `dim` dimensions: a classification set with a learnable
    answer, made from a seed."""

    def __init__(self, n: int, dim: int, classes: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        centers = rng.normal(size=(classes, dim)).astype(np.float32)
        self.y = rng.integers(0, classes, size=n).astype(np.int32)
        self.x = (centers[self.y] + 2.0 * rng.normal(size=(n, dim))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i]}


def classifier(dim: int = 512, hidden: int = 1024, classes: int = 10, n: int = 8192, metrics: bool = True) -> Task:
    """An MLX MLP classifier with BatchNorm; the summed cross-entropy and, with `metrics`, the
    number of right answers (accuracy)."""

    def build(ctx):
        import mlx.nn as nn

        return nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm(hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                             nn.ReLU(), nn.Linear(hidden, classes))

    def loss(model, batch):
        import mlx.core as mx
        import mlx.nn as nn

        logits = model(batch["x"])
        total = nn.losses.cross_entropy(logits, batch["y"], reduction="sum")
        if not metrics:
            return total
        return total, {"accuracy": (mx.argmax(logits, axis=-1) == batch["y"]).sum()}

    return Task(build=build, loss=loss, dataset=Blobs(n, dim, classes), eval_dataset=Blobs(512, dim, classes, 1),
                name="classifier")
