"""The seam between the trainer and the machine's memory numbers.

Each engine reads its own allocator (MLX: Metal on a Mac, CPU memory on Linux; torch: CUDA's
counters, or MPS's); anything else falls back to the process's resident set against the
machine/cgroup limit. The Mac-only readings are pure functions of what the caller passes in
(`mlx_memory_limit`, `mps_reading`), so their logic is tested on Linux. Tests (and users rehearsing on Linux) can override the limit with
MLXDIST_MEMORY_LIMIT_BYTES, or MLXDIST_MEMORY_LIMIT_FILE (re-read at every step, so a test
can lower it mid-run), to make the batch-size controller act.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    return _machine_limit()


def _machine_limit() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0


def process_numbers(platform: str, rss: int, maxrss: int, limit: int) -> MemoryReading:
    """A reading from the process's numbers: `rss` in bytes (0 where unknown: macOS has no
    /proc), `maxrss` as `getrusage` gives it (bytes on macOS, KiB on Linux), `limit` the
    machine's or cgroup's bytes."""
    peak = maxrss * (1 if platform == "darwin" else 1024)
    return MemoryReading(rss or peak, max(peak, rss), limit)


def _process_reading() -> MemoryReading:
    try:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = 0
    limit = _linux_limit() if sys.platform == "linux" else _machine_limit()
    return process_numbers(sys.platform, rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, limit)


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


# `mx.device_info()` on Metal (mlx/backend/metal/device_info.cpp): the GPU's
# `recommendedMaxWorkingSetSize`, in bytes.
METAL_WORKING_SET_KEY = "max_recommended_working_set_size"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def mlx_memory_limit(device_info: dict[str, Any], memory_limit: int, platform: str) -> tuple[int, str]:
    """The limit the memory controller measures MLX against, and its name for the banner.

    On a Mac: Metal's recommended working set. `mx.get_memory_limit()` is MLX's allocator
    limit there, set to min(1.5 x working set, 0.95 x RAM) (mlx/backend/metal/allocator.cpp),
    so `memory_target: 0.85` of it would let a step grow past the working set into GPU paging.
    Elsewhere (MLX on the CPU, or a Mac whose default device reports no working set):
    `memory_limit`, what `mx.get_memory_limit()` returned."""
    working_set = device_info.get(METAL_WORKING_SET_KEY) if platform == "darwin" else None
    if isinstance(working_set, int) and working_set > 0:
        return working_set, (f"memory limit {_gib(working_set)}: Metal's recommended working set "
                             f"(MLX's own limit is {_gib(memory_limit)})")
    return memory_limit, f"memory limit {_gib(memory_limit)}: mx.get_memory_limit()"


def mps_reading(mps: Any) -> MemoryReading:
    """PyTorch on Apple's GPU, from a `torch.mps`-like module: tensors now
    (`current_allocated_memory`), everything Metal holds for the process including the
    allocator's cached blocks (`driver_allocated_memory`, the nearest thing MPS has to a
    step's peak: the cache keeps what the step needed), against Metal's recommended working
    set (`recommended_max_memory`; MPS refuses allocations only at 1.7x that by default,
    PYTORCH_MPS_HIGH_WATERMARK_RATIO). The override variables apply as elsewhere."""
    active = int(mps.current_allocated_memory())
    peak = max(int(mps.driver_allocated_memory()), active)
    return with_override(MemoryReading(active, peak, int(mps.recommended_max_memory())))
