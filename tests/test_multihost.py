"""Training across real namespace hosts: each backend end to end, unequal per-host
batches equal to one process, and the two failures users fear most (a host dies, a
cable is pulled) ending the job with a message instead of a hang. Then, on three hosts,
how a job under launch/mlxrun ends: the exit code for a lost host or a stall, nothing left
running afterwards, Ctrl-C as a saved stop, and a resume on the hosts that are left.

Needs root (network namespaces); skips with the reason otherwise. Subnets 10.77.21, 10.79.0.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, env, mpirun_path, namespace_cluster

from mlxdist.rig.simcluster import SimCluster

pytestmark = [pytest.mark.cluster, pytest.mark.netns]

TRAIN = ["-m", "mlxdist.train", "data.source=synthetic", "data.seq_len=32", "metrics.port=0",
         "train.progress=false", "model.dtype=float32"]
STALL_S = 10.0
# Abort reaches every rank and mpirun tears the job down: seconds, not minutes.
MARGIN_S = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from namespace_cluster(tmp_path_factory, 2, "mlxmh", "10.77.21")

def _cmd(c: SimCluster, *args: str, config: Path | None = None) -> list[str]:
    # Options before the key=value overrides: argparse takes one run of positionals.
    head, tail = TRAIN[:2], TRAIN[2:]
    opts = ["--config", str(config)] if config else []
    return [mpirun_path(), *c.mpirun_args(), "-np", "2", sys.executable, *head, *opts, *tail, *args]


def _final_weights(out: Path) -> dict[str, np.ndarray]:
    from mlxdist.state import checkpoint

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
    # Sharded (ZeRO-2) between the hosts: the exchange takes mlxdist's pipelined ring, with
    # ranges of 4:1 (memory targets 0.8 and 0.2): the same weights again.
    sharded = tmp_path / "sharded"
    cfg.write_text(f"nodes:\n  {h1}:\n    batch_size: 3\n    memory_target: 0.8\n"
                   f"  {h2}:\n    batch_size: 5\n    memory_target: 0.2\n")
    res = subprocess.run(_cmd(cluster, *common, "dist.shard=gradients", f"train.out_dir={sharded}", config=cfg),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(80%)" in res.stderr and "exchange: pipelined ring" in res.stderr, res.stderr[-3000:]
    b = _final_weights(single)
    for a in (_final_weights(multi), _final_weights(sharded)):
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
    # "A daemon failed to report back" or "PRTE has lost communication with a remote daemon":
    # its message stands in for the exit code there (launch/mlxrun turns it into exit 4).
    assert code != 0 or "daemon failed" in out or "lost communication" in out, out[-3000:]
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


# ----- how a job ends under launch/mlxrun: 3 hosts (name mlxlt, subnet 10.79.0) ---------

MLXRUN = [sys.executable, str(ROOT / "launch" / "mlxrun")]
LONG = ["train.steps=10000", "train.batch_size=4", "dist.backend=mpi4py", f"dist.stall_timeout_s={STALL_S}",
        "checkpoint.every=0", "train.eval_every=0", "model.preset=tiny", "data.seq_len=16"]


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory):
    yield from namespace_cluster(tmp_path_factory, 3, "mlxlt", "10.79.0")

def _train_args(out: Path, *args: str) -> list[str]:
    return [*TRAIN[2:], *LONG, f"train.out_dir={out}", *args]


def _mlxrun_job(c: SimCluster, out: Path, *args: str, opts: tuple[str, ...] = ()) -> _Job:
    return _Job([*MLXRUN, "--simcluster", str(c.state_dir), *opts, "--", *_train_args(out, *args)])


def _until_steps(job: _Job, out: Path, n: int = 3) -> None:
    deadline = time.monotonic() + 90
    while _steps_logged(out) < n:
        if job.proc.poll() is not None:
            pytest.fail(f"run ended before the fault: {job.out[-3000:]}")
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail("no training progress within 90 s")
        time.sleep(0.2)


def _rank_pids(c: SimCluster, host: int) -> list[int]:
    """The training processes (not Open MPI's daemon) running on `host`."""
    pids = []
    for pid in c.pids(host):
        with contextlib.suppress(OSError):
            if b"mlxdist.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    assert pids, f"no training process on host {host}"
    return pids


def _leftovers(c: SimCluster, wait: float = 5.0) -> dict[str, list[int]]:
    deadline = time.monotonic() + wait
    while True:
        left = {h: c.pids(h) for h in c.hosts if c.pids(h)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _ends(out: Path, n: int) -> list[dict]:
    ends = []
    for r in range(n):
        events = [json.loads(ln) for ln in (out / "logs" / f"rank{r}.jsonl").read_text().splitlines()]
        ends += [e for e in events if e["event"] == "end"]
    return ends


def _assert_saved_stop(out: Path, n: int, first: int = 3) -> None:
    ends = _ends(out, n)
    assert len(ends) == n and {e["reason"] for e in ends} == {"signal"}, ends
    steps = {e["step"] for e in ends}
    assert len(steps) == 1, f"ranks stopped at different steps: {ends}"
    step = steps.pop()
    assert step >= first and (out / "checkpoints" / f"step_{step:08d}" / "manifest.json").is_file()


ENGINE_ARGS = {"mlx": (), "torch": ("--engine", "torch", "--device", "cpu")}


@pytest.mark.parametrize("host, engine", [(2, "mlx"), (3, "mlx"), (2, "torch")])
def test_lost_host_is_a_failure(cluster3: SimCluster, tmp_path: Path, host: int, engine: str) -> None:
    job = _mlxrun_job(cluster3, tmp_path, *ENGINE_ARGS[engine])
    try:
        _until_steps(job, tmp_path)
        assert cluster3.kill(host) >= 1
        code = job.wait(STALL_S + MARGIN_S)
    finally:
        job.kill()
    out = job.out
    assert code == 4, f"exit {code}:\n{out[-3000:]}"
    assert "mlxrun: job failed: a host was lost" in out and "done: step" not in out
    assert _leftovers(cluster3) == {}


def test_preflight_names_two_hosts_that_cannot_reach_each_other(cluster3: SimCluster, tmp_path: Path) -> None:
    """Host 3's cable is out: the launching machine still reaches it through the stand-in (as
    over another interface), but hosts 1 and 2 cannot. mlxrun says so before mpirun hangs."""
    cluster3.cut(3)
    try:
        r = subprocess.run([*MLXRUN, "--simcluster", str(cluster3.state_dir), "--dry-run", "--",
                            *_train_args(tmp_path)], capture_output=True, text=True, timeout=120, env=env())
    finally:
        cluster3.heal(3)
    assert r.returncode == 2, r.stdout + r.stderr
    ip3 = cluster3.ip(3)
    assert f"host '{cluster3.ip(1)}' cannot reach host '{ip3}'" in r.stderr, r.stderr
    r = subprocess.run([*MLXRUN, "--simcluster", str(cluster3.state_dir), "--dry-run", "--", *_train_args(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env())
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_ctrl_c_to_mlxrun_saves_at_one_step(cluster3: SimCluster, tmp_path: Path, engine: str) -> None:
    job = _mlxrun_job(cluster3, tmp_path, *ENGINE_ARGS[engine])
    try:
        _until_steps(job, tmp_path)
        job.proc.send_signal(signal.SIGINT)
        code = job.wait(60)
    finally:
        job.kill()
    assert code == 0, f"exit {code}:\n{job.out[-3000:]}"
    assert "continue with --resume auto" in job.out
    _assert_saved_stop(tmp_path, 3)
    assert _leftovers(cluster3) == {}


def test_ctrl_c_while_ranks_start_is_held_until_they_can_save(cluster3: SimCluster, tmp_path: Path) -> None:
    job = _mlxrun_job(cluster3, tmp_path)
    try:
        assert job.wait_for("mlxdist_job=", 30)  # mlxrun printed the command: ranks are starting
        job.proc.send_signal(signal.SIGINT)
        code = job.wait(60)
    finally:
        job.kill()
    assert code == 0, f"exit {code}:\n{job.out[-3000:]}"
    assert "ranks ready; passing the stop on when all are" in job.out
    _assert_saved_stop(tmp_path, 3, first=1)


def test_sigusr1_to_plain_mpirun_saves_at_one_step(cluster3: SimCluster, tmp_path: Path) -> None:
    from mlxdist.launch.mpirun import mpirun_command

    cmd = mpirun_command([sys.executable, "-m", "mlxdist.train", *_train_args(tmp_path)],
                         **cluster3.mpirun_options(), np=3, mpirun=mpirun_path())
    job = _Job(cmd)
    try:
        _until_steps(job, tmp_path)
        job.proc.send_signal(signal.SIGUSR1)
        code = job.wait(60)
    finally:
        job.kill()
    assert code == 0, f"exit {code}:\n{job.out[-3000:]}"
    _assert_saved_stop(tmp_path, 3)


def test_second_ctrl_c_ends_at_once(cluster3: SimCluster, tmp_path: Path) -> None:
    job = _mlxrun_job(cluster3, tmp_path)
    frozen: list[int] = []
    try:
        _until_steps(job, tmp_path)
        # A frozen rank keeps "finish this step" from ending, so the second Ctrl-C must end
        # the job (a CPU cap alone let a loaded CI box save before the second one arrived).
        frozen = _rank_pids(cluster3, 2)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        job.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # Python merges two signals that arrive before its handler runs
        t0 = time.monotonic()
        job.proc.send_signal(signal.SIGINT)
        code = job.wait(30)
        took = time.monotonic() - t0
    finally:
        for pid in frozen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        job.kill()
    assert code == 130, f"exit {code}:\n{job.out[-3000:]}"
    assert took < 10, f"took {took:.1f}s"
    assert _leftovers(cluster3) == {}


def test_resume_on_a_subset_of_hosts(cluster3: SimCluster, tmp_path: Path) -> None:
    short = ["train.steps=3", "checkpoint.every=3"]
    res = subprocess.run([*MLXRUN, "--simcluster", cluster3.name, "--", *_train_args(tmp_path, *short)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    # Host 3 is gone: go on from step 3 on hosts 1 and 2, found by the cluster's name alone.
    res = subprocess.run([*MLXRUN, "--simcluster", cluster3.name, "--hosts", "1,mlxlt2", "--",
                          "--resume", "auto", *_train_args(tmp_path, "train.steps=5")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "-np 2" in res.stdout and "on mlxlt1, mlxlt2;" in res.stderr, res.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step_00000005").is_dir()
    steps = [json.loads(ln) for ln in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"] == [1, 2, 3, 4, 5]
    assert [e["shares"] for e in steps if e["event"] == "step"][-1] == [4, 4]


def test_mlxrun_hostfile_reaches_namespace_hosts(cluster3: SimCluster, tmp_path: Path) -> None:
    res = subprocess.run([*MLXRUN, "--hostfile", str(cluster3.hostfile), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "using its ssh stand-in" in res.stderr and f"plm_ssh_agent {cluster3.ssh_agent}" in res.stdout
    stray = tmp_path / "hosts"
    stray.write_text(f"{cluster3.ip(1)} slots=1\n10.79.0.9 slots=1\n")
    res = subprocess.run([*MLXRUN, "--hostfile", str(stray), "--ssh-agent", str(cluster3.ssh_agent), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and f"hostfile {stray}: host '10.79.0.9' cannot run commands" in res.stderr, \
        res.stderr


# Last in the module: a host whose link was cut and healed can fail its next daemon start
# for a while (seen once under load: 'A daemon failed to report back' on the healed host).
def test_cut_link_ends_in_stall_time_and_leaves_nothing(cluster3: SimCluster, tmp_path: Path) -> None:
    job = _mlxrun_job(cluster3, tmp_path)
    try:
        _until_steps(job, tmp_path)
        t0 = time.monotonic()
        cluster3.cut(3)
        code = job.wait(STALL_S + MARGIN_S)
        took = time.monotonic() - t0
        left = _leftovers(cluster3, wait=0)  # before the cable is back: nothing may wait for it
    finally:
        cluster3.heal(3)
        job.kill()
        # The next test needs the cable really back (a fresh bridge port takes a moment).
        deadline = time.monotonic() + 20
        while not cluster3.reachable(3, 1) and time.monotonic() < deadline:
            time.sleep(0.5)
    out = job.out
    assert code == 3, f"exit {code} after {took:.0f}s:\n{out[-3000:]}"
    # Watchdog (stall timeout + its 1 s tick), mpirun's grace (3 s + 1 s), cleanup: ~STALL_S + 6 s
    # unloaded; the bound leaves room for a busy machine. Before: only once the link healed.
    assert took < STALL_S + 20, f"took {took:.1f}s"
    assert re.search(r"stalled \d+s in [a-z -]+", out)
    assert left == {}, f"left running with the link still cut: {left}"
