"""What the ranks tell the launcher, and what the launcher tells the shell.

The ranks and `launch/mlxrun` run in different processes, often on different machines,
and the only channel between them that always works is the text mpirun relays. Both
sides import these constants, so the supervisor never depends on the wording of a log
message, and a script calling `mlxrun` can tell "finished" from "stopped" from "broken".
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import TextIO

# Printed by world.abort on the rank that ends the job (stall watchdog, fatal error).
ABORT = "mlxdist-abort:"
# Printed by rank 0 as its very last line, after the final checkpoint and its end event.
COMPLETE = "mlxdist-complete:"

# Printed by each rank once its stop handler is in place, only under launch/mlxrun (which
# sets SUPERVISED_ENV): a stop signal that arrives earlier would kill a starting rank.
READY = "mlxdist-ready:"
# Printed by rank 0 under launch/mlxrun after each step and each checkpoint it wrote: the
# elastic supervisor counts the steps a failure loses and times a rejoin by checkpoints.
STEP = "mlxdist-step:"
CHECKPOINT = "mlxdist-checkpoint:"
SUPERVISED_ENV = "MLXDIST_SUPERVISED"
# Passed by `launch/mlxrun --elastic` to every rank of a restarted job, so the counts survive
# in its metrics (RestartCounts).
RESTARTS_ENV = "MLXDIST_RESTARTS"
LOST_STEPS_ENV = "MLXDIST_LOST_STEPS"

# Forwarded to every rank by Open MPI's mpirun (prterun forwards SIGUSR1/SIGUSR2 and
# kills the job on SIGINT/SIGTERM), so it is the one stop request that survives the trip.
STOP_SIGNAL = signal.SIGUSR1


class Exit(IntEnum):
    """`launch/mlxrun` exit codes (docs/running-on-macs.md, "How a job ends")."""

    OK = 0  # every rank stopped at one step with a checkpoint: finished, early-stopped or stopped on request
    FAILED = 1  # the job ended without its completion record (a rank crashed or raised)
    USAGE = 2  # bad command line, hostfile, config key, or a host that cannot be reached
    STALLED = 3  # a collective made no progress for dist.stall_timeout_s (cut link, sleeping host)
    HOST_LOST = 4  # a host (its daemon or its ranks) disappeared mid-run
    GAVE_UP = 5  # --elastic: fewer than --min-hosts hosts answer, or --max-restarts used up
    KILLED = 130  # a second Ctrl-C: ended at once, nothing saved since the last checkpoint


@dataclass(frozen=True)
class RestartCounts:
    """The supervisor's counts as a rank sees them (metrics `mlxdist_restarts_total`,
    `mlxdist_lost_steps_total`): how often this job was restarted and how many steps were redone."""

    restarts: int = 0
    lost_steps: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RestartCounts:
        def num(name: str) -> int:
            try:
                return max(0, int(env.get(name, "0")))
            except ValueError:
                return 0

        return cls(num(RESTARTS_ENV), num(LOST_STEPS_ENV))

    def env(self) -> list[str]:
        return [f"{RESTARTS_ENV}={self.restarts}", f"{LOST_STEPS_ENV}={self.lost_steps}"]


def write_line(line: str, stream: TextIO | None = None) -> None:
    """`line` and its newline in one write (stderr by default). `print` writes them apart,
    and a rank's stall watchdog thread and a signal handler on its main thread do print at
    once (a stall abort while mpirun's SIGTERM arrives): their lines ran together, and the
    supervisor and users read these lines one by one."""
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()


def abort_line(label: str, message: str, reason: str) -> str:
    """The human message first; `reason` is one word (`stalled`, `error`) for the supervisor."""
    return f"mlxdist: {label}: {message} ({ABORT} {reason})"


def ready_line(rank: int) -> str:
    return f"{READY} rank {rank}"


def complete_line(step: int, reason: str) -> str:
    return f"{COMPLETE} step {step} reason {reason.replace(' ', '_')}"


def announce_complete(step: int, reason: str) -> None:
    """Rank 0, last thing: tell the supervisor the run ended with a checkpoint at `step`.
    Silent without a supervisor, so plain runs keep a clean terminal."""
    if os.environ.get(SUPERVISED_ENV):
        print(complete_line(step, reason), flush=True)


def announce_event(kind: str, fields: dict) -> None:
    """Rank 0: pass a step or a checkpoint on to the supervisor (silent without one)."""
    if kind not in ("step", "checkpoint") or not os.environ.get(SUPERVISED_ENV):
        return
    print(f"{STEP if kind == 'step' else CHECKPOINT} {int(fields['step'])}", flush=True)


def parse_progress(line: str) -> tuple[str, int] | None:
    """("step" | "checkpoint", step) of rank 0's progress marker, or None."""
    m = _PROGRESS_RE.fullmatch(line.strip())
    if not m:
        return None
    return ("step" if m.group(1) == STEP else "checkpoint"), int(m.group(2))


_PROGRESS_RE = re.compile(f"({re.escape(STEP)}|{re.escape(CHECKPOINT)}) (\\d+)")
_READY_RE = re.compile(re.escape(READY) + r" rank (\d+)")
_ABORT_RE = re.compile(re.escape(ABORT) + r" (\w+)\)")
_COMPLETE_RE = re.compile(re.escape(COMPLETE) + r" step (\d+) reason (\S+)")


def parse_ready(line: str) -> int | None:
    """The rank of a ready line, or None (also for two ranks' output run together)."""
    m = _READY_RE.fullmatch(line.strip())
    return int(m.group(1)) if m else None


def parse_abort(line: str) -> str | None:
    """The reason word of an abort line, or None."""
    m = _ABORT_RE.search(line)
    return m.group(1) if m else None


def parse_complete(line: str) -> tuple[int, str] | None:
    """(step, reason) of rank 0's completion record, or None."""
    m = _COMPLETE_RE.search(line)
    return (int(m.group(1)), m.group(2).replace("_", " ")) if m else None
