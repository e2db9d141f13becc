"""A plain PyTorch training loop, written as its author would, on mlxdist (the lines marked md).

    python torch_loop.py OUT [--config C] [--mode backward|step|accum|adamw] [--steps N]

`adamw`: `backward` with AdamW at lr 1e-3 instead of SGD with momentum.

`--mode backward,step,accum` trains each in turn, from scratch (a test's three runs in one
launch), each mode's weights in OUT-MODE.npz.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import mlxdist.torch as md

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--config")
p.add_argument("--mode", default="backward")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--seed-by-rank", action="store_true")
p.add_argument("--zero-count", action="store_true")
p.add_argument("--run-dir", help="resume from and save a checkpoint there")
p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (a slow Mac)")
p.add_argument("--started", help="a file rank 0 writes once it trains (for tests that signal it)")
p.add_argument("--freeze-at", type=int, default=0, help="rank 1 stops itself (SIGSTOP) at this step")
args = p.parse_args()

info = md.init(args.config, device="cpu", stall_timeout=4 if args.freeze_at else None)  # md
rng = np.random.default_rng(0)
x = torch.tensor(rng.normal(size=(256, 8)), dtype=torch.float32)
y = torch.tensor(rng.integers(0, 3, size=256))
for mode in args.mode.split(","):  # one mode; or several, each from scratch, in OUT-MODE.npz
    out = args.out if mode == args.mode else f"{args.out}-{mode}.npz"
    torch.manual_seed(1000 + info.rank if args.seed_by_rank else 0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    base = (torch.optim.AdamW(model.parameters(), lr=1e-3) if mode == "adamw"
            else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt = md.DistributedOptimizer(base, model)                                            # md
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    md.broadcast(model, opt)                                                              # md
    resumed = md.load_checkpoint(args.run_dir, model, opt) if args.run_dir else None    # md
    if resumed:
        sched.load_state_dict(resumed["sched"])
    step = resumed["step"] if resumed else 0
    sampler = md.DistributedSampler(len(x), args.global_batch, start_step=step)          # md
    loader = DataLoader(TensorDataset(x, y), batch_size=sampler.batch_size, sampler=sampler)

    for xb, yb in loader:
        if args.freeze_at and step == args.freeze_at and info.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(args.sleep)
        if args.started and info.rank == 0:
            open(args.started, "w").close()
        opt.zero_grad()
        if mode in ("backward", "adamw"):
            opt.backward(F.cross_entropy(model(xb), yb), count=0 if args.zero_count else len(xb))      # md
            opt.step()
        elif mode == "step":
            F.cross_entropy(model(xb), yb).backward()
            opt.step(count=len(xb))                                                       # md
        else:  # two micro-batches, the first only accumulating; clip by the global norm
            half = len(xb) // 2
            with opt.no_sync():                                                           # md
                opt.backward(F.cross_entropy(model(xb[:half]), yb[:half]), count=half)
            opt.backward(F.cross_entropy(model(xb[half:]), yb[half:]), count=len(xb) - half)
            opt.synchronize()                                                             # md
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        sched.step()
        step += 1
        if step >= args.steps or md.should_stop():                                        # md
            break

    with torch.no_grad():
        loss = md.all_reduce(float(F.cross_entropy(model(x), y)), op="mean")              # md
    if args.run_dir:
        md.save_checkpoint(args.run_dir, step, model, opt, sched=sched.state_dict())      # md
    if info.rank == 0:
        np.savez(out, loss=loss, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    print(f"rank {info.rank}: done after {step} steps, batch {sampler.batch_size}", file=sys.stderr)
