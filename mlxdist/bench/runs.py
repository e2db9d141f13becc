"""What the namespace-cluster benchmarks share: launching solo and cluster runs on
`SimCluster` hosts and reading their rates back from the event logs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..cluster.world import find_mpirun

REPO = Path(__file__).resolve().parents[2]


def set_env() -> None:
    """One BLAS thread per rank: the hosts share this machine's few cores, and extra
    threads only contend. Set in os.environ, not a copy: `mpirun_args` forwards only
    variables set here."""
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"


def read_events(run_dir: Path, rank: int = 0) -> list[dict]:
    log = run_dir / "logs" / f"rank{rank}.jsonl"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def steady_rate(events: list[dict], skip: int) -> float:
    """Samples/s over the step events after `skip`, timed by wall clock between events.

    Event timestamps rather than summed `step_s`: the time between two steps' events is
    everything the run spent, logging, all-gathers and outer syncs included.
    """
    steps = [e for e in events if e["event"] == "step"]
    if len(steps) < skip + 2:
        raise RuntimeError(f"only {len(steps)} steps logged; need more than {skip + 1}")
    kept = steps[skip:]
    seconds = kept[-1]["time"] - kept[0]["time"]
    samples = sum(sum(e["shares"]) for e in kept[1:])
    return samples / max(seconds, 1e-9)


def check(res: subprocess.CompletedProcess, what: str) -> None:
    if res.returncode != 0:
        out = (res.stdout or "") + (res.stderr or "")
        raise RuntimeError(f"{what} failed (exit {res.returncode}):\n{out[-3000:]}")


def solo_rates(cluster, args: list[str], tmp: Path, tag: str, skip: int, timeout: float) -> list[float]:
    """Every host alone, all at once: each faces the same contention for this machine's
    cores as in the cluster runs (which a real Mac would not). Their sum is the
    no-communication bound."""
    procs = []
    for h in range(1, len(cluster.hosts) + 1):
        run_dir = tmp / f"solo-{tag}-{h}"
        cmd = [sys.executable, "-m", "mlxdist.train", *args, f"train.out_dir={run_dir}"]
        procs.append((h, run_dir, cluster.popen(h, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                text=True, cwd=REPO)))
    rates = []
    for h, run_dir, proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        check(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), f"solo run on host {h}")
        rates.append(steady_rate(read_events(run_dir), skip))
    return rates


def bracketing_bounds(solos: list[list[float]]) -> list[float]:
    """The no-communication bound of each cluster run from the hosts' solo rates measured
    just before and just after it (`solos[i]`, `solos[i + 1]`): on a shared box the
    neighbours' load drifts over a bench's ten minutes, and a run compared with solo rates
    taken far from it reads that drift as its own speed."""
    return [sum((a + b) / 2 for a, b in zip(before, after, strict=True))
            for before, after in zip(solos[:-1], solos[1:], strict=True)]


def cluster_run(cluster, args: list[str], run_dir: Path, timeout: float) -> list[dict]:
    """One mpirun job over every host of the cluster; its rank-0 events."""
    n = len(cluster.hosts)
    cmd = [find_mpirun(), *cluster.mpirun_args(env=["OPENBLAS_NUM_THREADS"]), "-np", str(n),
           sys.executable, "-m", "mlxdist.train", *args, f"train.out_dir={run_dir}"]
    check(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO), f"{n}-rank run ({run_dir.name})")
    return read_events(run_dir)


def finish(name: str, result: dict, t_start: float, json_path: str | None) -> int:
    """Stamp the run's duration and the machine's load (these numbers are only as good as
    the box was quiet), write the JSON if asked, print the last line."""
    result["seconds"] = time.perf_counter() - t_start
    result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    print(f"bench {name}: {result['seconds']:.0f} s in all; load average {result['load_avg']}")
    return 0


@contextlib.contextmanager
def namespace_hosts(args, tmp: Path, bench: str, name: str):
    """None (ranks on this host), or `args.simcluster` namespace hosts joined by links shaped to
    `args.rate` on `args.subnet` (root), taken down on the way out."""
    if not args.simcluster:
        yield None
        return
    from ..rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        raise SystemExit(f"bench {bench}: cannot build namespace hosts: {why} (or run on one host: --simcluster 0)")
    with SimCluster(args.simcluster, name=name, subnet=args.subnet, state_dir=tmp / "cluster",
                    rate=args.rate) as cluster:
        yield cluster
