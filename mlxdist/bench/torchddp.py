"""`python -m mlxdist.bench torchddp`: mlxdist's torch engine on N ranks against
`torch.nn.parallel.DistributedDataParallel` with gloo (what a Mac user can run today, on CPU
tensors), side by side in one run: the same model, the same batches, the same step count.

A third contender is the same plain PyTorch loop as DDP's, synced by `mlxdist.torch` instead
(your-loop mode: `DistributedOptimizer.backward(loss, count)`, buckets sent during backward).

Prints the median step time of each (ours / DDP's; target <= 1.0; your loop / DDP's; target
<= 1.05), and with our overlap turned off, the exposed all-reduce time against the link's
limit: 2(n-1)/n of the gradient bytes at `--rate` (target >= 0.9). One host by default; `--simcluster N` runs on N namespace
hosts joined by links shaped to `--rate` (root).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cluster.world import find_mpirun
from .runs import REPO, check, finish, read_events, set_env

RATES = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """tc's `1gbit` / `100mbit` in bits per second."""
    for unit, scale in RATES.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"--rate {rate}: use tc's syntax, e.g. 1gbit or 100mbit")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench torchddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="ranks on this host (without --simcluster)")
    p.add_argument("--simcluster", type=int, default=0, metavar="N", help="N namespace hosts, one rank each")
    p.add_argument("--rate", default="1gbit", help="link rate of every namespace host (tc syntax)")
    p.add_argument("--preset", default="small", help="model.preset (small: 31M parameters)")
    p.add_argument("--batch", type=int, default=2, help="samples per rank per step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample")
    p.add_argument("--steps", type=int, default=12, help="steps per trainer")
    p.add_argument("--skip", type=int, default=3, help="warmup steps left out of the medians")
    p.add_argument("--subnet", default="10.77.53", help="namespace cluster subnet (first three octets)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    args = p.parse_args(argv)
    set_env()
    common = ["--engine", "torch", "--device", "cpu", "data.source=synthetic", f"model.preset={args.preset}",
              f"data.seq_len={args.seq_len}", f"train.batch_size={args.batch}", f"train.steps={args.steps}",
              "metrics.port=0", "train.progress=false", "train.eval_every=0", "checkpoint.every=0",
              "dist.sync_weights_every=0", "train.lr=1e-4"]
    ddp_args = ["-m", "mlxdist.bench.ddp_worker", "--preset", args.preset, "--batch", str(args.batch),
                "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    t_start = time.perf_counter()
    result: dict = {"preset": args.preset, "batch_per_rank": args.batch, "seq_len": args.seq_len, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="mlxddp-") as tmp:
        if args.simcluster:
            from ..rig.simcluster import SimCluster, available

            ok, why = available()
            if not ok:
                print(f"bench torchddp: cannot build namespace hosts: {why}", file=sys.stderr)
                return 2
            n = args.simcluster
            with SimCluster(n, name="mlxddp", subnet=args.subnet, state_dir=Path(tmp) / "cluster",
                            rate=args.rate) as cluster:
                def launch(cmd: list[str], extra_env: dict[str, str]) -> list[str]:
                    os.environ.update(extra_env)
                    return [find_mpirun(), *cluster.mpirun_args(env=["OPENBLAS_NUM_THREADS", *extra_env]),
                            "-np", str(n), *cmd]

                runs = _runs(launch, common, ddp_args, Path(tmp), cluster.ip(1), args.timeout)
            result |= {"hosts": n, "rate": args.rate}
        else:
            n = args.ranks

            def launch(cmd: list[str], extra_env: dict[str, str]) -> list[str]:
                os.environ.update(extra_env)
                return [find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", str(n), "-x", "PYTHONPATH",
                        "-x", "OPENBLAS_NUM_THREADS", *[x for k in extra_env for x in ("-x", k)], *cmd]

            runs = _runs(launch, common, ddp_args, Path(tmp), "127.0.0.1", args.timeout)
            result |= {"hosts": 1, "ranks": n}
    ours, ours_plain, ddp, yours = runs
    med = lambda xs: statistics.median(xs[args.skip:])  # noqa: E731
    ours_s, plain_s = med([e["step_s"] for e in ours]), med([e["step_s"] for e in ours_plain])
    ddp_s, sync_s = med(ddp["step_s"]), med([e["sync_s"] for e in ours_plain])
    yours_s = med(yours["step_s"])
    nbytes = med([e["sync_bytes"] for e in ours_plain])
    loss_diff = max(abs(a - b) for a, b in zip(ddp["loss"], yours["loss"], strict=True))
    result |= {"ddp_step_s": ddp_s, "ours_step_s": ours_s, "ours_no_overlap_step_s": plain_s,
               "ratio_ours_to_ddp": ours_s / ddp_s, "sync_s_no_overlap": sync_s, "sync_bytes": nbytes,
               "early_buckets": med([e.get("sync_overlapped", 0) for e in ours]),
               "yourloop_step_s": yours_s, "ratio_yourloop_to_ddp": yours_s / ddp_s,
               "yourloop_ddp_max_loss_diff": loss_diff,
               "loops": {"ddp": ddp, "yourloop": yours}}  # each plain loop's step times and losses, step by step
    print(f"{n} ranks{' on ' + str(n) + ' hosts at ' + args.rate if args.simcluster else ' on one host'}, "
          f"model {args.preset}, {args.batch} x {args.seq_len} tokens per rank per step, median of steps "
          f"{args.skip + 1}-{args.steps}")
    print(f"DDP (gloo) {ddp_s:.3f} s/step | mlxdist torch {ours_s:.3f} s/step (overlap on), {plain_s:.3f} "
          f"(off) | ours / DDP = {ours_s / ddp_s:.3f} (target <= 1.0)")
    print(f"your loop (mlxdist.torch, the DDP loop's lines) {yours_s:.3f} s/step | your loop / DDP = "
          f"{yours_s / ddp_s:.3f} (target <= 1.05); losses step by step within {loss_diff:.1e} of DDP's")
    if args.simcluster:
        ideal = nbytes * 2 * (n - 1) / n * 8 / rate_bits(args.rate)
        result |= {"link_ideal_s": ideal, "link_fraction": ideal / sync_s}
        print(f"all-reduce of {nbytes / 1e6:.0f} MB: {sync_s:.3f} s, the link's limit {ideal:.3f} s: "
              f"{ideal / sync_s:.2f} of the link (target >= 0.9)")
    return finish("torchddp", result, t_start, args.json)


def _runs(launch, common: list[str], ddp_args: list[str], tmp: Path, master: str, timeout: float):
    """Ours with overlap, ours without, DDP, the DDP loop on mlxdist.torch: one after the other
    in one run, the same batches."""
    out = []
    for tag, extra in (("ours", []), ("plain", ["dist.overlap=false"])):
        run_dir = tmp / tag
        cmd = launch([sys.executable, "-m", "mlxdist.train", *common, *extra, f"train.out_dir={run_dir}"], {})
        check(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO), f"mlxdist ({tag})")
        out.append([e for e in read_events(run_dir) if e["event"] == "step"])
    for loop, what in (("ddp", "DDP (gloo)"), ("yourloop", "your loop (mlxdist.torch)")):
        result = tmp / f"{loop}.json"
        env = {"MLXDIST_DDP_MASTER": f"{master}:{_free_port()}", "MLXDIST_DDP_OUT": str(result)}
        cmd = launch([sys.executable, *ddp_args, "--loop", loop], env)
        check(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO), what)
        out.append(json.loads(result.read_text()))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
