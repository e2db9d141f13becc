"""Checkpoints that survive a crash mid-write and a flipped bit on disk.

Layout of one checkpoint, `<dir>/step_00001200/`:
  model.safetensors.zst      fp32 weights by parameter name (shared by both engines)
  optimizer.safetensors.zst  AdamW moments `m.<name>`, `v.<name>`
  sync.safetensors.zst       the sync strategy's shared arrays (DiLoCo's outer momentum), if any
  state.json                 step, sampler position, controllers, resolved config
  manifest.json              sha256 and size of each file above; written last

A checkpoint is written into a temporary directory and renamed into place, so a crash
leaves either the old set or the new one. A checkpoint whose manifest is missing or whose
checksums do not match is skipped with a warning, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

MANIFEST = "manifest.json"
_DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64, "F64": np.float64}
_CODES = {np.dtype(v).str: k for k, v in _DTYPES.items()}


class CheckpointError(RuntimeError):
    pass


def to_safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """Serialise to the safetensors layout (header length, JSON header, raw little-endian data)."""
    header: dict[str, Any] = {"__metadata__": metadata or {}}
    offset, blobs = 0, []
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        code = _CODES.get(a.dtype.str)
        if code is None:
            raise CheckpointError(f"cannot store {name}: dtype {a.dtype} not supported")
        blob = a.tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def from_safetensors(data: bytes) -> dict[str, np.ndarray]:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(body[b:e], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"]).copy()
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_synced(path: Path, data: bytes) -> None:
    """Bytes on the disk, not in a cache, before the caller renames them into place."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class RunState:
    """What the loop itself must carry across a resume, besides weights and controllers."""

    step: int = 0
    position: int = 0  # samples of the global stream consumed
    lr_scale: float = 1.0  # lowered by rollbacks
    plateau_scale: float = 1.0  # lowered by reduce-on-plateau
    eval_loss: float | None = None
    best_eval: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From a checkpoint's flat state (unknown keys ignored, missing ones keep their value)."""
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


@dataclass
class CheckpointMeta:
    """Everything in `state.json`. Stored flat (the run state's fields beside the others) so
    checkpoints written before this type existed still load; unknown keys are ignored and
    missing ones take their defaults."""

    run: RunState = field(default_factory=RunState)
    optimizer_step: int = 0
    controllers: dict = field(default_factory=dict)
    world_size: int = 1
    hosts: list = field(default_factory=list)
    engine: str = "mlx"
    config: dict = field(default_factory=dict)
    global_batch: int | None = None
    base_fingerprint: str | None = None  # of a pretrained base (LoRA checkpoints hold no base weights)
    base_files: dict = field(default_factory=dict)  # its weight files' digests, to name the one that differs

    def to_dict(self) -> dict[str, Any]:
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "run"}
        return asdict(self.run) | flat

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointMeta:
        run = RunState(**{f.name: d[f.name] for f in fields(RunState) if f.name in d})
        return cls(run=run, **{f.name: d[f.name] for f in fields(cls) if f.name != "run" and f.name in d})


@dataclass
class Loaded:
    path: Path
    weights: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    state: dict[str, Any]
    sync: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def meta(self) -> CheckpointMeta:
        return CheckpointMeta.from_dict(self.state)


# Checkpoints known whole, by path and the size/mtime of their files: retention consults
# it so that a save does not re-hash every kept checkpoint.
_WHOLE: set[tuple] = set()


def _signature(path: Path) -> tuple:
    return (str(path), *sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()))


def save(directory: str | Path, step: int, weights: dict[str, np.ndarray], optimizer: dict[str, np.ndarray],
         state: dict[str, Any], level: int = 3, sync: dict[str, np.ndarray] | None = None) -> Path:
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    cctx = zstandard.ZstdCompressor(level=level, threads=-1)
    files = {
        "model.safetensors.zst": cctx.compress(to_safetensors(weights)),
        "optimizer.safetensors.zst": cctx.compress(to_safetensors(optimizer)),
        "state.json": json.dumps(state, indent=1, default=float).encode(),
    }
    if sync:
        files["sync.safetensors.zst"] = cctx.compress(to_safetensors(sync))
    for name, data in files.items():
        write_synced(tmp / name, data)
    manifest = {"step": step, "created": time.time(),
                "files": {n: {"sha256": _sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in files}}
    write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    if final.exists():  # same step saved again (e.g. final save right after a periodic one)
        old = root / f".old_step_{step:08d}_{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _WHOLE.add(_signature(final))  # hashed just above, while writing
    return final


def verify(path: Path) -> str | None:
    """None if the checkpoint is whole, else why not (always re-hashes)."""
    mf = path / MANIFEST
    if not mf.is_file():
        return "no manifest (write did not finish)"
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError:
        return "manifest is not valid JSON"
    for name, info in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["bytes"] or _sha256(f) != info["sha256"]:
            return f"{name} fails its sha256 check"
    _WHOLE.add(_signature(path))
    return None


def _known_whole(path: Path) -> bool:
    """`verify` that trusts an earlier verdict while no file of the checkpoint changed."""
    try:
        if _signature(path) in _WHOLE:
            return True
    except OSError:
        return False
    return verify(path) is None


def list_checkpoints(directory: str | Path) -> list[Path]:
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: p.name)


def load(path: str | Path, verified: bool = False) -> Loaded:
    """Read a checkpoint; it is verified here unless the caller just did."""
    p = Path(path)
    problem = None if verified else verify(p)
    if problem:
        raise CheckpointError(f"checkpoint {p}: {problem}")
    dctx = zstandard.ZstdDecompressor()

    def arrays(name: str) -> dict[str, np.ndarray]:
        f = p / f"{name}.safetensors.zst"
        return from_safetensors(dctx.decompress(f.read_bytes())) if f.is_file() else {}

    optimizer, sync = arrays("optimizer"), arrays("sync")
    # Checkpoints from before the sync strategy had a file of its own kept it in the optimizer's.
    legacy = [k for k in optimizer if k.startswith("outer.")]
    sync.update({k[len("outer."):]: optimizer.pop(k) for k in legacy})
    return Loaded(path=p, weights=arrays("model"), optimizer=optimizer,
                  state=json.loads((p / "state.json").read_text()), sync=sync)


def load_latest(directory: str | Path, warn=print) -> Loaded | None:
    """Newest checkpoint that verifies; each corrupt newer one is reported and left alone."""
    for path in reversed(list_checkpoints(directory)):
        problem = verify(path)
        if problem is None:
            return load(path, verified=True)
        warn(f"checkpoint {path} is unusable ({problem}); falling back to the previous one")
    return None


def apply_retention(directory: str | Path, keep_last: int, keep_best: bool) -> list[Path]:
    """Delete old *valid* checkpoints beyond the newest `keep_last` (and the best by eval loss).

    Corrupt checkpoints are never deleted automatically: they may be someone's only copy.
    """
    valid = [p for p in list_checkpoints(directory) if _known_whole(p)]
    keep = set(valid[-keep_last:])
    if keep_best:
        scored = []
        for p in valid:
            loss = json.loads((p / "state.json").read_text()).get("eval_loss")
            if loss is not None:
                scored.append((loss, p))
        if scored:
            keep.add(min(scored)[1])
    removed = [p for p in valid if p not in keep]
    for p in removed:
        shutil.rmtree(p)
    return removed
