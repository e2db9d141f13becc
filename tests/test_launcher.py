import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, env

from mlxdist.cluster.world import default_mpi_library, mpi_library
from mlxdist.launch.hosts import read_hostfile
from mlxdist.launch.mpirun import mpirun_command
from mlxdist.launch.supervisor import supervise
from mlxdist.markers import (
    Exit,
    abort_line,
    complete_line,
    parse_abort,
    parse_complete,
    parse_ready,
    ready_line,
)


def _mlxrun(*args):
    return subprocess.run([sys.executable, str(ROOT / "launch" / "mlxrun"), *args], capture_output=True,
                          text=True, env=env(), timeout=60)


def test_dry_run_prints_mpirun_command():
    r = _mlxrun("--hostfile", str(ROOT / "hostfiles" / "localhost.hosts"), "--dry-run", "--tcp-links", "4",
                "--", "--config", "configs/cluster.yaml")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip()
    for part in ("-np 2", "--bind-to none", "btl_tcp_links 4", "btl self,sm,tcp",  # one host: shared memory
                 "-m mlxdist.train --config configs/cluster.yaml"):
        assert part in cmd
    # an absolute path inside the environment, so no library search path is needed
    assert f"/lib/{mpi_library(sys.platform, None)} " in cmd.split("MLX_MPI_LIBNAME=/", 1)[1]


def test_mlxrun_from_a_plain_python3_runs_in_the_environment(tmp_path):
    """What a Mac user types first: `launch/mlxrun` with the system python3 and no activated
    environment. It re-runs itself with the environment's Python and its mpirun."""
    import os
    import shutil

    system = shutil.which("python3", path="/usr/bin:/bin")
    env_python = os.environ.get("VIRTUAL_ENV") and Path(os.environ["VIRTUAL_ENV"]) / "bin" / "python"
    if system is None or not env_python or Path(sys.prefix).resolve() == Path(system).resolve().parents[1]:
        pytest.skip("needs a system python3 in /usr/bin and the tests run from a virtual environment")
    r = subprocess.run([system, str(ROOT / "launch" / "mlxrun"), "--hostfile", str(ROOT / "hostfiles" / "localhost.hosts"),
                        "--dry-run", "--", "train.steps=1"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
                            "VIRTUAL_ENV": os.environ["VIRTUAL_ENV"]})
    assert r.returncode == 0, r.stderr
    mpirun, *rest = r.stdout.split()
    assert Path(mpirun) == Path(sys.executable).parent / "mpirun"
    assert str(Path(sys.executable).parent / "python") in rest


def test_mpirun_beside_the_interpreter_wins_over_path(tmp_path, monkeypatch):
    from mlxdist.cluster.world import find_mpirun

    for d in ("env/bin", "other"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "mpirun").write_text("#!/bin/sh\n")
        (tmp_path / d / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "other"))
    assert find_mpirun(str(tmp_path / "env" / "bin" / "python")) == str(tmp_path / "env" / "bin" / "mpirun")
    assert find_mpirun(str(tmp_path / "nowhere" / "python")) == str(tmp_path / "other" / "mpirun")


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


def _sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def test_supervisor_ends_a_stalled_job_that_mpirun_would_leave_hanging():
    line = abort_line("rank 1 (mac2)", "stalled 10s in gradient all-reduce", "stalled")
    t0 = time.monotonic()
    code = supervise(_sh(f"echo '{line}' >&2; sleep 60"), grace=1)
    assert code == Exit.STALLED and time.monotonic() - t0 < 15


def test_supervisor_exits_zero_only_after_the_completion_record():
    assert supervise(_sh(f"echo '{complete_line(5, 'completed')}'; exit 0")) == Exit.OK
    # mpirun's exit 0 alone proves nothing: Open MPI 5 exits 0 when a host's daemon dies.
    assert supervise(_sh("echo all good; exit 0")) == Exit.FAILED
    assert supervise(_sh("echo 'PRTE has lost communication with a remote daemon.' >&2; exit 0"),
                     grace=1) == Exit.HOST_LOST
    assert supervise(_sh(f"echo '{abort_line('rank 0 (a)', 'boom', 'error')}' >&2; exit 1"), grace=1) == Exit.FAILED
    assert supervise(_sh("echo 'error: configs/x.yaml: unknown key' >&2; exit 2")) == Exit.USAGE


def test_markers_round_trip():
    assert parse_complete("x " + complete_line(12, "early stopping")) == (12, "early stopping")
    assert parse_abort(abort_line("rank 1 (h)", "stalled 3s in x", "stalled")) == "stalled"
    assert parse_abort("mlxdist: rank 1 (h): stalled 3s in x") is None
    assert parse_ready(ready_line(3)) == 3 and parse_ready(ready_line(3) + ready_line(4)) is None


def test_one_mpirun_builder(tmp_path, monkeypatch):
    from mlxdist.rig.simcluster import SimCluster

    monkeypatch.setenv("FOO", "1")
    c = SimCluster(3, name="mlxlt", subnet="10.79.0", state_dir=tmp_path)
    cmd = mpirun_command(["prog"], **c.mpirun_options(["mlxlt3", 1]), np=2, env=["FOO", "BAR"], mpirun="mpirun")
    pairs = list(zip(cmd, cmd[1:], strict=False))
    assert ("--hostfile", str(tmp_path / "hostfile-1-3")) in pairs and cmd[-3:] == ["-np", "2", "prog"]
    assert ("plm_ssh_agent", str(c.ssh_agent)) in pairs and ("btl_tcp_if_include", "10.79.0.0/24") in pairs
    assert ("-x", "FOO") in pairs and ("-x", "BAR") not in pairs
    assert ("-x", f"MLX_MPI_LIBNAME={default_mpi_library('mpirun')}") in pairs
    assert ("btl", "tcp,self") in pairs  # two hosts
    assert (tmp_path / "hostfile-1-3").read_text() == "10.79.0.1 slots=1\n10.79.0.3 slots=1\n"
    assert c.mpirun_args() == mpirun_command([], **c.mpirun_options(), mpirun="mpirun")[1:]


def test_unknown_subset_host_is_named(tmp_path):
    r = _mlxrun("--simcluster", "nosuchcluster", "--hosts", "1,2", "--dry-run")
    assert r.returncode == 2 and "no simulated cluster 'nosuchcluster'" in r.stderr
    r = _mlxrun("--hostfile", str(ROOT / "hostfiles" / "localhost.hosts"), "--hosts", "1", "--dry-run")
    assert r.returncode == 2 and "--hosts" in r.stderr


def test_simcluster_is_found_through_its_launch_profile(tmp_path):
    """`--simcluster DIR --hosts` and the rig's hostfile need only the launch.json profile the rig
    writes; the launcher never imports the rig."""
    from mlxdist.launch.profile import ClusterProfile, ProfileHost

    agent, hostfile = tmp_path / "ssh-agent", tmp_path / "hostfile"
    agent.write_text("#!/bin/sh\n")
    hosts = [ProfileHost(f"mlxlp{i}", f"10.79.8.{i}", 2, (f"mlxlp-{i}",)) for i in (1, 2, 3)]
    hostfile.write_text("".join(f"{h.ip} slots=2\n" for h in hosts))
    ClusterProfile("mlxlp", tmp_path, hostfile, hosts, agent, "10.79.8.0/24").write()
    r = _mlxrun("--simcluster", str(tmp_path), "--hosts", "mlxlp-3,1", "--dry-run", "--no-check")
    assert r.returncode == 0, r.stderr
    assert f"--hostfile {tmp_path / 'hostfile-1-3'} " in r.stdout and "-np 4" in r.stdout
    assert f"plm_ssh_agent {agent}" in r.stdout and "btl_tcp_if_include 10.79.8.0/24" in r.stdout
    assert (tmp_path / "hostfile-1-3").read_text() == "10.79.8.1 slots=2\n10.79.8.3 slots=2\n"
    r = _mlxrun("--simcluster", str(tmp_path), "--hosts", "4", "--dry-run", "--no-check")
    assert r.returncode == 2 and "--hosts 4: host '4' not in 1..3 of cluster mlxlp" in r.stderr
    r = _mlxrun("--hostfile", str(hostfile), "--dry-run", "--no-check")
    assert "belongs to simulated cluster 'mlxlp'" in r.stderr and f"plm_ssh_agent {agent}" in r.stdout
    code = "import sys, mlxdist.launch.launcher; print(sorted(m for m in sys.modules if m.startswith('mlxdist.rig')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=60)
    assert r.stdout.strip() == "[]", r.stderr


@pytest.mark.cluster
@pytest.mark.netns
def test_mlxrun_rehearses_on_a_simulated_cluster(tmp_path):
    from mlxdist.rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    with SimCluster(2, name="mlxln", subnet="10.79.4"):  # a name and subnet no other test file uses
        r = _mlxrun("--simcluster", "mlxln", "--", "data.source=synthetic", "data.seq_len=16",
                    "train.steps=2", "metrics.port=0", f"train.out_dir={tmp_path}", "dist.backend=mlx-mpi")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "on mlxln1, mlxln2" in r.stderr and (tmp_path / "checkpoints" / "step_00000002").is_dir()
    r = _mlxrun("--simcluster", "nosuchcluster", "--dry-run")
    assert r.returncode == 2 and "launch/simcluster up" in r.stderr


def test_cleanup_kills_the_jobs_leftovers_and_nothing_else():
    from mlxdist.launch.hosts import Remote
    from mlxdist.launch.supervisor import cleanup_script, leftover_pattern

    sleeper = [sys.executable, "-X", "mlxdist_job={}", "-c", "import time; time.sleep(60)"]
    mine, other = (subprocess.Popen([a.format(t) for a in sleeper]) for t in ("c0ffee01", "c0ffee02"))
    try:
        script = cleanup_script(leftover_pattern("c0ffee01", 999999, "nohost"))
        r = subprocess.run(Remote(local_names=frozenset({"localhost"})).command("localhost", script),
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.split() == ["leftovers:", "1"], r.stdout + r.stderr
        assert mine.wait(timeout=10) == -9 and other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_preflight_names_a_host_with_other_versions_and_a_pair_that_cannot_connect():
    import json

    from mlxdist.launch import preflight
    from mlxdist.launch.hosts import LaunchError, Remote, Reply

    reports = {
        "studio": {"python": "3.12.4", "packages": {"mlx": "0.32.3", "mlxdist": "0.1.0"}, "reach": {"macbook": None}},
        "macbook": {"python": "3.12.7", "packages": {"mlx": "0.31.0", "mlxdist": "0.1.0"},
                    "reach": {"studio": "No route to host"}},
    }

    class Canned(Remote):  # stands in for ssh: each host answers with its report
        def run(self, host, script, timeout):
            return Reply(0, json.dumps(reports[host]) + "\n")

    found = preflight.preflight(["studio", "macbook"], Canned(), "/env/bin/python", "/src")
    assert "note: host 'macbook' has mlx 0.31.0, host 'studio' has 0.32.3; install the same versions" in found[0]
    assert any(f.startswith("note: host 'macbook' runs Python 3.12.7, host 'studio' 3.12.4") for f in found)
    with pytest.raises(LaunchError, match=r"^hostfile h: host 'macbook' cannot reach host 'studio' \(No route to host\)"):
        preflight.check(["studio", "macbook"], Canned(), "/env/bin/python", "/src", "hostfile h")
    reports["macbook"]["reach"] = {}
    notes = preflight.check(["studio", "macbook"], Canned(), "/env/bin/python", "/src", "hostfile h")
    assert [n.split(",")[0] for n in notes] == ["host 'macbook' has mlx 0.31.0", "host 'macbook' runs Python 3.12.7"]


def test_preflight_on_this_machine_passes_and_a_missing_python_is_named(tmp_path):
    from mlxdist.launch import preflight
    from mlxdist.launch.hosts import Remote

    local = Remote(local_names=frozenset({"localhost"}))
    assert preflight.preflight(["localhost"], local, sys.executable, str(ROOT)) == []
    found = preflight.preflight(["localhost"], local, str(tmp_path / "nope" / "python"), str(ROOT))
    assert len(found) == 1 and "does not run there" in found[0] and "same path" in found[0]


def _stand_in_mac(tmp_path, real, told):
    """This machine as a Mac host: a `sw_vers` that prints the `real` version when asked for it
    (SYSTEM_VERSION_COMPAT=0) and the `told` one otherwise, and a job Python that believes it
    runs on macOS `told` (what an interpreter built against an older SDK is told on macOS 26).
    Returns (PATH with that sw_vers first, the job Python)."""
    import os

    bin_ = tmp_path / "mac-bin"
    bin_.mkdir()
    sw_vers = bin_ / "sw_vers"
    sw_vers.write_text(f'#!/bin/sh\nif [ "$SYSTEM_VERSION_COMPAT" = 0 ]; then echo {real}; else echo {told}; fi\n')
    python = tmp_path / "mac-python"
    python.write_text(f"#!{sys.executable}\nimport platform, sys\nsys.platform = 'darwin'\n"
                      f"platform.mac_ver = lambda *a: ({told!r}, ('', '', ''), 'arm64')\n"
                      "code, sys.argv = sys.argv[2], ['-c', *sys.argv[3:]]\n"
                      "exec(compile(code, '<string>', 'exec'), {'__name__': '__main__'})\n")
    for f in (sw_vers, python):
        f.chmod(0o755)
    return f"{bin_}{os.pathsep}{os.environ['PATH']}", str(python)


@pytest.mark.parametrize("real, told, refused", [
    ("14.6", "14.6", False), ("15.3", "15.3", False), ("13.6", "13.6", True),
    ("26.2", "16.0", False),   # SDK compatibility: Python is told 16.0, sw_vers says 26.2
    ("26.2", "26.2", False),
])
def test_preflight_reads_a_stand_in_mac_s_version(tmp_path, monkeypatch, real, told, refused):
    import json

    from mlxdist.launch import preflight
    from mlxdist.launch.hosts import Remote

    path, python = _stand_in_mac(tmp_path, real, told)
    monkeypatch.setenv("PATH", path)
    local = Remote(local_names=frozenset({"localhost"}))
    reply = local.run("localhost", preflight.probe_script(["localhost"], python, str(ROOT)), 60)
    assert preflight.report_macos(json.loads(reply.stdout.splitlines()[-1])) == real, reply.stdout + reply.stderr
    found = preflight.preflight(["localhost"], local, python, str(ROOT))
    if not refused:
        assert found == []
        return
    assert found == ["host 'localhost' runs macOS 13.6; macOS 14 (Sonoma) or newer is needed: mlx/torch publish "
                     "no wheels for 13; upgrade, or leave localhost out of the hostfile"]


@pytest.mark.parametrize("python", ["stand-in", "missing"])
def test_mlxrun_refuses_a_mac_below_14_and_starts_nothing(tmp_path, python):
    """mlxrun on a hostfile with a macOS 13 host: one line naming it, exit 2, no mpirun. Also
    when the job's Python does not run there (pip could not build the environment on 13)."""
    path, mac_python = _stand_in_mac(tmp_path, "13.6", "13.6")
    job_python = mac_python if python == "stand-in" else str(tmp_path / "no-env" / "bin" / "python")
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "mlxrun"), "--hostfile",
                        str(ROOT / "hostfiles" / "localhost.hosts"), "--python", job_python, "--dry-run"],
                       capture_output=True, text=True, timeout=60, env={**env(), "PATH": path})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""   # no mpirun command: nothing started
    assert r.stderr.strip() == (
        f"error: hostfile {ROOT / 'hostfiles' / 'localhost.hosts'}: host 'localhost' runs macOS 13.6; macOS 14 "
        "(Sonoma) or newer is needed: mlx/torch publish no wheels for 13; upgrade, or leave localhost out of "
        "the hostfile")
