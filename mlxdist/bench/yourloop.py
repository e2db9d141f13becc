"""`python -m mlxdist.bench yourloop`: a DDP-style script on `mlxdist.torch` against the same
script on torch DDP + gloo, quiet and beside a competing CPU load, and the CPU a rank burns
while it waits for a late peer (issue 51).

The script shape is what DDP scripts write (`ddp_worker.py --accum K`): K micro-batches a
step, all but the last under `no_sync()`, clipping by the global norm, AdamW; a tiny and a
small model. Each round runs, per load (`quiet`; `busy`: `--busy` processes spinning in a
loop beside the ranks), both loops for every model `--launches` times in turn (DDP, yours, yours,
DDP, ...: a load that drifts during the round weighs on both alike; each loop's figure is the
mean of its launches' medians), then the wait probe (`waitprobe.py`: every other rank sleeps `--delay` s before each collective,
rank 0 reports its process CPU seconds over the wait) for both. Ratios are yourloop / DDP
within one round: the box is shared, so only side-by-side numbers mean anything.

Targets (issue 51): iteration time <= 1.05x DDP's quiet, <= 1.1x busy; a waiting rank's CPU
no more than gloo's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cluster.world import find_mpirun
from .runs import REPO, check, finish, namespace_hosts, set_env
from .torchddp import _free_port

# name -> config overrides of the built-in LM (ddp_worker --set): 0.77M and 6.3M parameters.
MODELS = {"tiny": ["model.preset=tiny"], "small": ["model.preset=small", "model.n_layers=2"]}
LOADS = ("quiet", "busy")
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def cpu_load(processes: int):
    """`processes` Python processes spinning for the block's length, stopped by their ids."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench yourloop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,small", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--loads", default="quiet,busy", help="comma-separated, of quiet, busy")
    p.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the ranks under the busy load")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="ranks on this host (without --simcluster)")
    p.add_argument("--simcluster", type=int, default=0, metavar="N", help="N namespace hosts, one rank each (root)")
    p.add_argument("--rate", default="1gbit", help="link rate of every namespace host (tc syntax)")
    p.add_argument("--subnet", default="10.77.57", help="namespace cluster subnet (first three octets)")
    p.add_argument("--batch", type=int, default=2, help="samples per rank per micro-batch")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--accum", type=int, default=2, help="micro-batches a step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warmup steps left out of the medians")
    p.add_argument("--launches", type=int, default=2, help="launches of each loop per model, load and round")
    p.add_argument("--delay", type=float, default=1.0, help="seconds a peer is late in the wait probe (0: no probe)")
    p.add_argument("--probe-repeats", type=int, default=2, help="waits per collective in the probe")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    args = p.parse_args(argv)
    models, loads = args.models.split(","), args.loads.split(",")
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown model '{m}' ({', '.join(MODELS)})")
    for load in loads:
        if load not in LOADS:
            p.error(f"--loads: unknown load '{load}' ({', '.join(LOADS)})")
    set_env()
    t_start = time.perf_counter()
    result: dict = {"models": {m: MODELS[m] for m in models}, "batch_per_rank": args.batch, "seq_len": args.seq_len,
                    "accum": args.accum, "steps": args.steps, "skip": args.skip, "busy_processes": args.busy,
                    "delay_s": args.delay, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="mlxyourloop-") as tmp, \
            namespace_hosts(args, Path(tmp), "yourloop", "mlxyl") as cluster:
        if cluster is not None:
            n, master = args.simcluster, cluster.ip(1)
            where = f"{n} ranks on {n} namespace hosts at {args.rate}"
            result |= {"hosts": n, "rate": args.rate}
        else:
            n, master = args.ranks, "127.0.0.1"
            where = f"{n} ranks on one host"
            result |= {"hosts": 1, "ranks": n}

        def launch(module: str, worker_args: list[str]) -> dict:
            out = Path(tmp) / "out.json"
            out.unlink(missing_ok=True)
            env = {"MLXDIST_DDP_MASTER": f"{master}:{_free_port()}", "MLXDIST_DDP_OUT": str(out)}
            os.environ.update(env)
            if cluster is not None:
                flags = cluster.mpirun_args(env=["OPENBLAS_NUM_THREADS", *env])
            else:
                flags = ["--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS",
                         *[x for k in env for x in ("-x", k)]]
            cmd = [find_mpirun(), *flags, "-np", str(n), sys.executable, "-m", module, *worker_args]
            check(subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO), module)
            return json.loads(out.read_text())

        print(f"{where}; {args.accum} micro-batches of {args.batch} x {args.seq_len} tokens per rank a step, "
              f"clipping, AdamW; median of steps {args.skip + 1}-{args.steps}; busy = {args.busy} busy-loop "
              f"processes beside the ranks", flush=True)
        for r in range(args.rounds):
            order = ("ddp", "yourloop") if r % 2 == 0 else ("yourloop", "ddp")
            got: dict = {"round": r + 1, "order": list(order), "load_avg": [round(x, 2) for x in os.getloadavg()]}
            for load in loads:
                with cpu_load(args.busy) if load == "busy" else contextlib.nullcontext():
                    got[load] = _one_load(launch, args, models, order)
                _print(r + 1, load, got[load])
            result["rounds"].append(got)
    _summary(result, models, loads, args.delay > 0)
    return finish("yourloop", result, t_start, args.json)


def _one_load(launch, args, models: list[str], order: tuple[str, str]) -> dict:
    """Both loops on every model, then the wait probe for both, under one load."""
    out: dict = {}
    kept = slice(args.skip, None)
    for m in models:
        runs: dict[str, list[dict]] = {loop: [] for loop in order}
        for k in range(args.launches):
            for loop in order if k % 2 == 0 else order[::-1]:
                sets = [x for s in MODELS[m] for x in ("--set", s)]
                runs[loop].append(launch("mlxdist.bench.ddp_worker", [
                    "--loop", loop, "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps",
                    str(args.steps), "--accum", str(args.accum), *sets]))
        row = {}
        for loop, got in runs.items():
            medians = [statistics.median(g["step_s"][kept]) for g in got]
            row[loop] = {"step_s": statistics.mean(medians), "launch_step_s": medians,
                         "cpu_s": statistics.mean(statistics.median(g["cpu_s"][kept]) for g in got),
                         "loss": got[0]["loss"]}
        row["ratio"] = row["yourloop"]["step_s"] / row["ddp"]["step_s"]
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(row["ddp"]["loss"], row["yourloop"]["loss"],
                                                              strict=True))
        out[m] = row
    if args.delay > 0:
        probe = {}
        for loop in order:
            got = launch("mlxdist.bench.waitprobe", ["--loop", loop, "--delay", str(args.delay), "--repeats",
                                                      str(args.probe_repeats)])
            probe[loop] = {k: {"cpu_s": statistics.median(v["cpu_s"]), "wall_s": statistics.median(v["wall_s"])}
                           for k, v in got["waits"].items()}
        out["wait"] = probe
    return out


def _print(r: int, load: str, got: dict) -> None:
    for m, row in got.items():
        if m == "wait":
            continue
        launches = " ".join(f"{loop} " + "/".join(f"{x * 1e3:.0f}" for x in row[loop]["launch_step_s"])
                            for loop in ("ddp", "yourloop"))
        print(f"round {r} {load:5s} {m:5s}: DDP {row['ddp']['step_s'] * 1e3:7.1f} ms/step "
              f"({row['ddp']['cpu_s'] * 1e3:.1f} ms CPU) | yourloop {row['yourloop']['step_s'] * 1e3:7.1f} ms/step "
              f"({row['yourloop']['cpu_s'] * 1e3:.1f} ms CPU) | yourloop / DDP = {row['ratio']:.3f}; losses within "
              f"{row['max_loss_diff']:.1e} (launches, ms: {launches})", flush=True)
    if "wait" in got:
        w = got["wait"]
        cells = " | ".join(f"{k} {w['yourloop'][k]['cpu_s'] * 1e3:.1f} vs {w['ddp'][k]['cpu_s'] * 1e3:.1f}"
                           for k in w["yourloop"])
        print(f"round {r} {load:5s} CPU ms of rank 0 over a wait (yourloop vs gloo): {cells}", flush=True)


def _summary(result: dict, models: list[str], loads: list[str], probed: bool) -> None:
    target = {"quiet": 1.05, "busy": 1.1}
    for load in loads:
        for m in models:
            ratios = [g[load][m]["ratio"] for g in result["rounds"]]
            print(f"{load:5s} {m:5s}: yourloop / DDP = {', '.join(f'{x:.3f}' for x in ratios)} "
                  f"(target <= {target[load]})")
        if probed:
            for kind in result["rounds"][0][load]["wait"]["yourloop"]:
                ours = [g[load]["wait"]["yourloop"][kind]["cpu_s"] * 1e3 for g in result["rounds"]]
                gloo = [g[load]["wait"]["ddp"][kind]["cpu_s"] * 1e3 for g in result["rounds"]]
                print(f"{load:5s} CPU over a {result['delay_s']:g} s wait, {kind:10s}: yourloop "
                      f"{', '.join(f'{x:.1f}' for x in ours)} ms; gloo {', '.join(f'{x:.1f}' for x in gloo)} ms")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
