"""Per-rank checkpoint files: state that differs between ranks by design.

In DDP every rank holds the same weights and moments, so rank 0's checkpoint is the whole
truth. In DiLoCo each rank trains its own copy between outer syncs: its local weights,
AdamW moments and wire residuals are its own. Exact resume needs them, so every rank
writes one file next to the run (on its own host's disk: Macs share no filesystem), and
reads it back only if every rank of the same cluster found a whole one. Otherwise the run
resumes from the shared state alone, which is still correct, just not bit-identical.

Layout: RUN_DIR/rank_state/step_NNNNNNNN/rankR.safetensors and rankR.json (the
sha256 of the data file and what it belongs to). Written to a temporary name and renamed,
so a crash leaves either the old file or the new one. Not compressed: trained fp32
weights barely compress, and this file is written by every rank at every checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .. import gate
from .checkpoint import from_safetensors, to_safetensors, write_synced


@dataclass
class RankStateInfo:
    step: int
    rank: int
    world_size: int
    hosts: list[str]
    optimizer_step: int
    sha256: str = ""


def _paths(root: Path, step: int, rank: int) -> tuple[Path, Path]:
    d = root / f"step_{step:08d}"
    return d / f"rank{rank}.safetensors", d / f"rank{rank}.json"


def save(root: Path, info: RankStateInfo, arrays: dict[str, np.ndarray], keep: int) -> Path:
    data_path, info_path = _paths(root, info.step, info.rank)
    data = to_safetensors(arrays)
    info.sha256 = hashlib.sha256(data).hexdigest()
    for path, blob in ((data_path, data), (info_path, json.dumps(asdict(info)).encode())):
        _write_in_shared_folder(path, blob)
    _prune(root, info.rank, keep)
    return data_path


def _write_in_shared_folder(path: Path, blob: bytes, tries: int = 5) -> None:
    """Ranks on one host share a step folder, and another rank's prune may remove it while
    it is still empty, between our mkdir and our write: make it again and retry."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    for attempt in range(tries):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_synced(tmp, blob)
            break
        except FileNotFoundError:
            if attempt == tries - 1:
                raise
    os.replace(tmp, path)


_INFO = gate.Dict({"step": gate.Int(), "rank": gate.Int(), "world_size": gate.Int(lo=1),
                   "hosts": gate.List(gate.Str(255), max_len=100_000), "optimizer_step": gate.Int(),
                   "sha256": gate.Str(64)}, required=("step", "rank", "world_size", "hosts", "optimizer_step"))


class RankStateMissing(Exception):
    """This rank has no usable file for the step; the message says why."""


def load(root: Path, step: int, rank: int, world_size: int, hosts: list[str]) -> tuple[dict[str, np.ndarray], int]:
    """This rank's arrays for `step` and the optimizer's update count, if its file is whole
    and was written by this same cluster; else RankStateMissing."""
    data_path, info_path = _paths(root, step, rank)
    if not info_path.is_file() or not data_path.is_file():
        raise RankStateMissing(f"no rank state for step {step} in {root}")
    try:
        info = RankStateInfo(**gate.read_json(info_path, "rank state", _INFO, max_bytes=1 << 20))
    except gate.FileRefused as e:
        raise RankStateMissing(f"{info_path} is unreadable ({e.problem})") from None
    if (info.step, info.rank, info.world_size, info.hosts) != (step, rank, world_size, hosts):
        raise RankStateMissing(f"{data_path} was written by another cluster "
                               f"({info.world_size} ranks on {', '.join(info.hosts)})")
    try:
        data = gate.read_bytes(data_path, "rank state", max_bytes=gate.DECOMPRESSED_BYTES)
    except gate.FileRefused as e:
        raise RankStateMissing(f"{data_path} is unreadable ({e.problem})") from None
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise RankStateMissing(f"{data_path} fails its sha256 check")
    return from_safetensors(data), info.optimizer_step


def _prune(root: Path, rank: int, keep: int) -> None:
    """Keep this rank's newest `keep` files; other ranks prune their own. The folder goes
    only when empty (rmdir, never rmtree): another rank may be writing into it right now."""
    mine = sorted(p for p in root.glob(f"step_*/rank{rank}.json"))
    for info_path in mine[:-keep] if keep else []:
        data_path = info_path.with_name(f"rank{rank}.safetensors")
        data_path.unlink(missing_ok=True)
        info_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            info_path.parent.rmdir()
