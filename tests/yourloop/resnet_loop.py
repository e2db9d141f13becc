"""A plain PyTorch loop training transformers' ResNetForImageClassification (BatchNorm) on
mlxdist, its BatchNorm statistics taken over every rank's samples (the lines marked md).

    python resnet_loop.py OUT [--config C] [--no-sync-bn]
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
p.add_argument("--no-sync-bn", action="store_true")
args = p.parse_args()

info = md.init(args.config, device="cpu")                                          # md
torch.manual_seed(0)
model = resnet_model()
if not args.no_sync_bn:
    md.sync_batchnorm(model)                                                        # md
opt = md.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)  # md
md.broadcast(model, opt)                                                            # md
data = Images()
sampler = md.DistributedSampler(len(data), global_batch=8)                          # md
order = list(sampler)
for step in range(3):
    idx = order[step * sampler.batch_size:(step + 1) * sampler.batch_size]
    x = torch.tensor(np.stack([data[i]["x"] for i in idx]))
    y = torch.tensor(np.array([data[i]["y"] for i in idx]))
    opt.zero_grad()
    opt.backward(F.cross_entropy(model(x).logits, y), count=len(idx))              # md
    opt.step()
if info.rank == 0:
    np.savez(args.out, **{k: v.detach().float().numpy() for k, v in model.state_dict().items()})
