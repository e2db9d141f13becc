"""A small loop of either framework with BatchNorm: the ranks' running statistics after a few
steps, written per rank; or the shares `init()` gave (from $MLXDIST_CONFIG).

    python bn_loop.py OUT --framework torch|mlx [--steps N] [--drift] [--shares-only]
"""

import argparse
import json

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--framework", default="torch")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--run-dir")
p.add_argument("--drift", action="store_true")
p.add_argument("--shares-only", action="store_true")
args = p.parse_args()

rng = np.random.default_rng(0)
X = rng.standard_normal((8 * args.steps, 6)).astype(np.float32) * 2 + 1
Y = rng.standard_normal((8 * args.steps, 1)).astype(np.float32)

if args.framework == "torch":
    import torch

    import mlxdist.torch as md

    info = md.init(device="cpu")
    if args.shares_only:
        json.dump({"shares": md.shares(8)}, open(f"{args.out}-{info.rank}.json", "w"))
        raise SystemExit
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = md.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    md.broadcast(model, opt)
    begin = sum(md.shares(8)[:info.rank])
    for step in range(args.steps):
        rows = slice(step * 8 + begin, step * 8 + begin + md.shares(8)[info.rank])
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.from_numpy(X[rows])), torch.from_numpy(Y[rows]))
        opt.backward(loss, count=rows.stop - rows.start)
        opt.step()
    if args.drift and info.rank == 1:
        with torch.no_grad():
            model[1].running_mean += 1
    stats = {k: v.tolist() for k, v in model.state_dict().items() if "running" in k}
    if args.run_dir:
        md.save_checkpoint(args.run_dir, args.steps, model, opt)
else:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    import mlxdist.mlx as md

    info = md.init()
    if args.shares_only:
        json.dump({"shares": md.shares(8)}, open(f"{args.out}-{info.rank}.json", "w"))
        raise SystemExit
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm(4), nn.ReLU(), nn.Linear(4, 1))
    opt = optim.SGD(learning_rate=0.1)
    md.broadcast(model, opt)
    begin = sum(md.shares(8)[:info.rank])

    def loss_fn(m, x, y):
        return nn.losses.mse_loss(m(x), y, reduction="mean")

    grad_fn = nn.value_and_grad(model, loss_fn)
    for step in range(args.steps):
        count = md.shares(8)[info.rank]
        x, y = mx.array(X[step * 8 + begin:step * 8 + begin + count]), mx.array(Y[step * 8 + begin:step * 8 + begin + count])
        _, grads = grad_fn(model, x, y)
        opt.update(model, md.average_gradients(grads, count))
        md.sync_state(model, count)
        mx.eval(model.parameters(), opt.state)
    if args.drift and info.rank == 1:
        model.layers[1].running_mean = model.layers[1].running_mean + 1
    stats = {k: np.array(v).tolist() for k, v in tree_flatten(model.parameters()) if "running" in k}
    if args.run_dir:
        md.save_checkpoint(args.run_dir, args.steps, model, opt)
json.dump(stats, open(f"{args.out}-{info.rank}.json", "w"))
