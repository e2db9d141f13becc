"""The seam between the trainer and the machine's memory numbers.

Each engine reads its own allocator (MLX: Metal on a Mac, CPU memory on Linux; CUDA: its
counters); anything else falls back to the process's resident set against the
machine/cgroup limit. Tests (and users rehearsing on Linux) can override the limit with
MLXDIST_MEMORY_LIMIT_BYTES, or MLXDIST_MEMORY_LIMIT_FILE (re-read at every step, so a test
can lower it mid-run), to make the batch-size controller act.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemoryReading:
    active: int
    peak: int
    limit: int


def _linux_limit() -> int:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
            if raw != "max" and int(raw) < 1 << 60:
                return int(raw)
        except (OSError, ValueError):
            pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _process_reading() -> MemoryReading:
    try:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = 0
    scale = 1 if sys.platform == "darwin" else 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return MemoryReading(rss, max(peak, rss), _linux_limit() if sys.platform == "linux" else 0)


def _override_limit() -> int | None:
    path = os.environ.get("MLXDIST_MEMORY_LIMIT_FILE")
    if path:
        try:
            return int(Path(path).read_text().strip())
        except (OSError, ValueError):
            return None
    value = os.environ.get("MLXDIST_MEMORY_LIMIT_BYTES")
    return int(value) if value else None


def with_override(reading: MemoryReading) -> MemoryReading:
    """The engine's own reading, with the limit replaced when the environment sets one."""
    limit = _override_limit()
    return MemoryReading(reading.active, reading.peak, limit) if limit else reading


def process_reading() -> MemoryReading:
    """For devices without allocator counters (CPU torch, MPS): the process's resident set."""
    return with_override(_process_reading())
