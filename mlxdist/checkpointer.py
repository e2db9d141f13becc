"""The run's checkpoints: when to save, where, which one to resume from, and retention.

The file format and its atomic, checksummed writing live in `checkpoint.py`; this is the
component the loop talks to. Only rank 0 reads and writes files; the loop hands what it
read to the other ranks (all ranks hold identical state, DESIGN promise 3).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from .config import CheckpointConfig


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.cfg = cfg
        self.dir = run_dir / "checkpoints"

    def due(self, step: int, last: bool) -> bool:
        return bool(self.cfg.every and step % self.cfg.every == 0) or last

    def for_resume(self, warn: Callable[[str], None]) -> ckpt.Loaded | None:
        """What `checkpoint.resume` asks for: none, the newest whole one (auto), or a path."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume != "auto":
            return ckpt.load(self.cfg.resume)
        loaded = ckpt.load_latest(self.dir, warn=warn)
        if loaded is None:
            warn(f"resume=auto: no checkpoint in {self.dir}; starting fresh")
        return loaded

    def latest(self, warn: Callable[[str], None]) -> ckpt.Loaded | None:
        return ckpt.load_latest(self.dir, warn=warn)

    def save(self, step: int, weights: dict[str, np.ndarray], optimizer: dict[str, np.ndarray],
             meta: ckpt.CheckpointMeta) -> tuple[Path, float]:
        """Write one checkpoint and apply retention; returns its path and the seconds taken."""
        t0 = time.perf_counter()
        path = ckpt.save(self.dir, step, weights, optimizer, meta.to_dict(), self.cfg.zstd_level)
        ckpt.apply_retention(self.dir, self.cfg.keep_last, self.cfg.keep_best)
        return path, time.perf_counter() - t0
