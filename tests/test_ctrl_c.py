"""Ctrl-C on plain `mpirun -np 2 python -m mlxdist.train`, sent the way a user sends it: the
keystroke on the terminal mpirun runs at (a pseudo-terminal here), which the kernel turns into
SIGINT to the terminal's foreground process group. Without mlxdist taking that group, Open MPI
kills the ranks 0.5 s after its SIGTERM and nothing is saved (mlxdist/cluster/terminal.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import env, logged_steps, mpirun_path

pytestmark = pytest.mark.cluster

ARGS = ["-m", "mlxdist.train", "data.source=synthetic", "data.seq_len=16", "metrics.port=0",
        "train.progress=false", "model.dtype=float32", "train.steps=10000", "train.batch_size=4",
        "dist.backend=mpi4py", "checkpoint.every=0", "train.eval_every=0", "model.preset=tiny"]


class Terminal:
    """mpirun as the foreground job of its own terminal, its output kept."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: session leader, the pty its controlling terminal
            try:
                os.execve(argv[0], argv, env())
            finally:
                os._exit(127)
        self.out = b""
        self.code: int | None = None

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.code is None:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                with contextlib.suppress(OSError):  # closed: every process on it has ended
                    self.out += os.read(self.fd, 65536)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)

    def press_ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")

    def close(self) -> None:
        if self.code is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace")


def _events(out: Path, rank: int, kind: str) -> list[dict]:
    path = out / "logs" / f"rank{rank}.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def _rank_pid(rank: int, run_dir: Path) -> int:
    """This test's rank `rank`: the other xdist worker may be running ranks of its own job."""
    mine = f"train.out_dir={run_dir}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"mlxdist.train" in cmdline and mine in cmdline and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no process of rank {rank}")


def _start(tmp_path: Path) -> Terminal:
    term = Terminal([mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH",
                     "-x", "OPENBLAS_NUM_THREADS", sys.executable, *ARGS, f"train.out_dir={tmp_path}"])
    deadline = time.monotonic() + 120
    while len(logged_steps(tmp_path)) < 3 and time.monotonic() < deadline and term.code is None:
        term.pump(0.2)
    assert len(logged_steps(tmp_path)) >= 3, term.text[-3000:]
    return term


def test_ctrl_c_on_plain_mpirun_saves_at_the_step_it_stops(tmp_path: Path) -> None:
    term = _start(tmp_path)
    try:
        term.press_ctrl_c()
        term.pump(90)
    finally:
        term.close()
    assert term.code == 0, f"exit {term.code}:\n{term.text[-3000:]}"
    assert "SIGINT received; stopping after this step" in term.text and "Traceback" not in term.text
    ends = [e for rank in (0, 1) for e in _events(tmp_path, rank, "end")]
    assert len(ends) == 2 and {e["reason"] for e in ends} == {"signal"}, ends
    step = ends[0]["step"]
    assert ends[1]["step"] == step >= 3
    assert (tmp_path / "checkpoints" / f"step_{step:08d}" / "manifest.json").is_file()


def test_second_ctrl_c_on_plain_mpirun_ends_at_once(tmp_path: Path) -> None:
    term = _start(tmp_path)
    rank1 = None
    try:
        # A frozen rank keeps the first Ctrl-C's step from ending, so only the second can end it.
        rank1 = _rank_pid(1, tmp_path)
        os.kill(rank1, signal.SIGSTOP)
        term.press_ctrl_c()
        term.pump(0.5)
        t0 = time.monotonic()
        term.press_ctrl_c()
        term.pump(30)
        took = time.monotonic() - t0
    finally:
        if rank1:
            os.kill(rank1, signal.SIGCONT)
        term.close()
    assert term.code not in (None, 0), term.text[-3000:]
    assert took < 10, took
    assert "Traceback" not in term.text, term.text[-3000:]
