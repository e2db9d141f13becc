"""One rank of `bench yourloop`'s wait probe: how much CPU a rank burns while it waits in a
collective for a peer that is late (every other rank sleeps `--delay` seconds first).

`--loop yourloop` waits in mlxdist's collectives (`mlxdist.torch`: a DistributedOptimizer step,
whose gradient sum runs on its sender thread, `md.all_reduce`, `md.all_gather`,
`md.broadcast_object` from a late rank, a barrier); `--loop ddp` in torch.distributed's over gloo (a DDP step,
`all_reduce`, `all_gather_object`, `broadcast_object_list`, `barrier`). CPU time is the whole
process's (`getrusage`: user + system of every thread), so a helper thread that spins counts.
Rank 0 writes, per collective, the CPU seconds and wall seconds of each wait to
`$MLXDIST_DDP_OUT`."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

KINDS = ("idle", "step", "all_reduce", "all_gather", "broadcast", "barrier")


def cpu_seconds() -> float:
    """This process's CPU time, every thread's, in microseconds' resolution (os.times: 10 ms)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=("ddp", "yourloop"), default="yourloop")
    p.add_argument("--delay", type=float, default=1.0, help="seconds the other ranks are late")
    p.add_argument("--repeats", type=int, default=2, help="waits per collective")
    p.add_argument("--kinds", default=",".join(KINDS))
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    x = torch.randn(8, 256)
    if args.loop == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MLXDIST_DDP_MASTER']}", rank=rank,
                                world_size=size)
        net = DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters())

        def step() -> None:
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        def gather() -> None:
            out = [None] * size
            dist.all_gather_object(out, {"rank": rank})

        ops = {"step": step, "all_reduce": lambda: dist.all_reduce(torch.ones(4)), "all_gather": gather,
               "broadcast": lambda: dist.broadcast_object_list([{"step": 1}], src=size - 1), "barrier": dist.barrier}
        sync = dist.barrier
    else:
        import mlxdist.torch as md
        from mlxdist.yourloop import session

        info = md.init(device="cpu")
        rank, size = info.rank, info.size
        opt = md.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model)
        md.broadcast(model, opt)
        world = session.current("bench").world

        def step() -> None:
            opt.backward(model(x).square().mean(), count=len(x))
            opt.step()
            opt.zero_grad()

        ops = {"step": step, "all_reduce": lambda: md.all_reduce(torch.ones(4)),
               "all_gather": lambda: md.all_gather({"rank": rank}),
               "broadcast": lambda: md.broadcast_object({"step": 1}, root=size - 1), "barrier": world.barrier}
        sync = world.barrier
    ops["idle"] = lambda: time.sleep(args.delay)  # what the process burns with no collective at all
    ops["step"]()  # warm: the first step builds buckets and threads
    out: dict[str, dict[str, list[float]]] = {}
    for kind in args.kinds.split(","):
        got = out.setdefault(kind, {"cpu_s": [], "wall_s": []})
        for _ in range(args.repeats):
            sync()
            if rank != 0:
                time.sleep(args.delay)
            c0, w0 = cpu_seconds(), time.perf_counter()
            ops[kind]()
            got["cpu_s"].append(cpu_seconds() - c0)
            got["wall_s"].append(time.perf_counter() - w0)
    sync()
    if rank == 0:
        with open(os.environ["MLXDIST_DDP_OUT"], "w") as f:
            json.dump({"delay_s": args.delay, "waits": out}, f)
    if args.loop == "ddp":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
