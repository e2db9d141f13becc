"""One rank of the `bench torchddp` baselines: the built-in model and batches, trained by the
plainest PyTorch loop, synced either by DistributedDataParallel over gloo (`--loop ddp`; rank and
size from Open MPI's environment, the rendezvous address from MLXDIST_DDP_MASTER) or by
`mlxdist.torch` (`--loop yourloop`: `DistributedOptimizer.backward(loss, count)`, buckets sent
while backward runs). Both started by mpirun; the model, optimizer, batches and the timed span
(forward to zero_grad) are the same lines, only the sync differs. `--accum K` makes it the
DDP script shape with gradient accumulation: K micro-batches a step, all but the last under
`no_sync()` (DDP's divides each micro-batch's mean loss by K; mlxdist's gives each its count)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from contextlib import nullcontext


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=("ddp", "yourloop"), default="ddp")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--accum", type=int, default=1, help="micro-batches a step")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (model.*)")
    args = p.parse_args()
    import torch

    from ..config import load_config
    from ..data.sampler import GlobalSampler
    from ..models.build import build_torch
    from ..tasks.lm import lm_loss, lm_task

    ddp = args.loop == "ddp"
    if ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MLXDIST_DDP_MASTER']}", rank=rank,
                                world_size=size)
    else:
        import mlxdist.torch as md

        info = md.init(device="cpu")
        rank, size = info.rank, info.size
    cfg = load_config(None, ["data.source=synthetic", f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
                             f"train.batch_size={args.batch}", *args.set])
    module = build_torch(cfg, torch.device("cpu")).module
    if ddp:
        model = DistributedDataParallel(module)  # broadcasts rank 0's weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=cfg.train.weight_decay)
    else:
        model = module
        opt = md.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4,
                                                        weight_decay=cfg.train.weight_decay), model)
        md.broadcast(model, opt)  # rank 0's weights, as DDP's constructor
    task = lm_task(cfg)
    sampler = GlobalSampler(len(task.dataset), cfg.train.seed)
    times, cpu, losses = [], [], []
    for step in range(args.steps):
        batches = []
        for j in range(args.accum):
            start = ((step * args.accum + j) * size + rank) * args.batch
            batch = task.make_batch(task.dataset, sampler.indices(start, args.batch))
            batches.append((torch.from_numpy(batch.data["tokens"]), batch.count))
        t0, c0 = time.perf_counter(), _cpu_seconds()
        step_loss = 0.0
        for j, (tokens, count) in enumerate(batches):
            last = j == args.accum - 1
            loss = lm_loss(model, {"tokens": tokens}) / count  # a mean: DDP averages across ranks
            if ddp:
                with nullcontext() if last else model.no_sync():
                    (loss / args.accum).backward()
            else:
                with nullcontext() if last else opt.no_sync():
                    opt.backward(loss, count=count)  # the step's last: buckets go out during backward
            step_loss += float(loss.detach()) / args.accum
        if not ddp:
            opt.synchronize()  # the global sum / units, before clipping by the global norm
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_seconds() - c0)
        losses.append(step_loss)  # rank 0's: the same batches, so the same in both loops
    if rank == 0:
        with open(os.environ["MLXDIST_DDP_OUT"], "w") as f:
            json.dump({"step_s": times, "cpu_s": cpu, "loss": losses}, f)
    if ddp:
        dist.destroy_process_group()
    return 0


def _cpu_seconds() -> float:
    """This process's CPU time, every thread's (a waiting thread that spins shows here)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    raise SystemExit(main())
