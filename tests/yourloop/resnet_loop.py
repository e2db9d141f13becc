"""A plain PyTorch loop training transformers' ResNetForImageClassification (BatchNorm) on
mlxdist, its BatchNorm statistics taken over every rank's samples (the lines marked md).

    python resnet_loop.py OUT [--config C] [--bn sync|plain|sync,plain]

`--bn plain` leaves each rank its own statistics; `--bn sync,plain` trains both in turn, from
scratch (a test's two runs in one launch), in OUT-sync.npz and OUT-plain.npz.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bn_tasks import Images, resnet_model  # noqa: E402

import mlxdist.torch as md  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--config")
p.add_argument("--bn", default="sync")
args = p.parse_args()
if not set(args.bn.split(",")) <= {"sync", "plain"}:
    p.error(f"--bn {args.bn}: expected sync, plain or both")

info = md.init(args.config, device="cpu")                                          # md
data = Images()
for bn in args.bn.split(","):
    out = args.out if bn == args.bn else f"{args.out}-{bn}.npz"
    torch.manual_seed(0)
    model = resnet_model()
    if bn == "sync":
        md.sync_batchnorm(model)                                                    # md
    opt = md.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)  # md
    md.broadcast(model, opt)                                                        # md
    sampler = md.DistributedSampler(len(data), global_batch=8)                      # md
    order = list(sampler)
    for step in range(3):
        idx = order[step * sampler.batch_size:(step + 1) * sampler.batch_size]
        x = torch.tensor(np.stack([data[i]["x"] for i in idx]))
        y = torch.tensor(np.array([data[i]["y"] for i in idx]))
        opt.zero_grad()
        opt.backward(F.cross_entropy(model(x).logits, y), count=len(idx))          # md
        opt.step()
    if info.rank == 0:
        np.savez(out, **{k: v.detach().float().numpy() for k, v in model.state_dict().items()})
