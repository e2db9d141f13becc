"""Your own MLX model, trained by mlxdist: `python examples/your_model_mlx.py [key=value ...]`;
across Macs: `mpirun -hostfile hosts python examples/your_model_mlx.py`."""

import sys

import numpy as np

import mlxdist


class Spirals:  # any object with len() and [i] works; it must be the same on every host
    def __init__(self, n=4096, seed=0):
        rng = np.random.default_rng(seed)
        t = rng.uniform(0.5, 3 * np.pi, n)
        self.y = rng.integers(0, 2, n)
        xy = np.stack([np.cos(t), np.sin(t)], 1) * (t * (1 - 2 * self.y))[:, None]
        self.x = (xy / 5 + rng.normal(0, 0.05, (n, 2))).astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def build(ctx):
    import mlx.nn as nn  # imported here, so mlxdist can set up a fast BLAS on Linux first

    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


def loss(model, batch):  # the SUM over the batch's samples, not the mean
    import mlx.nn as nn

    return nn.losses.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def make_task():  # also usable from YAML: task: {factory: "your_model_mlx:make_task"}
    return mlxdist.Task(build=build, loss=loss, dataset=Spirals(), eval_dataset=Spirals(512, seed=1))


if __name__ == "__main__":
    sys.exit(mlxdist.fit(make_task(), overrides=["train.steps=300", "train.lr=1e-2", *sys.argv[1:]]))
