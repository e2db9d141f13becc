"""Your own PyTorch model, trained by mlxdist: `python examples/your_model_torch.py [key=value ...]`
(on a Mac it runs on MPS; --device is `auto`, so CUDA or the CPU elsewhere)."""

import sys

import numpy as np
import torch
import torch.nn.functional as F

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


def build(ctx):  # ctx.device is where mlxdist will run it (mps, cuda or cpu)
    return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 2))


def loss(model, batch):  # the SUM over the batch's samples, not the mean
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def make_task():  # also usable from YAML: task: {factory: "your_model_torch:make_task"}
    return mlxdist.Task(build=build, loss=loss, dataset=Spirals(), eval_dataset=Spirals(512, seed=1))


if __name__ == "__main__":
    sys.exit(mlxdist.fit(make_task(), overrides=["train.steps=300", "train.lr=1e-2", *sys.argv[1:]],
                         engine="torch"))
