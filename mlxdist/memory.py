"""The one seam between the trainer and the machine's memory numbers.

On a Mac, MLX's Metal allocator reports what the GPU side holds and the limit it will
allow; elsewhere the process's resident set against the machine/cgroup limit is the best
stand-in. Tests (and users rehearsing on Linux) can override the reading with
MLXDIST_MEMORY_LIMIT_BYTES to make the batch-size controller act.
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


def memory_reading(engine: str = "mlx") -> MemoryReading:
    override = os.environ.get("MLXDIST_MEMORY_LIMIT_BYTES")
    if engine == "mlx" and sys.platform == "darwin":
        import mlx.core as mx

        info = mx.device_info()
        r = MemoryReading(mx.get_active_memory(), mx.get_peak_memory(),
                          int(info.get("max_recommended_working_set_size", info.get("memory_size", 0))))
    else:
        r = _process_reading()
    if override:
        r = MemoryReading(r.active, r.peak, int(override))
    return r
