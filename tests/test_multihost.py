"""Training across real namespace hosts: each backend end to end, unequal per-host
batches equal to one process, and the two failures users fear most (a host dies, a
cable is pulled) ending the job with a message instead of a hang.

Needs root (network namespaces); skips with the reason otherwise. Subnet 10.77.21.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, mpirun_path

from mlxdist.rig import simcluster
from mlxdist.rig.simcluster import SimCluster

pytestmark = [pytest.mark.cluster, pytest.mark.netns]

TRAIN = ["-m", "mlxdist.train", "data.source=synthetic", "data.seq_len=32", "metrics.port=0",
         "train.progress=false", "model.dtype=float32"]
STALL_S = 10.0
# Abort reaches every rank and mpirun tears the job down: seconds, not minutes.
MARGIN_S = 30.0



@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    ok, why = simcluster.available()
    if not ok:
        pytest.skip(why)
    # Ranks import mlxdist from this checkout wherever mpirun starts them.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)
    try:
        with SimCluster(2, name="mlxmh", subnet="10.77.21",
                        state_dir=tmp_path_factory.mktemp("mh")) as c:
            yield c
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _cmd(c: SimCluster, *args: str, config: Path | None = None) -> list[str]:
    # Options before the key=value overrides: argparse takes one run of positionals.
    head, tail = TRAIN[:2], TRAIN[2:]
    opts = ["--config", str(config)] if config else []
    return [mpirun_path(), *c.mpirun_args(), "-np", "2", sys.executable, *head, *opts, *tail, *args]


def _final_weights(out: Path) -> dict[str, np.ndarray]:
    from mlxdist import checkpoint

    last = sorted((out / "checkpoints").glob("step_*"))[-1]
    return checkpoint.load(last).weights


def _steps_logged(out: Path) -> int:
    log = out / "logs" / "rank0.jsonl"
    if not log.exists():
        return 0
    n = 0
    for line in log.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            n += json.loads(line).get("event") == "step"
    return n


@pytest.mark.parametrize("backend", ["mpi4py", "mlx-mpi", "mlx-ring"])
def test_train_two_hosts(cluster: SimCluster, tmp_path: Path, backend: str) -> None:
    res = subprocess.run(
        _cmd(cluster, "train.steps=4", "train.batch_size=4", f"dist.backend={backend}",
             f"train.out_dir={tmp_path}"),
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _steps_logged(tmp_path) == 4
    hosts = {json.loads(ln)["host"] for r in (0, 1)
             for ln in (tmp_path / "logs" / f"rank{r}.jsonl").read_text().splitlines()}
    assert hosts == set(cluster.hosts)
    assert all(np.isfinite(w).all() for w in _final_weights(tmp_path).values())


def test_unequal_batches_equal_single_process(cluster: SimCluster, tmp_path: Path) -> None:
    h1, h2 = cluster.hosts
    cfg = tmp_path / "nodes.yaml"
    cfg.write_text(f"nodes:\n  {h1}:\n    batch_size: 3\n  {h2}:\n    batch_size: 5\n")
    common = ["train.steps=3", "train.seed=7", "train.eval_every=0", "dist.backend=mpi4py"]
    multi, single = tmp_path / "multi", tmp_path / "single"
    res = subprocess.run(
        _cmd(cluster, *common, f"train.out_dir={multi}", config=cfg),
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    micro = json.loads((multi / "logs" / "rank0.jsonl").read_text().splitlines()[0]).get("micro")
    assert micro in (None, [3, 5]), micro
    res = subprocess.run(
        [sys.executable, *TRAIN, *common, "train.batch_size=8", f"train.out_dir={single}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a, b = _final_weights(multi), _final_weights(single)
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], atol=1e-5), (k, float(np.abs(a[k] - b[k]).max()))


class _Job:
    """mpirun in the background with its output collected by a thread, so a test can
    wait for a line and never blocks on a pipe that a cut-off host keeps open."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.out:
                return True
            if self.proc.poll() is not None:
                self._reader.join(2)
                return text in self.out
            time.sleep(0.1)
        return False

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _start_long_run(c: SimCluster, out: Path) -> _Job:
    job = _Job(_cmd(c, "train.steps=10000", "train.batch_size=4", "dist.backend=mpi4py",
                    f"dist.stall_timeout_s={STALL_S}", "checkpoint.every=0",
                    "train.eval_every=0", f"train.out_dir={out}"))
    deadline = time.monotonic() + 90
    while _steps_logged(out) < 3:
        if job.proc.poll() is not None:
            pytest.fail(f"run ended before the fault: {job.out[-3000:]}")
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail("no training progress within 90 s")
        time.sleep(0.2)
    return job


def test_killed_host_ends_job(cluster: SimCluster, tmp_path: Path) -> None:
    job = _start_long_run(cluster, tmp_path)
    t0 = time.monotonic()
    try:
        assert cluster.kill(2) >= 1
        code = job.wait(STALL_S + MARGIN_S)
        took = time.monotonic() - t0
        job._reader.join(5)
        out = job.out
    finally:
        job.kill()
        cluster.kill(2)
    assert code is not None, f"job still running {took:.0f}s after the host died:\n{out[-3000:]}"
    assert "done: step" not in out, out[-3000:]
    # prterun (Open MPI 5 wheel) exits 0 when it loses a node's daemon, printing
    # "A daemon failed to report back": its message stands in for the exit code there.
    assert code != 0 or "daemon failed" in out, out[-3000:]
    assert any(w in out.lower() for w in ("stalled", "abort", "lost", "terminated", "daemon")), \
        out[-3000:]


def test_cut_link_names_the_stall(cluster: SimCluster, tmp_path: Path) -> None:
    job = _start_long_run(cluster, tmp_path)
    t0 = time.monotonic()
    try:
        cluster.cut(2)
        named = job.wait_for("stalled", STALL_S + MARGIN_S)
        took = time.monotonic() - t0
        # The ranks on the host that can still talk to mpirun are gone after the abort.
        deadline = time.monotonic() + 15
        while cluster.pids(1) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = cluster.pids(1)
    finally:
        # prterun waits for the cut-off host's daemon to confirm the kill; with the
        # cable back it does, and the job ends.
        cluster.heal(2)
    code = job.wait(MARGIN_S)
    job.kill()
    cluster.kill(2)
    out = job.out
    assert named, f"no stall message {took:.0f}s after the cut:\n{out[-3000:]}"
    assert re.search(r"stalled \d+s in [a-z -]+", out), out[-3000:]
    # rank 0 (host 1, still connected) names the cut-off rank and its host
    assert f"no heartbeat from rank 1 ({cluster.hosts[1]})" in out, out[-3000:]
    assert took < STALL_S + MARGIN_S
    assert survivors == [], f"processes left on the connected host: {survivors}"
    assert code is not None and code != 0, f"exit {code} after heal:\n{out[-3000:]}"
    assert cluster.reachable(1, 2, timeout=3.0)
