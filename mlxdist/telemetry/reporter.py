"""One event, every sink: a decision or observation is emitted once, by kind and fields,
and becomes the JSONL event, the Prometheus metric, rank 0's experiment-tracker scalars
(`train.report_to`) and (when it has text) the log line here.

The loop never talks to a sink directly, so a new decision cannot be logged but not
counted, or counted under a name the event log does not use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import markers
from .events import EventLog, LogFile, Progress
from .metrics import Metrics
from .trackers import Trackers


class Log:
    """Rank 0 talks to the terminal; other ranks write `logs/rankN.log` (same lines)."""

    def __init__(self, rank: int, label: str, run_dir: Path, progress: Progress | None = None):
        self.label = label
        self.file: LogFile | None = None
        if rank != 0:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            self.file = LogFile(run_dir / "logs" / f"rank{rank}.log", label)
        self.progress = progress

    def __call__(self, text: str) -> None:
        if self.file:
            self.file.write(f"[{self.label}] {text}\n")
        elif self.progress is not None:
            self.progress.message(text)
        else:
            markers.write_line(text)

    def close(self) -> None:
        if self.file:
            self.file.close()


class Reporter:
    def __init__(self, log: Log, events: EventLog, metrics: Metrics, progress: Progress,
                 trackers: Trackers | None = None):
        self.log, self.events, self.metrics, self.progress = log, events, metrics, progress
        self.trackers = trackers if trackers is not None else Trackers([])
        self.trackers.warn = log
        log.progress = progress
        if self.trackers.backends:
            log(f"report_to: {self.trackers.describe()}")
        # Rank 0 also tells launch/mlxrun its steps and checkpoints (the elastic supervisor's clock).
        self.tell_supervisor = events.base.get("rank") == 0

    def emit(self, kind: str, text: str | None = None, **fields: Any) -> None:
        """Record `kind` with `fields` in every sink; `text` is the human's version of it."""
        self.events.write(kind, **fields)
        self.metrics.record(kind, fields)
        self.trackers.record(kind, fields)
        if self.tell_supervisor:
            markers.announce_event(kind, fields)
        if text:
            self.log(text)

    def say(self, text: str) -> None:
        """Banner lines and notices that are neither decisions nor observations."""
        self.log(text)

    def close(self) -> None:
        self.trackers.close()  # first: its warnings still have a log to go to
        self.progress.close()
        self.events.close()
        self.log.close()
