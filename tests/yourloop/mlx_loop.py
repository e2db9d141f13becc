"""A plain MLX training loop on mlxdist (the lines marked md).

    python mlx_loop.py OUT [--config C] [--steps N] [--compile] [--backend B]

`--compile`: the step under `mx.compile` with the gradient sum inside it, as mlx-lm writes it.
"""

import argparse
import os
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

import mlxdist.mlx as md

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--config")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--wide-on-rank1", action="store_true")
p.add_argument("--compile", action="store_true")
p.add_argument("--backend", default="auto")
args = p.parse_args()

info = md.init(args.config, backend=args.backend)                                                   # md
mx.random.seed(1000 + info.rank)  # each rank its own initial weights: broadcast makes them rank 0's
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype(np.float32)
y = rng.integers(0, 3, size=256).astype(np.int32)
hidden = 32 if args.wide_on_rank1 and info.rank == 1 else 16
model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))
opt = optim.AdamW(learning_rate=1e-2)
md.broadcast(model, opt)                                                      # md


def loss_fn(model, xb, yb):
    return nn.losses.cross_entropy(model(xb), yb, reduction="mean")


loss_and_grad = nn.value_and_grad(model, loss_fn)
shares = md.shares(8)                                                         # md
begin = sum(shares[: info.rank])
state = [model.state, opt.state]


def train_step(xb, yb):
    loss, grads = loss_and_grad(model, xb, yb)
    grads = md.average_gradients(grads, count=xb.shape[0])                    # md
    opt.update(model, grads)
    return loss


if args.compile:
    train_step = partial(mx.compile, inputs=state, outputs=state)(train_step)
for step in range(args.steps):
    idx = np.random.default_rng(step).permutation(256)[:8][begin : begin + shares[info.rank]]
    train_step(mx.array(x[idx]), mx.array(y[idx]))
    mx.eval(state)
    if md.should_stop():                                                      # md
        break

if info.rank == 0:
    from mlx.utils import tree_flatten

    np.savez(args.out, **{k: np.array(v) for k, v in tree_flatten(model.parameters())})
print(f"rank {info.rank} ({os.getpid()}): done, share {shares[info.rank]}")
