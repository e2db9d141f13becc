"""Naming the rank that stalled a job: the verdict (pure), the UDP heartbeat between real
sockets, and real mpirun jobs where one rank is frozen with SIGSTOP."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from helpers import FAST, training

from mlxdist.cluster.heartbeat import Heartbeat
from mlxdist.cluster.stall import stall_culprits

HOSTS = ["studio", "mac-a", "mac-b"]


def test_silent_peer_is_named_with_its_host():
    v = stall_culprits(100.0, [None, 99.5, 71.0], [42, 42, 41], HOSTS, me=0, stale_after=5)
    assert v.culprits == [2]
    assert "no heartbeat from rank 2 (mac-b) for 29s" in v.reason
    assert "rank 1" not in v.reason


def test_every_silent_peer_is_named():
    v = stall_culprits(50.0, [40.0, None, 41.0], [7, 9, 7], HOSTS, me=1, stale_after=5)
    assert v.culprits == [0, 2]
    assert "rank 0 (studio) for 10s" in v.reason and "rank 2 (mac-b) for 9s" in v.reason


def test_peer_never_heard_is_named_with_a_different_hint():
    v = stall_culprits(50.0, [None, 49.0, None], [3, 3, None], HOSTS, me=0, stale_after=5)
    assert v.culprits == [2]
    assert "rank 2 (mac-b) ever" in v.reason and "UDP blocked" in v.reason


def test_alive_but_behind_peer_is_named():
    v = stall_culprits(100.0, [99.0, None, 99.8], [42, 42, 40], HOSTS, me=1, stale_after=5,
                       doing=["gradient all-reduce", None, None])
    assert v.culprits == [2]
    assert "rank 2 (mac-b) at collective #40 (computing) has not reached collective #42" in v.reason


def test_fresh_peers_in_the_same_collective_blame_the_link():
    v = stall_culprits(100.0, [None, 99.0, 99.5], [42, 42, 42], HOSTS, me=0, stale_after=5)
    assert v.culprits == []
    assert "data link" in v.reason


def test_a_rank_that_was_frozen_blames_itself_not_its_peers():
    v = stall_culprits(100.0, [None, 60.0, 60.0], [41, 42, 42], HOSTS, me=0, stale_after=5,
                       suspended_s=38)
    assert v.culprits == [0]
    assert "this rank (studio) was itself suspended for 38s" in v.reason
    assert "rank 1" not in v.reason


def test_stale_is_a_threshold_not_any_delay():
    v = stall_culprits(100.0, [None, 95.5, 94.9], [5, 5, 5], HOSTS, me=0, stale_after=5)
    assert v.culprits == [2]


# ---------------------------------------------------------------- real UDP sockets


def _pair(interval: float = 0.05) -> list[Heartbeat]:
    beats = [Heartbeat(r, ["h0", "h1"], "127.0.0.1", interval, (lambda r=r: (10 + r, f"op{r}")))
             for r in range(2)]
    for hb in beats:
        hb.peers = [b.address for b in beats]
        hb.token = beats[0].token
    return beats


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_heartbeats_carry_progress_between_real_sockets():
    beats = _pair()
    try:
        for hb in beats:
            hb._thread.start()
        assert _wait(lambda: all(b.last_seen[1 - b.rank] is not None for b in beats))
        assert beats[0].progress[1] == 11 and beats[0].doing[1] == "op1"
        assert beats[1].progress[0] == 10 and beats[1].doing[0] == "op0"
        beats[1].close()
        # the closed rank's heartbeat goes stale at the other one
        assert _wait(lambda: time.monotonic() - beats[0].last_seen[1] > 0.5, timeout=5)
    finally:
        for hb in beats:
            hb.close()


def test_packets_from_outside_the_job_are_ignored():
    beats = _pair()
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        beats[0]._thread.start()
        import json

        for token in (beats[0].token, "wrong"):
            stranger.sendto(json.dumps([token, 1, 99, "x"]).encode(), beats[0].address)
        stranger.sendto(b"\xff garbage", beats[0].address)
        time.sleep(0.5)
        assert beats[0].last_seen == [None, None] and beats[0].progress == [None, None]
    finally:
        stranger.close()
        for hb in beats:
            hb.close()
    assert beats[0].sock.fileno() == -1, "socket left open after close()"


# ---------------------------------------------------------------- real ranks, one frozen

STALL_S = 5


def _rank_pids(mpirun_pid: int, n: int, timeout: float = 60) -> dict[int, int]:
    """Rank -> pid of the python processes this mpirun started (OMPI_COMM_WORLD_RANK in /proc)."""
    deadline = time.monotonic() + timeout
    found: dict[int, int] = {}
    while time.monotonic() < deadline and len(found) < n:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                environ = (d / "environ").read_bytes().split(b"\0")
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"mlxdist.train" not in cmdline:
                continue
            vars_ = dict(v.split(b"=", 1) for v in environ if b"=" in v)
            if b"OMPI_COMM_WORLD_RANK" in vars_ and _descends_from(int(d.name), mpirun_pid):
                found[int(vars_[b"OMPI_COMM_WORLD_RANK"])] = int(d.name)
        time.sleep(0.2)
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def test_a_signal_between_a_line_and_its_newline_does_not_run_two_lines_together(monkeypatch) -> None:
    """A stall abort's line (the watchdog's thread) and the SIGTERM mpirun sends the ranks
    right after (the main thread's handler) once came out as one line, and the test below
    then read a second rank named in it. Here the signal lands inside the first write."""
    import io
    import sys

    from mlxdist import markers
    from mlxdist.cluster.world import World

    class SignalInsideWrite(io.StringIO):
        fired = False

        def write(self, s: str) -> int:
            n = super().write(s)
            if not self.fired:
                self.fired = True
                os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this write returns
            return n

    stream = SignalInsideWrite()
    monkeypatch.setattr(sys, "stderr", stream)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, markers.STOP_SIGNAL)}
    abort = markers.abort_line("rank 1 (vm)", "stalled 5s in waiting: no heartbeat from rank 2 (vm)", "stalled")
    try:
        World(rank=1, host="vm").install_signal_handlers()
        markers.write_line(abort)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert stream.getvalue().splitlines() == [
        abort, "mlxdist: rank 1 (vm): SIGTERM received; stopping after this step (again to exit now)"]


@pytest.mark.cluster
@pytest.mark.parametrize("n,frozen,engine", [(2, 1, "mlx"), (2, 0, "mlx"), (3, 2, "mlx"), (3, 0, "mlx"),
                                             (2, 1, "torch")])
def test_frozen_rank_is_named_by_the_others(tmp_path, n, frozen, engine):
    args = [*(("--engine", "torch", "--device", "cpu") if engine == "torch" else ()), *FAST, "train.steps=100000", "train.batch_size=2", "checkpoint.every=0",
            "dist.sync_weights_every=0", f"dist.stall_timeout_s={STALL_S}", f"train.out_dir={tmp_path}"]
    pids: dict[int, int] = {}
    try:
        with training(args, n, tmp_path, 3) as proc:
            pids = _rank_pids(proc.pid, n)
            assert sorted(pids) == list(range(n)), pids
            os.kill(pids[frozen], signal.SIGSTOP)
            _, err = proc.communicate(timeout=STALL_S * 6 + 30)
    finally:
        for pid in pids.values():  # SIGKILL ends a stopped process too; it may be gone already
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0, err[-3000:]
    host = socket.gethostname()
    lines = [ln for ln in err.splitlines() if "stalled" in ln]
    assert lines, err[-3000:]
    for line in lines:
        m = re.search(r"mlxdist: rank (\d+) \(.*?\): stalled \d+s in [a-z -]+ \(dist.stall_timeout_s\): (.*)", line)
        assert m, line
        if int(m.group(1)) == frozen:  # woken by mpirun's SIGCONT before its SIGKILL
            assert "was itself suspended" in m.group(2), line
            continue
        # silent since the freeze, or (when the others were already waiting for it) still
        # heard but behind: either way the frozen rank and only it is named, with its host
        named = {int(r) for r in re.findall(rf"rank (\d+) \({re.escape(host)}\)", m.group(2))}
        assert named == {frozen}, line
        assert f"no heartbeat from rank {frozen} ({host})" in line or "has not reached" in line, line
