"""The one seam between the trainer and the machine's memory numbers.

MLX's allocator reports what it holds and its peak (Metal on a Mac, CPU memory on Linux);
CUDA has its own counters; anything else falls back to the process's resident set against
the machine/cgroup limit. Tests (and users rehearsing on Linux) can override the limit with
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


def memory_reading(engine: str = "mlx") -> MemoryReading:
    """Bytes in use now, peak since the last `reset_peak`, and the limit to stay under."""
    if engine == "mlx":
        import mlx.core as mx

        # On a Mac the limit is Metal's recommended working set; on Linux, about the RAM.
        r = MemoryReading(mx.get_active_memory(), mx.get_peak_memory(), mx.get_memory_limit())
    elif "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        import torch

        r = MemoryReading(torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                          torch.cuda.get_device_properties(0).total_memory)
    else:
        r = _process_reading()
    limit = _override_limit()
    return MemoryReading(r.active, r.peak, limit) if limit else r


def reset_peak(engine: str = "mlx") -> None:
    """Start a new peak window, so each step's reading reflects that step's batch size."""
    if engine == "mlx":
        import mlx.core as mx

        mx.reset_peak_memory()
    elif "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.reset_peak_memory_stats()
