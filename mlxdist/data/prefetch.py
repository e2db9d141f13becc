"""Background prefetch: the next steps' batches are read while the current step computes.

A bounded queue caps memory; an exception in the worker is re-raised in the training
thread (a silent dead worker would look like a hang); the time the loop waits is measured
so a data-starved run shows up in the metrics. mlxdist's own one-line errors (`ConfigError`,
e.g. a token id outside the vocabulary) are re-raised as they are, so they end the run with
their own line and exit code 2, as they would without the prefetcher.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import ConfigError


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    def __init__(self, produce: Callable[[int], Any], start: int, depth: int = 4):
        """`produce(step)` makes step's batch; steps start, start+1, ... are made in order."""
        self._produce = produce
        self._next = start
        self._depth = depth
        self.wait_seconds = 0.0
        self._stop = threading.Event()
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._run, args=(start,), daemon=True, name="prefetch")
            self._thread.start()

    def _run(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item: Any = (step, self._produce(step))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                item = _Failure(e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return
            step += 1

    def get(self, step: int) -> Any:
        """The batch for `step`; steps must be asked for in order."""
        if step != self._next:
            raise RuntimeError(f"prefetch: asked for step {step}, expected {self._next}")
        self._next += 1
        t0 = time.perf_counter()
        if self._depth == 0:
            item = self._produce(step)
            self.wait_seconds += time.perf_counter() - t0
            return item
        while True:
            try:
                got = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("prefetch: worker thread ended unexpectedly") from None
        self.wait_seconds += time.perf_counter() - t0
        if isinstance(got, _Failure):
            if isinstance(got.exc, ConfigError):
                raise got.exc
            raise RuntimeError(f"prefetch: producing step {step} failed: {got.exc!r}") from got.exc
        return got[1]

    def close(self) -> None:
        self._stop.set()
        if self._depth > 0:
            self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
