"""A small loop of the user's own whose loss goes NaN on one rank at chosen steps (a bad batch),
in PyTorch (`mlxdist.torch`) or MLX (`mlxdist.mlx`, its host sum or a compiled step).

    python nonfinite_loop.py OUT --framework torch|mlx|mlx-compiled [--config C]
        [--nan-at 2,3 --nan-rank 1] [--skip-at 2] [--max-nonfinite N] [--run-dir R] [--save-nan R]

`--skip-at`: the reference, where those steps are simply not taken. AdamW with weight decay,
so a step taken with zero gradients would still move the weights: only a step not taken at
all equals the reference. OUT.npz: the weights (rank 0); every rank ends with `rank R: done`.
"""

import argparse
import sys

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--framework", default="torch")
p.add_argument("--config")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--nan-at", default="")
p.add_argument("--nan-rank", type=int, default=1)
p.add_argument("--skip-at", default="")
p.add_argument("--max-nonfinite", type=int)
p.add_argument("--run-dir", help="save a checkpoint there at the end")
p.add_argument("--save-nan", help="put a NaN in the weights, then save a checkpoint there")
args = p.parse_args()
nan_at = {int(s) for s in args.nan_at.split(",") if s}
skip_at = {int(s) for s in args.skip_at.split(",") if s}
rng = np.random.default_rng(0)
X = rng.normal(size=(64, 8)).astype(np.float32)
Y = rng.integers(0, 3, size=64)


def torch_loop():
    import torch
    import torch.nn.functional as F

    import mlxdist.torch as md

    info = md.init(args.config, device="cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = md.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model,
                                  max_nonfinite_steps=args.max_nonfinite)
    md.broadcast(model, opt)
    sampler = md.DistributedSampler(len(X), 8)
    for step in range(args.steps):
        if step in skip_at:
            continue
        idx = sampler.indices(step)
        loss = F.cross_entropy(model(torch.from_numpy(X[idx])), torch.from_numpy(Y[idx]))
        if step in nan_at and info.rank == args.nan_rank:
            loss = loss * float("nan")
        opt.zero_grad()
        opt.backward(loss, count=len(idx))
        opt.step()
    if args.save_nan:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    if args.run_dir or args.save_nan:
        md.save_checkpoint(args.run_dir or args.save_nan, args.steps, model, opt)
    return info, {n: t.detach().numpy() for n, t in model.state_dict().items()}


def mlx_loop(compiled: bool):
    from functools import partial

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    import mlxdist.mlx as md

    info = md.init(args.config)
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)
    md.broadcast(model, optimizer)
    sampler = md.DistributedSampler(len(X), 8)
    state = [model.state, optimizer.state]

    def loss_fn(model, x, y, scale):
        return nn.losses.cross_entropy(model(x), y, reduction="mean") * scale

    def host_step(x, y, scale):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y, scale)
        grads = md.average_gradients(grads, count=x.shape[0])
        if not md.skipped():  # the step not taken at all, as the trainer skips it
            optimizer.update(model, grads)
        return loss

    @partial(mx.compile, inputs=state, outputs=state)
    def graph_step(x, y, scale):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y, scale)
        grads = md.average_gradients(grads, count=x.shape[0])
        optimizer.update(model, grads)
        return loss

    for step in range(args.steps):
        if step in skip_at:
            continue
        idx = sampler.indices(step)
        scale = mx.array(float("nan") if step in nan_at and info.rank == args.nan_rank else 1.0)
        (graph_step if compiled else host_step)(mx.array(X[idx]), mx.array(Y[idx]), scale)
        mx.eval(state)
    if args.save_nan:
        w = model.layers[0].weight
        model.layers[0].weight = mx.where(mx.arange(w.size).reshape(w.shape) == 0, float("nan"), w)
    if args.run_dir or args.save_nan:
        md.save_checkpoint(args.run_dir or args.save_nan, args.steps, model, optimizer)
    return info, {n: np.array(a) for n, a in tree_flatten(model.parameters())}


info, weights = torch_loop() if args.framework == "torch" else mlx_loop(args.framework == "mlx-compiled")
if info.rank == 0:
    np.savez(args.out, **weights)
sys.stderr.write(f"rank {info.rank}: done\n")
