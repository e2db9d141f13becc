"""Tasks for tests/test_sync_batchnorm.py: a model nobody here wrote (transformers'
ResNetForImageClassification, tiny) with its own SGD optimizer, and two small BatchNorm MLPs
(torch, MLX) for the refusals."""

from __future__ import annotations

import numpy as np

import mlxdist

RESNET = dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
              num_labels=4)
IMAGE = 16


class Images:
    """Noise images whose label shifts the mean of one colour channel: something to learn."""

    def __init__(self, n: int = 64, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.y = rng.integers(0, 4, n)
        self.x = rng.normal(0, 1, (n, 3, IMAGE, IMAGE)).astype(np.float32)
        self.x[np.arange(n), self.y % 3] += 0.5 * (1 + self.y[:, None, None] // 3)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def resnet_model():
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(**RESNET))


def resnet() -> mlxdist.Task:
    def build(ctx):
        return resnet_model()

    def loss(model, batch):
        import torch.nn.functional as F

        return F.cross_entropy(model(batch["x"]).logits, batch["y"], reduction="sum")

    def optimizer(model):
        import torch

        decay = [p for n, p in model.named_parameters() if p.ndim > 1]  # conv and linear weights
        rest = [p for n, p in model.named_parameters() if p.ndim <= 1]  # BatchNorm and biases
        return torch.optim.SGD([{"params": decay, "weight_decay": 1e-3}, {"params": rest, "weight_decay": 0.0}],
                               lr=0.1, momentum=0.9)

    return mlxdist.Task(build=build, loss=loss, dataset=Images(), optimizer=optimizer)


def torch_mlp() -> mlxdist.Task:
    """A torch MLP with BatchNorm1d: cheap to start, for the refusals."""

    def build(ctx):
        import torch

        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * IMAGE * IMAGE, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.Linear(8, 4))

    def loss(model, batch):
        import torch.nn.functional as F

        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")

    return mlxdist.Task(build=build, loss=loss, dataset=Images())


def mlx_batchnorm() -> mlxdist.Task:
    def build(ctx):
        import mlx.nn as nn

        return nn.Sequential(nn.Linear(3 * IMAGE * IMAGE, 8), nn.BatchNorm(8), nn.Linear(8, 4))

    def loss(model, batch):
        import mlx.nn as nn

        return nn.losses.cross_entropy(model(batch["x"].reshape(len(batch["y"]), -1)), batch["y"], reduction="sum")

    return mlxdist.Task(build=build, loss=loss, dataset=Images())
