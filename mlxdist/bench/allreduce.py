"""All-reduce benchmark: our gradient sync (`GradSync` over `cluster/transport.py`) on each
backend against raw mpi4py (the one place outside `cluster/` that calls MPI: it is the baseline).

Run it plainly and it launches itself under `mpirun` (on this machine, or on a
namespace cluster whose links are shaped to a given rate), one launch per process
family, because MLX initialises one distributed backend per process and its MPI
backend must own MPI_Init. Each launch writes its rank-0 results as JSON; the
launcher merges them into one table, so all transports line up by message size.

    python -m mlxdist.bench.allreduce                     # localhost, 2 ranks
    python -m mlxdist.bench.allreduce --quick
    python -m mlxdist.bench.allreduce --simcluster 2 --rate 1gbit --sizes 64M,256M
    python -m mlxdist.bench.allreduce --hostfile hostfiles/studio+macbook.hosts --iface 192.168.1.0/24
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cluster.world import launched_by_mpirun

TRANSPORTS = ("raw-mpi4py", "mpi4py", "mlx-mpi", "mlx-ring")
# Which launch measures which transport: the pure-mpi4py ones share a process.
_FAMILIES = {"mpi4py": ("raw-mpi4py", "mpi4py"), "mlx-mpi": ("mlx-mpi",), "mlx-ring": ("mlx-ring",)}
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
          "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}
# Arrays a fake model's gradients are split into: bucketing and unpacking get exercised.
_GRAD_PIECE = 4 * 2**20


def parse_size(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("BKMGI")
    unit = t[len(num):]
    if unit not in _UNITS or not num:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 4096, 64K, 256M)")
    return int(float(num) * _UNITS[unit])


def human_size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def default_sizes(quick: bool) -> list[int]:
    top = 4 * 2**20 if quick else 256 * 2**20
    sizes, s = [], 1024
    while s <= top:
        sizes.append(s)
        s *= 16 if quick else 4
    return sizes


def iterations(nbytes: int, quick: bool) -> int:
    """Enough repeats for a stable median, few enough that big sizes stay affordable."""
    n = 20 if nbytes <= 2**20 else 8 if nbytes <= 16 * 2**20 else 3
    return max(2, n // 3) if quick else n


def busbw_gbs(nbytes: int, seconds: float, n: int) -> float:
    """NCCL-style bus bandwidth: what each link carried, comparable across rank counts."""
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--np", dest="np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--simcluster", type=int, metavar="HOSTS", default=0,
                   help="run on a namespace cluster of HOSTS hosts (needs root)")
    p.add_argument("--hostfile", default=None, help="real hosts (the same checkout and environment on each), "
                   "one rank per slot: measure between your Macs")
    p.add_argument("--iface", default=None, help="with --hostfile: the network MPI uses (CIDR or interface)")
    p.add_argument("--rate", default=None, help="link rate of the cluster, e.g. 1gbit, 10gbit")
    p.add_argument("--subnet", default="10.77.29", help="cluster subnet (first three octets)")
    p.add_argument("--sizes", default=None,
                   help="comma list of message sizes (e.g. 64M,256M), added to the default list "
                        "unless --only-sizes")
    p.add_argument("--only-sizes", action="store_true", help="measure --sizes only")
    p.add_argument("--quick", action="store_true", help="few small sizes, few repeats")
    p.add_argument("--iters", type=int, default=0, help="repeats per size (default: by size)")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"comma list out of {','.join(TRANSPORTS)}")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="GradSync bucket size")
    p.add_argument("--wire-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype on the wire (dist.wire_dtype)")
    p.add_argument("--ring-connections", type=int, default=1, help="TCP connections per peer for mlx-ring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mpirun launch")
    p.add_argument("--json", default=None, help="also write the merged results here")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    return p


def _sizes(args: argparse.Namespace) -> list[int]:
    extra = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else []
    if args.only_sizes and extra:
        return sorted(set(extra))
    return sorted(set(default_sizes(args.quick)) | set(extra))


# --------------------------------------------------------------------------- a rank


def _worker(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import numpy as np

    from ..cluster.transport import make_transport
    from ..cluster.world import init_world
    from ..sync.grad import GradSync

    family = args._worker
    world = init_world(family)
    world.start_watchdog(max(60.0, args.timeout / 2))
    n, rank = world.size, world.rank
    wanted = [t for t in args.transports.split(",") if t in _FAMILIES[family]]
    transport = make_transport(world, family, args.ring_connections) if (
        set(wanted) - {"raw-mpi4py"}) else None
    sync = GradSync(transport, args.bucket_mb, args.wire_dtype) if transport else None
    results: dict[str, dict[str, float]] = {t: {} for t in wanted}
    expect = n * (n + 1) / 2

    def timed(fn) -> float:
        world.barrier("bench barrier")
        t0 = time.perf_counter()
        fn()
        return max(world.allgather(time.perf_counter() - t0))  # the slowest rank is the job's time

    for nbytes in _sizes(args):
        elems = max(1, nbytes // 4)
        iters = args.iters or iterations(nbytes, args.quick)
        for t in wanted:
            if t == "raw-mpi4py":  # the baseline: Open MPI's Allreduce, nothing of ours
                from mpi4py import MPI

                src = np.full(elems, rank + 1, dtype=np.float32)
                dst = np.empty_like(src)

                def step(src=src, dst=dst) -> None:
                    MPI.COMM_WORLD.Allreduce(src, dst, op=MPI.SUM)

                step()
                ok = bool(np.all(dst == expect))
            else:
                pieces = [min(_GRAD_PIECE // 4, elems - i) for i in range(0, elems, _GRAD_PIECE // 4)]
                grads = [mx.full((k,), rank + 1, dtype=mx.float32) for k in pieces]
                mx.eval(grads)
                sync.forget_layout()  # a new gradient layout per size
                box: list = []

                def step(grads=grads, box=box) -> None:
                    out, _ = sync.all_sum(grads)
                    mx.eval(out)
                    box[:] = out

                step()
                ok = all(bool(mx.all(o == expect).item()) for o in box)
            if not ok:
                world.abort(f"{t}: wrong all-reduce sum at {human_size(nbytes)}")
            times = [timed(step) for _ in range(iters)]
            results[t][str(nbytes)] = statistics.median(times)
            del step
    if rank == 0:
        Path(args._out).write_text(json.dumps({"n": n, "results": results}))
    world.barrier("bench end")
    return 0


# --------------------------------------------------------------------------- the launcher



def _forwarded(argv: list[str]) -> list[str]:
    """The user's options, minus those only the launcher acts on."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in ("--simcluster", "--rate", "--subnet", "-np", "--np", "--json", "--hostfile", "--iface"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _launch(args: argparse.Namespace, argv: list[str], cluster, tmp: Path) -> dict:
    from ..cluster.world import default_mpi_library, find_mpirun
    from ..launch.mpirun import mpirun_command

    wanted = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(wanted) - set(TRANSPORTS)
    if unknown:
        raise SystemExit(f"unknown transport(s): {', '.join(sorted(unknown))}")
    env = dict(os.environ, MLX_MPI_LIBNAME=default_mpi_library(find_mpirun()))
    os.environ["MLX_MPI_LIBNAME"] = env["MLX_MPI_LIBNAME"]  # forwarded by the cluster too
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    tuning = [k for k in os.environ if k.startswith(("MLXDIST_", "OMPI_MCA_"))]
    if cluster is not None:
        base = mpirun_command([], **cluster.mpirun_options(), env=tuning)
    elif args.hostfile:
        from ..launch.job import plan_hostfile

        launch = plan_hostfile(args.hostfile, None, args.iface)
        for note in launch.notes:
            print(f"bench: {note}", file=sys.stderr)
        args.np = launch.n_ranks if "-np" not in argv and "--np" not in argv else args.np
        base = mpirun_command([], hostfile=launch.hostfile, ssh_agent=launch.ssh_agent, network=launch.network,
                              env=["MLX_MPI_LIBNAME", "PYTHONPATH", *tuning, *launch.exports])
    else:
        base = [*mpirun_command([], env=["MLX_MPI_LIBNAME"]), "--oversubscribe"]
    merged: dict = {"n": args.np, "results": {}}
    for family, members in _FAMILIES.items():
        if not set(members) & set(wanted):
            continue
        out = tmp / f"{family}.json"
        cmd = [*base, "-np", str(args.np), sys.executable, "-m", "mlxdist.bench.allreduce",
               *_forwarded(argv), "--_worker", family, "--_out", str(out)]
        t0 = time.monotonic()
        try:
            res = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            print(f"bench: {family}: timed out after {args.timeout:.0f}s", file=sys.stderr)
            continue
        if res.returncode != 0 or not out.exists():
            print(f"bench: {family}: mpirun exited {res.returncode}\n{res.stdout[-2000:]}"
                  f"{res.stderr[-4000:]}", file=sys.stderr)
            continue
        print(f"bench: {family} done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        data = json.loads(out.read_text())
        merged["n"] = data["n"]
        merged["results"].update(data["results"])
    return merged


def format_table(merged: dict, rate_bits: float | None) -> str:
    from ..rig.simcluster import link_limit_seconds

    n, res = merged["n"], merged["results"]
    names = [t for t in TRANSPORTS if t in res]
    sizes = sorted({int(s) for t in names for s in res[t]})
    head = f"{'size':>9}"
    if rate_bits:
        head += f" {'limit ms':>9}"
    for t in names:
        head += f" | {t + ' ms':>15} {'GB/s':>6}" + (f" {'%lim':>5}" if rate_bits else "")
    lines = [f"all-reduce (sum, fp32), {n} ranks; busbw = bytes/time*2(n-1)/n"
             + (f"; link limit 2(n-1)/n*bytes/rate at {rate_bits / 1e9:g} Gbit/s" if rate_bits
                else ""), head, "-" * len(head)]
    for s in sizes:
        row = f"{human_size(s):>9}"
        limit = link_limit_seconds(s, n, rate_bits) if rate_bits else 0.0
        if rate_bits:
            row += f" {limit * 1e3:9.2f}"
        for t in names:
            sec = res[t].get(str(s))
            if sec is None:
                row += f" | {'-':>15} {'-':>6}" + (f" {'-':>5}" if rate_bits else "")
                continue
            row += f" | {sec * 1e3:15.3f} {busbw_gbs(s, sec, n):6.3g}"
            if rate_bits:
                row += f" {100 * limit / sec:4.0f}%"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args._worker:
        return _worker(args)

    if launched_by_mpirun():
        raise SystemExit("run the benchmark without mpirun: it launches its own ranks")
    rate_bits = None
    cluster = None
    with tempfile.TemporaryDirectory(prefix="mlxdist-bench-") as tmpdir:
        tmp = Path(tmpdir)
        if args.simcluster and args.hostfile:
            raise SystemExit("--simcluster and --hostfile: give one")
        if args.simcluster:
            from ..rig.simcluster import SimCluster, available, parse_rate

            ok, why = available()
            if not ok:
                raise SystemExit(f"--simcluster: {why}")
            rate_bits = parse_rate(args.rate) if args.rate else None
            args.np = args.simcluster if "-np" not in argv and "--np" not in argv else args.np
            os.chmod(tmp, 0o755)
            cluster = SimCluster(args.simcluster, name="mlxbench", subnet=args.subnet,
                                 rate=args.rate, state_dir=tmp / "cluster")
            with cluster:
                merged = _launch(args, argv, cluster, tmp)
        else:
            merged = _launch(args, argv, None, tmp)
    if not merged["results"]:
        print("bench: no transport produced results", file=sys.stderr)
        return 1
    merged["rate_bits"] = rate_bits
    print(format_table(merged, rate_bits))
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=1))
    missing = [t for t in args.transports.split(",") if t and t not in merged["results"]]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
