"""Run one `mpirun` job and say truthfully how it ended.

Open MPI 5's mpirun is a poor witness: it exits 0 when a host's daemon dies, waits for a
daemon behind a cut link until the cable is back, ignores SIGTERM while it waits, and
ends the job at once (nothing saved) on Ctrl-C. So the supervisor trusts the ranks
instead: exit 0 only after rank 0's completion record (mlxdist/markers.py), a Ctrl-C
becomes the stop signal mpirun does forward, a failed job is ended within seconds, and
whatever the job left on a host is removed through the same ssh path mpirun used.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from .. import markers
from ..markers import Exit
from .hosts import Remote

# Open MPI's words for a host that went away. Only a hint for the exit code: whether the
# run succeeded is decided by the completion record, never by this wording.
LOST_HOST_HINTS = ("lost communication with a remote daemon", "daemon failed to report back",
                   "daemon has unexpectedly failed", "prted has died", "node has been lost")


def leftover_pattern(tag: str, mpirun_pid: int, mpirun_host: str) -> str:
    """An extended regex for `pgrep -f` matching the job's ranks (their `-X mlxdist_job=TAG`)
    and its daemons (`prted` carries the namespace `prterun-HOST-PID@0`). The bracket
    keeps the pattern from matching the shell that runs it."""
    return f"[m]lxdist_job={tag}|[p]rterun-{mpirun_host}-{mpirun_pid}@"


def cleanup_script(pattern: str) -> str:
    return (f"p=$(pgrep -f {shlex.quote(pattern)}); "
            'if [ -n "$p" ]; then kill -9 $p; fi; echo "leftovers: $(echo $p | wc -w)"')


@dataclass
class Outcome:
    code: Exit
    message: str
    leftovers: dict[str, str] = field(default_factory=dict)


class Supervisor:
    """One job: `run()` starts mpirun in its own session (a terminal's Ctrl-C reaches us,
    not mpirun), relays its output, turns the first Ctrl-C/SIGTERM into a stop request
    and the second into an immediate end, and returns an `Exit` code."""

    def __init__(self, cmd: Sequence[str], *, n_ranks: int, hosts: Sequence[str], remote: Remote | None,
                 tag: str, grace: float = 3.0, out: TextIO | None = None, err: TextIO | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.cmd, self.n_ranks, self.hosts, self.remote, self.tag = list(cmd), n_ranks, list(hosts), remote, tag
        self.grace = grace
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.ready: set[int] = set()
        self.complete: tuple[int, str] | None = None
        self.abort: tuple[str, str] | None = None  # (reason word, line)
        self.lost: str | None = None
        self.failed_at: float | None = None
        self.stops = 0
        self.asked_stop = False  # a stop the supervisor itself asked for (elastic rejoin)
        self.stop_sent = False
        self.last_step = 0  # from rank 0's progress markers
        self.checkpoints_seen = 0
        self.killed = False
        self._lock = threading.Lock()

    # ----- output ---------------------------------------------------------------------

    def _say(self, text: str) -> None:
        print(f"mlxrun: {text}", file=self.err, flush=True)

    def _pump(self, src: TextIO, dst: TextIO) -> None:
        for line in src:
            rank = markers.parse_ready(line)
            if rank is not None:
                with self._lock:
                    self.ready.add(rank)
                self._maybe_send_stop()
                continue
            progress = markers.parse_progress(line)
            if progress is not None:
                kind, step = progress
                if kind == "step":
                    self.last_step = step
                else:
                    self.checkpoints_seen += 1
                continue
            done = markers.parse_complete(line)
            if done:
                self.complete = done
                continue
            dst.write(line)
            dst.flush()
            reason = markers.parse_abort(line)
            if reason and self.abort is None:
                self.abort = (reason, line.strip())
            if self.lost is None and any(h in line.lower() for h in LOST_HOST_HINTS):
                self.lost = line.strip()
            if (reason or self.lost) and self.failed_at is None:
                self.failed_at = time.monotonic()

    # ----- stop requests -----------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stops += 1
        if self.stops > 1:
            self._say(f"{signal.Signals(signum).name} again: ending the job now, without saving")
            self.killed = True
            return
        self._say(f"{signal.Signals(signum).name}: every rank stops after the current step and saves a "
                  "checkpoint (press Ctrl-C again to end at once)")
        if len(self.ready) < self.n_ranks:
            self._say(f"{len(self.ready)}/{self.n_ranks} ranks ready; passing the stop on when all are")
        self._maybe_send_stop()

    def request_stop(self, why: str) -> None:
        """Stop the job at a step boundary with a checkpoint, as a first Ctrl-C would; the
        outcome then tells the caller's stop (`asked_stop`) from the user's (`stops`)."""
        self._say(f"{why}: every rank stops after the current step and saves a checkpoint")
        self.asked_stop = True
        self._maybe_send_stop()

    def _maybe_send_stop(self) -> None:
        with self._lock:
            if (self.stops or self.asked_stop) and not self.stop_sent and len(self.ready) >= self.n_ranks and self.proc:
                self.stop_sent = True
                self.proc.send_signal(markers.STOP_SIGNAL)

    # ----- the job -----------------------------------------------------------------------

    def run(self) -> Outcome:
        """Prints the command once Ctrl-C is ours: a Ctrl-C the moment it appears (ranks
        starting) is held until they can save, not a traceback out of `Popen`."""
        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            print(shlex.join(self.cmd), file=self.out, flush=True)
            if self.killed:  # two Ctrl-Cs before mpirun even started
                return self._outcome({})
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         bufsize=1, start_new_session=True, env=self.env)
            pumps = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
                     threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True)]
            for t in pumps:
                t.start()
            while self.proc.poll() is None:
                time.sleep(0.1)
                if self.killed or (self.failed_at is not None and time.monotonic() - self.failed_at > self.grace):
                    if not self.killed:
                        self._say(f"mpirun still running {self.grace:.0f}s after the job failed; ending it")
                    self._end_mpirun()
            for t in pumps:
                t.join(timeout=2)
            leftovers = {} if self.complete else self.clean_hosts()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return self._outcome(leftovers)

    def _end_mpirun(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)
        # mpirun waits on a daemon it cannot reach and ignores SIGTERM while it does; its
        # session holds the local ssh (or stand-in) processes too.
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def clean_hosts(self) -> dict[str, str]:
        """Kill what the job left on each host, in parallel; returns host -> what happened."""
        if self.remote is None or self.proc is None:
            return {}
        pattern = leftover_pattern(self.tag, self.proc.pid, os.uname().nodename.split(".")[0])
        script = cleanup_script(pattern)
        result: dict[str, str] = {}

        def one(host: str) -> None:
            r = self.remote.run(host, script, timeout=15)
            words = r.stdout.split()
            if r.returncode == 0 and words[:1] == ["leftovers:"]:
                n = int(words[1])
                result[host] = f"removed {n} leftover process(es)" if n else ""
                return
            why = "no answer in 15 s" if r.returncode is None else r.why
            result[host] = (f"could not clean up ({why}); on {host} run: pkill -9 -f {shlex.quote(pattern)}")

        threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in dict.fromkeys(self.hosts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        for host, what in result.items():
            if what:
                self._say(f"{host}: {what}")
        return result

    def _outcome(self, leftovers: dict[str, str]) -> Outcome:
        rc = self.proc.returncode if self.proc else None
        if self.complete:
            step, reason = self.complete
            if reason == "completed":
                msg = f"job completed at step {step}"
            else:
                msg = f"job stopped at step {step} ({reason}); a checkpoint is saved: continue with --resume auto"
            if rc:
                msg += f" (mpirun then exited {rc}: a rank failed while shutting down)"
            return Outcome(Exit.OK, msg, leftovers)
        if self.killed:
            return Outcome(Exit.KILLED, "job ended on a second interrupt; nothing saved since the last checkpoint",
                           leftovers)
        if self.lost:
            return Outcome(Exit.HOST_LOST, f"job failed: a host was lost: {self.lost}", leftovers)
        if self.abort and self.abort[0] == "stalled":
            return Outcome(Exit.STALLED, f"job failed: {self.abort[1]}", leftovers)
        if self.abort:
            return Outcome(Exit.FAILED, f"job failed: {self.abort[1]}", leftovers)
        if self.stops and not self.stop_sent:
            return Outcome(Exit.KILLED, "job ended while the ranks were starting; nothing was saved", leftovers)
        if rc == Exit.USAGE:
            return Outcome(Exit.USAGE, "job failed: the ranks rejected the configuration (see the error above)",
                           leftovers)
        return Outcome(Exit.FAILED, f"job failed: mpirun exited {rc} without the ranks' completion record "
                       "(a rank or host died; see the output above)", leftovers)


def supervise(cmd: Sequence[str], *, n_ranks: int = 1, hosts: Sequence[str] = (), remote: Remote | None = None,
              tag: str = "", grace: float = 3.0) -> int:
    """Run the job to its end; print how it ended; return the `Exit` code."""
    sup = Supervisor(cmd, n_ranks=n_ranks, hosts=hosts, remote=remote, tag=tag, grace=grace)
    outcome = sup.run()
    sup._say(f"{outcome.message} [exit {int(outcome.code)}]")
    return int(outcome.code)
