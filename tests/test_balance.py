"""Load balancing end to end: real ranks, real timings, the global batch never changes.

The unit tests in test_control.py feed the balancer made-up timings; only a run with a
host that is really slower shows that measured compute times, the all-gather and the
re-split together move work to where it finishes soonest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, ROOT, env, mpirun_path, run_train

GLOBAL = 24


def _events(run_dir: Path) -> list[dict]:
    log = run_dir / "logs" / "rank0.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _balanced_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, subnet: str, slow,
                  steps: int, interval: int) -> Path:
    """A 2-host balanced run on namespace hosts, host 2 slowed by `slow(cluster)`; its run dir."""
    from mlxdist.rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    # mpirun_args forwards only variables set in this process's environment.
    for k, v in env().items():
        if k in ("PYTHONPATH", "OPENBLAS_NUM_THREADS"):
            monkeypatch.setenv(k, v)
    run_dir = tmp_path / "run"
    with SimCluster(2, name=name, subnet=subnet, state_dir=tmp_path / "sc") as c:
        slow(c)
        cmd = [mpirun_path(), *c.mpirun_args(env=["OPENBLAS_NUM_THREADS"]), "-np", "2",
               sys.executable, "-m", "mlxdist.train", *FAST, "data.seq_len=64",
               f"train.batch_size={GLOBAL}", f"train.global_batch={GLOBAL}", f"train.steps={steps}",
               "checkpoint.every=0", "control.balance=true", f"control.balance_interval={interval}",
               f"train.out_dir={run_dir}"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return run_dir


@pytest.mark.cluster
@pytest.mark.netns
def test_slow_host_gets_smaller_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Host 1 stays uncapped: under a CFS quota, rank 0's busy-wait in the collectives
    # for the slow rank burns its own quota, throttles its next compute and makes it
    # measure as slow as rank 1, so the equal split can persist for many steps.
    # Host 2 at 30% stays well under the fair share of a busy 2-core machine.
    run_dir = _balanced_run(tmp_path, monkeypatch, "mlxbt", "10.77.42", lambda c: c.slow(2, 30), 30, 2)
    events = _events(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 30
    assert all(sum(e["shares"]) == GLOBAL for e in steps), [e["shares"] for e in steps]
    assert steps[0]["shares"] == [GLOBAL // 2, GLOBAL // 2]
    assert [e for e in events if e["event"] == "balance"], "balancer never re-split"
    # Host 2 (rank 1) has at most a third of host 1's CPU: at most ~1/3 of the batch.
    final = steps[-1]["shares"]
    assert final[1] < 0.42 * GLOBAL, (final, [e["shares"] for e in steps])


@pytest.mark.cluster
def test_shares_always_sum_to_global_batch_localhost(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Unequal micro-batches make the first split unequal, so the balancer has work either way.
    res = run_train([*FAST, "train.steps=12", "train.global_batch=12", "checkpoint.every=0",
                     "control.balance=true", "control.balance_interval=1",
                     "nodes={rank0: {batch_size: 8}, rank1: {batch_size: 4}}",
                     f"train.out_dir={run_dir}"], np_=2, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 12
    assert steps[0]["shares"] == [8, 4]
    for e in steps:
        assert sum(e["shares"]) == 12 and min(e["shares"]) >= 1, e["shares"]
    for e in events:
        if e["event"] == "balance":
            assert sum(e["old"]) == sum(e["new"]) == 12, e



# ----- the rig's compute slowdown (a slower GPU, CPU left free) --------------------------


def test_compute_scale_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxdist.training.faults import COMPUTE_SCALE_VAR, Faults, compute_scale_from_env

    monkeypatch.delenv(COMPUTE_SCALE_VAR, raising=False)
    assert compute_scale_from_env() == 1.0 and Faults.from_env().compute_scale == 1.0
    monkeypatch.setenv(COMPUTE_SCALE_VAR, "2.5")
    assert Faults.from_env().compute_scale == 2.5
    for bad in ("0.5", "fast", "inf"):
        monkeypatch.setenv(COMPUTE_SCALE_VAR, bad)
        with pytest.raises(ValueError, match=f"{COMPUTE_SCALE_VAR}=.*>= 1"):
            compute_scale_from_env()


def test_stretch_compute_sleeps_the_missing_time() -> None:
    import time

    from mlxdist.training.faults import Faults

    assert Faults().stretch_compute(0.5) == 0.0  # no rig scale: no sleep at all
    t0 = time.perf_counter()
    slept = Faults(compute_scale=3.0).stretch_compute(0.05)
    assert slept == pytest.approx(0.1)
    assert time.perf_counter() - t0 >= 0.1  # sleep never returns early


SHOW = "import os,socket;print(socket.gethostname(), os.environ.get('MLXDIST_RIG_COMPUTE_SCALE'), len(os.sched_getaffinity(0)))"


@pytest.mark.cluster
@pytest.mark.netns
def test_compute_scale_reaches_only_that_hosts_processes(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from mlxdist.rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    # Set where mpirun runs: the host without a scale must not inherit it.
    monkeypatch.setenv("MLXDIST_RIG_COMPUTE_SCALE", "9")
    with SimCluster(2, name="mlxbalt", subnet="10.78.0", state_dir=tmp_path / "sc") as c:
        c.slow_compute(2, 2.5)
        res = subprocess.run([mpirun_path(), *c.mpirun_args(), "-np", "2", sys.executable, "-c", SHOW],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        cores = len(os.sched_getaffinity(0))
        # Every rank may use every core: namespace hosts share this machine's cores.
        assert sorted(res.stdout.split("\n")[:2]) == [f"mlxbalt1 None {cores}", f"mlxbalt2 2.5 {cores}"]
        direct = c.run(2, [sys.executable, "-c", SHOW], capture_output=True, text=True, timeout=30)
        assert direct.stdout.split() == ["mlxbalt2", "2.5", str(cores)]
        status = c.status()
        assert status["hosts"]["mlxbalt2"]["compute_scale"] == 2.5 and "compute_scale" in status["rig_only"]
        c.slow_compute(2, None)
        res = subprocess.run([mpirun_path(), *c.mpirun_args(), "-np", "2", sys.executable, "-c", SHOW],
                             capture_output=True, text=True, timeout=60)
        assert "2.5" not in res.stdout and res.stdout.count("None") == 2, res.stdout
        with pytest.raises(ValueError, match=">= 1"):
            c.slow_compute(1, 0.5)


@pytest.mark.cluster
@pytest.mark.netns
def test_cli_slow_compute(tmp_path: Path) -> None:
    from mlxdist.rig.simcluster import available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    cli = [sys.executable, "-m", "mlxdist.rig.simcluster", "--name", "mlxbalt", "--state-dir", str(tmp_path)]

    def run(*args: str) -> str:
        res = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60, env=env())
        assert res.returncode == 0, res.stderr
        return res.stdout

    try:
        run("up", "--hosts", "2", "--subnet", "10.78.0")
        run("slow", "2", "--compute", "2")
        status = json.loads(run("status"))["hosts"]["mlxbalt2"]
        assert status["compute_scale"] == 2.0 and status.get("cpu_percent") is None
        assert "scale=2.0" in (tmp_path / "ssh-agent").read_text()
        run("slow", "2")  # neither option: both lifted
        assert json.loads(run("status"))["hosts"]["mlxbalt2"]["compute_scale"] is None
        bad = subprocess.run([*cli, "slow", "2", "--compute", "0.5"], capture_output=True, text=True,
                             timeout=60, env=env())
        assert bad.returncode == 1 and "must be a finite number >= 1" in bad.stderr
    finally:
        subprocess.run([*cli, "down"], timeout=60, env=env())
    assert "mlxbalt-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.cluster
@pytest.mark.netns
def test_compute_slowed_host_gets_smaller_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mac-like slow host: 3x slower compute, CPU free. Balanced, its share is ~1/4."""
    run_dir = _balanced_run(tmp_path, monkeypatch, "mlxbalt", "10.78.0", lambda c: c.slow_compute(2, 3.0), 20, 1)
    assert "computes x3 slower" in (run_dir / "logs" / "rank1.log").read_text()
    steps = [e for e in _events(run_dir) if e["event"] == "step"]
    assert all(sum(e["shares"]) == GLOBAL for e in steps)
    final = steps[-1]["shares"]
    assert final[1] <= 0.34 * GLOBAL, [e["shares"] for e in steps]  # proportional: 6 of 24
