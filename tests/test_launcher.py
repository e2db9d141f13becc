import subprocess
import sys

import pytest
from helpers import ROOT, env

from mlxdist.launcher import read_hostfile


def _mlxrun(*args):
    return subprocess.run([sys.executable, str(ROOT / "launch" / "mlxrun"), *args], capture_output=True,
                          text=True, env=env(), timeout=60)


def test_dry_run_prints_mpirun_command():
    r = _mlxrun("--hostfile", str(ROOT / "hostfiles" / "localhost.hosts"), "--dry-run", "--tcp-links", "4",
                "--", "--config", "configs/cluster.yaml")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip()
    for part in ("-np 2", "--bind-to none", "btl_tcp_links 4", "MLX_MPI_LIBNAME=libmpi.so.40",
                 "-m mlxdist.train --config configs/cluster.yaml"):
        assert part in cmd


def test_unreachable_host_is_named(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=1\nno-such-mac.invalid slots=1\n")
    r = _mlxrun("--hostfile", str(hf), "--dry-run")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: hostfile") and "'no-such-mac.invalid' does not resolve" in r.stderr


def test_bad_hostfile_line(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("studio slots=2 colour=blue\n")
    r = _mlxrun("--hostfile", str(hf))
    assert r.returncode == 2 and f"{hf}:1" in r.stderr and "colour=blue" in r.stderr
    assert [h.slots for h in read_hostfile(ROOT / "hostfiles" / "studio+macbook.hosts")] == [1, 1]


def test_launch_runs_training_on_localhost(tmp_path):
    r = _mlxrun("--hostfile", str(ROOT / "hostfiles" / "localhost.hosts"), "--", "data.source=synthetic",
                "data.seq_len=16", "train.steps=2", "metrics.port=0", f"train.out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "2 rank(s)" in r.stderr and (tmp_path / "checkpoints" / "step_00000002").is_dir()


def test_supervisor_ends_a_job_that_mpirun_would_leave_hanging():
    import time

    from mlxdist.launcher import supervise

    t0 = time.time()
    code = supervise(["sh", "-c", "echo 'mlxdist: rank 1 (mac2): stalled 10s in gradient all-reduce' >&2; "
                      "sleep 60"], grace=1)
    assert code != 0 and time.time() - t0 < 15


def test_supervisor_turns_a_lost_daemon_into_failure():
    from mlxdist.launcher import supervise

    assert supervise(["sh", "-c", "echo 'A daemon failed to report back' >&2; exit 0"], grace=1) == 1
    assert supervise(["sh", "-c", "echo all good; exit 0"], grace=1) == 0


@pytest.mark.cluster
@pytest.mark.netns
def test_mlxrun_rehearses_on_a_simulated_cluster(tmp_path):
    from mlxdist.rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    with SimCluster(2, name="mlxrunt", subnet="10.77.31"):
        r = _mlxrun("--simcluster", "mlxrunt", "--", "data.source=synthetic", "data.seq_len=16",
                    "train.steps=2", "metrics.port=0", f"train.out_dir={tmp_path}", "dist.backend=mlx-mpi")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "on mlxrunt1, mlxrunt2" in r.stderr and (tmp_path / "checkpoints" / "step_00000002").is_dir()
    r = _mlxrun("--simcluster", "nosuchcluster", "--dry-run")
    assert r.returncode == 2 and "launch/simcluster up" in r.stderr
