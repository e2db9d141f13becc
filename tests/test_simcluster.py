"""Tests of the namespace cluster tool itself: if it lies (shared hostnames, an
uncapped link, a CPU cap that does nothing), every distributed test built on it
measures the wrong thing. Cluster tests need root; they skip with the reason."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ROOT, mpirun_path

from mlxdist.rig import simcluster
from mlxdist.rig.simcluster import SimCluster, link_limit_seconds, parse_rate


def _need_cluster() -> None:
    ok, why = simcluster.available()
    if not ok:
        pytest.skip(why)


def _leftovers(c: SimCluster) -> list[str]:
    nss = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [ln.split()[0] for ln in nss.splitlines() if ln.startswith(c.name + "-")]
    for ln in links.splitlines():
        dev = ln.split(":")[1].strip().split("@")[0]
        if dev == c.bridge or dev.startswith(c.tag + "v"):
            found.append(dev)
    return found


def _gone(pid: int, within: float = 5.0) -> bool:
    """Gone, or a zombie being reaped (empty cmdline); a SIGKILLed process may take a
    moment on a loaded box."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(OSError):
            if cmdline.read_bytes():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
                continue
        return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    _need_cluster()
    # Not the default name/subnet, so a cluster a developer has up stays untouched.
    with SimCluster(
        3, name="mlxst", subnet="10.77.7", state_dir=tmp_path_factory.mktemp("sc")
    ) as c:
        yield c


# ----- no root needed ------------------------------------------------------------


def test_link_limit_seconds() -> None:
    assert link_limit_seconds(1000, 1, 1e9) == 0.0
    # 2 ranks: each link carries the whole buffer once.
    assert link_limit_seconds(125_000_000, 2, 1e9) == pytest.approx(1.0)
    assert link_limit_seconds(125_000_000, 4, 1e9) == pytest.approx(1.5)


def test_parse_rate() -> None:
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("10Gbit") == 1e10
    with pytest.raises(ValueError):
        parse_rate("fast")


def test_names_fit_interface_limit(tmp_path: Path) -> None:
    c = SimCluster(200, name="averyverylongclustername", state_dir=tmp_path)
    assert len(c.bridge) <= 15 and len(c.veth(200)) <= 15
    assert c.hostname("10.77.0.7") == c.hostname(7) == "averyverylongclustername7"
    assert SimCluster(2, name="b", state_dir=tmp_path).bridge != c.bridge
    with pytest.raises(ValueError):
        SimCluster(2, name="Bad-Name")
    with pytest.raises(KeyError):
        c.ip(201)


def test_mpirun_args_forward_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/x")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    args = SimCluster(2, state_dir=tmp_path).mpirun_args(env=["FOO"])
    pairs = list(zip(args, args[1:], strict=False))
    assert ("-x", "PYTHONPATH") in pairs and ("-x", "PATH") in pairs
    assert ("-x", "LD_PRELOAD") not in pairs and ("-x", "FOO") not in pairs
    assert ("--hostfile", str(tmp_path / "hostfile")) in pairs


# ----- real namespace hosts ------------------------------------------------------


@pytest.mark.cluster
def test_files_written(cluster: SimCluster) -> None:
    lines = cluster.hostfile.read_text().split("\n")
    assert lines[0] == "10.77.7.1 slots=1"
    assert "10.77.7.2 mlxst2" in cluster.hosts_file.read_text()
    assert cluster.ssh_agent.stat().st_mode & 0o111


@pytest.mark.cluster
def test_distinct_hostnames_under_mpirun(cluster: SimCluster) -> None:
    res = subprocess.run(
        [mpirun_path(), *cluster.mpirun_args(), "-np", "3", "hostname"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split()) == cluster.hosts


@pytest.mark.cluster
def test_allreduce_across_two_hosts(cluster: SimCluster, tmp_path: Path) -> None:
    prog = tmp_path / "allreduce.py"
    prog.write_text(textwrap.dedent("""
        import socket
        import numpy as np
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        x = np.full(1 << 20, comm.rank + 1, dtype=np.float64)  # 8 MB
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        want = comm.size * (comm.size + 1) / 2
        assert np.all(out == want), out[:4]
        names = comm.allgather(socket.gethostname())
        if comm.rank == 0:
            print("OK", want, *names)
    """))
    res = subprocess.run(
        [mpirun_path(), *cluster.mpirun_args(), "-np", "2", sys.executable, str(prog)],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["OK", "3.0", "mlxst1", "mlxst2"]


@pytest.mark.cluster
def test_cut_and_heal(cluster: SimCluster) -> None:
    assert cluster.reachable(1, 2)
    try:
        cluster.cut(2)
        assert not cluster.reachable(1, 2, timeout=1.0)
        assert not cluster.reachable(2, 3, timeout=1.0)
        assert cluster.reachable(1, 3)
    finally:
        cluster.heal(2)
    assert cluster.reachable(1, 2, timeout=3.0)


@pytest.mark.cluster
def test_kill_host(cluster: SimCluster) -> None:
    p = cluster.popen(3, ["sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while not cluster.pids(3) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cluster.kill(3) >= 1
        assert p.wait(timeout=5) == -signal.SIGKILL
        assert cluster.pids(3) == []
    finally:
        p.kill()
        p.wait()


BUSY = "import time\nt=time.time()+0.6\nn=0\nwhile time.time()<t: n+=1\nprint(n)\n"


def _busy_count(c: SimCluster, host: int) -> int:
    res = c.run(host, [sys.executable, "-c", BUSY], capture_output=True, text=True,
                timeout=30, check=True)
    return int(res.stdout)


@pytest.mark.cluster
def test_slow_caps_cpu(cluster: SimCluster) -> None:
    base = _busy_count(cluster, 1)
    try:
        cluster.slow(1, 30)
        slowed = _busy_count(cluster, 1)
    finally:
        cluster.slow(1, None)
    assert slowed / base < 0.75, (base, slowed)
    assert _busy_count(cluster, 1) / base > 0.5  # the cap is lifted again


RECV = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += k
print(n, time.perf_counter() - t0, flush=True)
"""
SEND = """
import socket, sys, time
n = int(sys.argv[3]); chunk = b"x" * (1 << 20)
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        time.sleep(0.05)
while n > 0:
    s.sendall(chunk[: min(n, len(chunk))]); n -= min(n, len(chunk))
s.close()
"""


def _throughput(c: SimCluster, src: int, dst: int, nbytes: int) -> float:
    """Bits per second from `src` to `dst`, timed at the receiver."""
    port = "5701"
    recv = c.popen(dst, [sys.executable, "-c", RECV, port], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        c.run(src, [sys.executable, "-c", SEND, c.ip(dst), port, str(nbytes)],
              check=True, timeout=60)
        got, secs = recv.stdout.readline().split()
        assert int(got) == nbytes
        return nbytes * 8 / float(secs)
    finally:
        recv.kill()
        recv.wait()


@pytest.mark.cluster
def test_shape_caps_both_directions(cluster: SimCluster) -> None:
    cap = parse_rate("100mbit")
    nbytes = 5_000_000  # 0.4 s at the cap
    try:
        cluster.shape(1, rate="100mbit")
        out = _throughput(cluster, 1, 2, nbytes)  # host 1 sends: its eth0 egress
        into = _throughput(cluster, 2, 1, nbytes)  # host 1 receives: bridge-side veth
    finally:
        cluster.shape(1)
    for rate in (out, into):
        assert 0.3 * cap < rate < 1.3 * cap, (out / 1e6, into / 1e6)
    assert _throughput(cluster, 2, 1, nbytes) > 2 * cap  # cleared again


@pytest.mark.cluster
def test_delay_adds_latency(cluster: SimCluster) -> None:
    if not simcluster.qdisc_supported("netem"):
        with pytest.raises(RuntimeError, match="netem"):
            cluster.shape(1, delay="50ms")
        pytest.skip("kernel has no netem qdisc (sch_netem): delay is unsupported here")
    probe = (
        "import socket,sys,time\n"
        "t=time.perf_counter(); s=socket.socket(); s.settimeout(5)\n"
        "try: s.connect((sys.argv[1], 9))\n"
        "except ConnectionRefusedError: pass\n"
        "print(time.perf_counter()-t)\n"
    )

    def rtt() -> float:
        res = cluster.run(1, [sys.executable, "-c", probe, cluster.ip(2)],
                          capture_output=True, text=True, check=True)
        return float(res.stdout)

    try:
        cluster.shape(1, delay="50ms")
        slow = min(rtt() for _ in range(2))
    finally:
        cluster.shape(1)
    assert slow >= 0.045
    assert rtt() < 0.045


@pytest.mark.cluster
def test_up_is_idempotent_and_down_leaves_nothing(tmp_path: Path) -> None:
    _need_cluster()
    delay = "1ms" if simcluster.qdisc_supported("netem") else None
    c = SimCluster(2, name="mlxsttd", subnet="10.77.8", rate="1gbit", delay=delay,
                   state_dir=tmp_path)
    try:
        c.up()
        c.up()  # leftovers of the same name are replaced, not an error
        assert sorted(_leftovers(c)) == sorted([c.bridge, c.veth(1), c.veth(2),
                                                c.netns(1), c.netns(2)])
        with pytest.raises(RuntimeError, match="already used"):
            SimCluster(1, name="mlxsttx", subnet="10.77.8", state_dir=tmp_path / "x").up()
    finally:
        c.down()
    assert _leftovers(c) == []
    c.down()  # nothing there: fine
    with pytest.raises(ZeroDivisionError), c:
        assert _leftovers(c)
        raise ZeroDivisionError
    assert _leftovers(c) == []
    assert not (tmp_path / "state.json").exists()


@pytest.mark.cluster
def test_cli_round_trip(tmp_path: Path) -> None:
    _need_cluster()
    cli = [str(ROOT / "launch" / "simcluster"), "--name", "mlxstcli"]
    sd = ["--state-dir", str(tmp_path)]

    def run(*args: str) -> str:
        res = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout

    try:
        out = run("up", "--hosts", "2", "--subnet", "10.77.9", "--rate", "1gbit", *sd)
        assert str(tmp_path / "hostfile") in out and "mpirun" in out
        run("cut", "mlxstcli2", *sd)
        assert '"link": "down"' in run(*sd, "status")
        run("heal", "10.77.9.2", *sd)
        run("slow", "1", "--cpu", "50", *sd)
        run("shape", "2", "--rate", "10gbit", *sd)
        status = run("status", *sd)
        assert "10gbit" in status and '"cpu_percent": 50.0' in status
        assert run("kill", "mlxstcli1", *sd).startswith("killed 0")
    finally:
        subprocess.run([*cli, "down", *sd], timeout=60)
    c = SimCluster(2, name="mlxstcli", subnet="10.77.9", state_dir=tmp_path)
    assert _leftovers(c) == []
    res = subprocess.run([sys.executable, "-m", "mlxdist.rig.simcluster", "--help"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "simcluster" in res.stdout


SIGNALLED = """
import sys, time
sys.path.insert(0, sys.argv[2])
from mlxdist.rig.simcluster import SimCluster
with SimCluster(2, name="mlxstsig", subnet="10.77.10", state_dir=sys.argv[1]) as c:
    p = c.popen(1, ["sleep", "60"])
    print(p.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down(tmp_path: Path, sig: signal.Signals) -> None:
    _need_cluster()
    c = SimCluster(2, name="mlxstsig", subnet="10.77.10", state_dir=tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED, str(tmp_path), str(ROOT)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert _leftovers(c)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert proc.returncode != 0
        assert _leftovers(c) == []
        assert _gone(pid)
    finally:
        proc.kill()
        proc.wait()
        c.down()


@pytest.mark.cluster
def test_down_kills_a_process_launched_a_moment_before(tmp_path: Path) -> None:
    """`down` right after `popen`: the wrapper has not joined the host's namespace yet, so
    only the pid finds it; it must not live on in a namespace that lost its name."""
    _need_cluster()
    with SimCluster(2, name="mlxstrace", subnet="10.77.11", state_dir=tmp_path) as c:
        procs = [c.popen(1, ["sleep", "60"]) for _ in range(5)]
    for p in procs:
        assert p.returncode is not None and p.returncode != 0
        assert _gone(p.pid)


def test_unavailable_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simcluster, "_AVAILABLE", None)
    monkeypatch.setattr(simcluster.os, "geteuid", lambda: 1000)
    ok, why = simcluster.available()
    assert not ok and "root" in why and "apt-get install iproute2" in why
    with pytest.raises(RuntimeError, match="root"):
        SimCluster(1, name="mlxstnr", state_dir="/nonexistent").up()


@pytest.mark.cluster
def test_found_by_name_wherever_its_state_lives(tmp_path: Path) -> None:
    _need_cluster()
    c = SimCluster(2, name="mlxsf", subnet="10.79.5", state_dir=tmp_path)
    try:
        c.up()
        found = simcluster.find_cluster("mlxsf")
        assert found.state_dir == tmp_path and found.hosts == c.hosts
        assert simcluster.find_cluster(str(tmp_path)).n_hosts == 2
        sub = c.subset_hostfile(["mlxsf2"])
        assert sub.read_text() == "10.79.5.2 slots=1\n"
        with pytest.raises(KeyError, match="not in 1..2"):
            c.subset_hostfile([3])
    finally:
        c.down()
    assert not sub.exists()
    with pytest.raises(LookupError, match="simcluster up"):
        simcluster.find_cluster("mlxsf")
