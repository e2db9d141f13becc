"""JSONL event log (one file per rank) and the rank-0 progress line.

The log is the source for `mlxdist.report`; the progress line is for the human at the
terminal. Non-zero ranks print nothing to the terminal.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .. import markers


class LogFile:
    """A line-buffered log file that a full or failing disk cannot stop training with: the
    first write that fails is said in one line naming the file, later lines are counted, not
    written, and the count is said at close. Checkpoints, which do matter, refuse on their own."""

    def __init__(self, path: Path, label: str):
        self.path, self.label = path, label
        self._f: TextIO | None = open(path, "a", buffering=1)
        self.dropped = 0

    def write(self, text: str) -> None:
        if self._f is None:
            self.dropped += 1
            return
        try:
            self._f.write(text)
        except OSError as e:
            self.dropped += 1
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
            markers.write_line(f"mlxdist: {self.label}: cannot write {self.path} ({e.strerror or e}); training goes on "
                               "without it: free space there (or set train.out_dir elsewhere for the next run)")

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
        if self.dropped:
            markers.write_line(f"mlxdist: {self.label}: {self.dropped} lines not written to {self.path}")
            self.dropped = 0


class EventLog:
    def __init__(self, run_dir: str | Path, rank: int, host: str):
        path = Path(run_dir) / "logs"
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"rank{rank}.jsonl"
        self._f = LogFile(self.path, f"rank {rank} ({host})")
        self.base = {"rank": rank, "host": host}

    def write(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "time": round(time.time(), 3), **self.base, **fields}
        self._f.write(json.dumps(rec, default=float) + "\n")

    def close(self) -> None:
        self._f.close()


def rate_text(per_s: float) -> str:
    """12.3k above a thousand; plain below it (20 puzzles/s is not "0.0k")."""
    return f"{per_s / 1000:.1f}k" if per_s >= 1000 else f"{per_s:.1f}" if per_s < 100 else f"{per_s:.0f}"


class Progress:
    """`step 120/300 [####......] loss 2.31 | 41.2k tok/s | eta 1m05s` on one redrawn line."""

    def __init__(self, total: int, enabled: bool, every: int = 10, stream: TextIO | None = None):
        """On a terminal the line is redrawn every step; in a log file, every `every` steps."""
        self.total, self.enabled, self.stream, self.every = total, enabled, stream or sys.stderr, every
        self.tty = self.stream.isatty()
        self.unit = "tokens"  # the task's
        self._start: float | None = None
        self._start_step = 0

    def update(self, step: int, loss: float, units_per_s: float, extra: str = "",
               metrics: dict[str, float] | None = None) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self._start is None:
            self._start, self._start_step = now, step
        done = step - self._start_step
        rate = done / max(now - self._start, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else 0.0
        width = 20
        filled = int(width * step / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        shown = "".join(f" {k} {v:.4g}" for k, v in (metrics or {}).items())
        unit = "tok" if self.unit == "tokens" else self.unit
        line = (f"step {step}/{self.total} [{bar}] loss {loss:.4f}{shown} | {rate_text(units_per_s)} {unit}/s"
                f" | eta {int(eta // 60)}m{int(eta % 60):02d}s{extra}")
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            self.stream.flush()
        elif step % self.every == 0 or step >= self.total:
            self.stream.write(line + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        if self.tty and self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
        markers.write_line(text, self.stream)

    def close(self) -> None:
        if self.tty and self.enabled:
            self.stream.write("\n")
