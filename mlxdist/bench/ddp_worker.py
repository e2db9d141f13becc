"""One rank of the `bench torchddp` baseline: the built-in model and batches, trained by the
plainest DistributedDataParallel loop over gloo (started by mpirun; rank and size from
Open MPI's environment, the rendezvous address from MLXDIST_DDP_MASTER)."""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ..config import load_config
    from ..data.sampler import GlobalSampler
    from ..models.build import build_torch
    from ..tasks.lm import lm_loss, lm_task

    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MLXDIST_DDP_MASTER']}", rank=rank,
                            world_size=size)
    cfg = load_config(None, ["data.source=synthetic", f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
                             f"train.batch_size={args.batch}"])
    model = DistributedDataParallel(build_torch(cfg, torch.device("cpu")).module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=cfg.train.weight_decay)
    task = lm_task(cfg)
    sampler = GlobalSampler(len(task.dataset), cfg.train.seed)
    times = []
    for step in range(args.steps):
        start = step * args.batch * size + rank * args.batch
        batch = task.make_batch(task.dataset, sampler.indices(start, args.batch))
        tokens = torch.from_numpy(batch.data["tokens"])
        t0 = time.perf_counter()
        loss = lm_loss(model, {"tokens": tokens}) / batch.count  # DDP averages across ranks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(os.environ["MLXDIST_DDP_OUT"], "w") as f:
            json.dump({"step_s": times}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
