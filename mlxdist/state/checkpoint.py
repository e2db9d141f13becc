"""Checkpoints that survive a crash mid-write and a flipped bit on disk.

Layout of one checkpoint, `<dir>/step_00001200/`:
  model.safetensors          fp32 weights by parameter name (shared by both engines)
  optimizer.safetensors      AdamW moments `m.<name>`, `v.<name>`
  sync.safetensors           the sync strategy's shared arrays (DiLoCo's outer momentum), if any
  ema.safetensors            the EMA copy of the weights (`train.ema`), if any
  task.safetensors           what a task carries between steps, each rank's as `rank<r>/<key>`, if any
  state.json                 step, sampler position, run id, controllers, resolved config
  manifest.json              sha256 and size of each file above, and the run id; written last

Every run has an id (`run_id`, made when a fresh run starts and kept across resumes and elastic
restarts): retention and rollback touch only their own run's checkpoints, and a fresh run
does not start into a folder that holds another run's (`checkpointer.py`).

The array files are plain safetensors, not compressed: zstd (level 3) saved only 7-8% of
trained fp32 weights and AdamW moments while making a save 2.6-7.5x and a load 1.5-3x
slower, and a plain file is memory-mapped and read by any safetensors tool (`safe_open`,
`mx.load`) without this project. `python -m mlxdist.bench checkpoint-io` measures the trade again on
any machine. Checkpoints written before hold `NAME.safetensors.zst`; `load` reads either.

A checkpoint is written into a temporary directory and renamed into place, so a crash
leaves either the old set or the new one (a crash mid-write leaves the temporary directory,
`.tmp_step_*`, which the run's next start removes). A checkpoint whose manifest is missing or
whose checksums do not match is skipped with a warning and never deleted: where the run would
write that step again it is first moved aside to `unverified_step_*`. Weights that hold NaN or
infinity are never written as a checkpoint (`NonFiniteError`): the last finite one stays the
newest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy as st
import zstandard
from safetensors import SafetensorError

from .. import gate

MANIFEST = "manifest.json"
EXTRA_FILES = ("ema", "task")  # array files of optional parts, beside model, optimizer and sync
_UMASK = os.umask(0o22)
os.umask(_UMASK)


class CheckpointError(RuntimeError):
    pass


class NonFiniteError(CheckpointError):
    """The weights to save hold NaN or infinity: a checkpoint of them would be the newest
    "good" one, and `--resume auto` or a rollback would load the damage."""


TEMP_PREFIXES = (".tmp_step_", ".old_step_")  # a save in progress; left behind only by a crash
UNVERIFIED_PREFIX = "unverified_"


def _contiguous(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The safetensors package copies a tensor's buffer from its data pointer for nbytes, so a
    strided view (a transpose, a slice) would be written as the memory it happens to span."""
    out = {}
    for name, value in arrays.items():
        a = np.asarray(value)  # a 0-d array stays 0-d (np.ascontiguousarray makes it 1-d)
        out[name] = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    return out


def to_safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors encoding of `arrays` as bytes, for files that are compressed or hashed
    before they are written."""
    try:
        return st.save(_contiguous(arrays), metadata=metadata)
    except SafetensorError as e:  # an array of a dtype safetensors lacks (object, str)
        raise CheckpointError(f"cannot store these arrays as safetensors: {e}") from None


def from_safetensors(data: bytes) -> dict[str, np.ndarray]:
    return st.load(data)


def array_file(name: str, level: int | None) -> str:
    return f"{name}.safetensors" + (".zst" if level is not None else "")


def write_arrays(path: Path, arrays: dict[str, np.ndarray], level: int | None = None) -> None:
    """One array file, on the disk before this returns: zstd-compressed at `level`, or plain
    (None) straight from the arrays, with no copy of the whole file in memory."""
    if level is not None:
        cctx = zstandard.ZstdCompressor(level=level, threads=-1)
        write_synced(path, cctx.compress(to_safetensors(arrays)))
        return
    try:
        st.save_file(_contiguous(arrays), str(path))
    except SafetensorError as e:
        os_error = re.search(r"\(os error (\d+)\)", str(e))  # the package wraps a failed write (a full disk)
        if os_error:
            code = int(os_error.group(1))
            raise OSError(code, os.strerror(code), str(path)) from None
        raise CheckpointError(f"cannot store {path.name}: {e}") from None
    os.chmod(path, 0o666 & ~_UMASK)  # the package creates it 0600; the files beside it follow the umask
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """An array file of either kind, by its suffix (writable arrays, not views of the file)."""
    try:
        if path.suffix == ".zst":  # decompressed in pieces against a cap: a small file may declare GiBs
            return from_safetensors(gate.decompress_zstd(path, "compressed array file"))
        gate.regular_file(path, "array file")
        return st.load_file(str(path))
    # Whole by its sha256, yet not ours to read: another tool's file, or a dtype numpy lacks
    # (BF16: checkpoints hold fp32 master weights, never bfloat16).
    except (SafetensorError, zstandard.ZstdError, KeyError, gate.FileRefused) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def file_sha256(path: Path) -> str:
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
    run_id: str | None = None  # made by a fresh run, taken over from the checkpoint by a resume

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
    extra: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # ema, task: files of optional parts

    @property
    def meta(self) -> CheckpointMeta:
        return CheckpointMeta.from_dict(self.state)


# Checkpoints known whole, by path and the size/mtime of their files: retention consults
# it so that a save does not re-hash every kept checkpoint.
_WHOLE: set[tuple] = set()


def _signature(path: Path) -> tuple:
    return (str(path), *sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()))


def save(directory: str | Path, step: int, weights: dict[str, np.ndarray], optimizer: dict[str, np.ndarray],
         state: dict[str, Any], sync: dict[str, np.ndarray] | None = None,
         extra: dict[str, dict[str, np.ndarray]] | None = None, warn: Callable[[str], None] | None = None) -> Path:
    """The checkpoint of `step` in `directory`, written whole or not at all. Refuses weights
    that are not finite (`NonFiniteError`); a failed write (a full disk) removes its partial
    files and says which step and where, leaving the earlier checkpoints as they were. A copy
    of the same step already there is replaced only if it verifies; one that does not is moved
    aside and `warn` says so."""
    root = Path(directory)
    for part, arrays in (("weight", weights), ("EMA weight", (extra or {}).get("ema", {}))):
        bad = first_nonfinite(arrays)
        if bad is not None:
            raise NonFiniteError(f"step {step}: {part} '{bad}' holds NaN or infinity, so no checkpoint of it was "
                                 f"written to {root}; the checkpoints already there are unchanged")
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return _save(root, tmp, step, weights, optimizer, state, sync, extra, warn or _stderr)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint of step {step} could not be written to {root}: {e.strerror or e}"
                              f"{f' ({e.filename})' if e.filename else ''}; its partial files were removed and "
                              "the earlier checkpoints there are unchanged: free space (or fix the folder), then "
                              "continue with --resume auto") from None


def _save(root: Path, tmp: Path, step: int, weights: dict[str, np.ndarray], optimizer: dict[str, np.ndarray],
          state: dict[str, Any], sync: dict[str, np.ndarray] | None,
          extra: dict[str, dict[str, np.ndarray]] | None, warn: Callable[[str], None]) -> Path:
    final = root / f"step_{step:08d}"
    if final.is_dir():
        problem = verify(final, cached=True)
        if problem is not None:
            moved = move_aside(final)
            warn(f"checkpoint: {final} fails verification ({problem}); moved aside to {moved.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    names = []
    for name, arrays in (("model", weights), ("optimizer", optimizer), ("sync", sync or {}), *(extra or {}).items()):
        if arrays or name in ("model", "optimizer"):
            names.append(array_file(name, None))
            write_arrays(tmp / names[-1], arrays)
    names.append("state.json")
    write_synced(tmp / "state.json", json.dumps(state, indent=1, default=float).encode())
    manifest = {"step": step, "created": time.time(), "run_id": state.get("run_id"),
                "files": {n: {"sha256": file_sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in names}}
    write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    if final.exists():  # same step saved again by this run (the final save right after a periodic one)
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


def first_nonfinite(arrays: dict[str, np.ndarray]) -> str | None:
    """The name of the first float array holding NaN or infinity (min and max carry both, in
    two passes that allocate nothing), or None."""
    for name, value in arrays.items():
        a = np.asarray(value)
        if a.dtype.kind == "f" and a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):
            return name
    return None


def verify(path: Path, cached: bool = False) -> str | None:
    """None if the checkpoint is whole, else why not. Re-hashes every file, unless `cached` and
    this process verified or wrote it with the same files (sizes, mtimes) already."""
    if cached and _known_whole(path):
        return None
    mf = path / MANIFEST
    if not mf.is_file():
        return "no manifest (write did not finish)"
    try:
        manifest = gate.read_json(mf, "manifest", MANIFEST_SPEC, max_bytes=MiB)
    except gate.FileRefused as e:
        return f"manifest unreadable ({str(e).removeprefix(str(mf) + ': ')})"
    files = manifest["files"]
    if not files.keys() & {"state.json"} or not any(n in files for n in _required("model")):
        return "the manifest does not list state.json and the model's weights"
    unlisted = sorted(n for n in _data_files(path) if n not in files)
    if unlisted:  # a file the loader would read that no checksum covers
        return f"{unlisted[0]} is not in the manifest"
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["bytes"] or file_sha256(f) != info["sha256"]:
            return f"{name} fails its sha256 check"
    _WHOLE.add(_signature(path))
    return None


def _required(name: str) -> tuple[str, str]:
    return array_file(name, None), array_file(name, 0)


def _data_files(path: Path) -> list[str]:
    """The files of `path` that `load` reads: state.json and every array file. Other files (a
    hook's export beside the checkpoint) are not part of it."""
    return [f.name for f in path.iterdir()
            if f.name == "state.json" or f.name.endswith((".safetensors", ".safetensors.zst"))]


MiB = 1 << 20
_FILE_NAME = gate.Where(gate.Str(255), lambda n: None if re.fullmatch(r"[A-Za-z0-9_.-]+", n) and n not in (".", "..")
                        else "is not a file name of a checkpoint")
MANIFEST_SPEC = gate.Dict({
    "step": gate.Int(), "created": gate.Float(), "run_id": gate.Maybe(gate.Str(200)),
    "files": gate.Dict(values=gate.Dict({"sha256": gate.Str(64), "bytes": gate.Int()}, required=("sha256", "bytes")),
                       max_len=1000)}, required=("files",), values=gate.Tree())

# state.json: what the trainer and your-loop checkpoints read from it (other keys: plain data).
_RUN = {"step": gate.Int(), "position": gate.Int(), "lr_scale": gate.Float(lo=1e-30, hi=1e30),
        "plateau_scale": gate.Float(lo=1e-30, hi=1e30), "eval_loss": gate.Maybe(gate.Float(finite=False)),
        "best_eval": gate.Maybe(gate.Float(finite=False)), "run_id": gate.Maybe(gate.Str(200))}
STATE_SPEC = gate.Dict({
    **_RUN, "optimizer_step": gate.Int(), "controllers": gate.Dict(values=gate.Tree()), "world_size": gate.Int(lo=1),
    "hosts": gate.List(gate.Str(), max_len=100_000), "engine": gate.Str(50), "config": gate.Dict(values=gate.Tree()),
    "global_batch": gate.Maybe(gate.Int(lo=1)), "base_fingerprint": gate.Maybe(gate.Str(200)),
    "base_files": gate.Dict(values=gate.Tree()), "your_loop": gate.Str(50),
    "loop_state": gate.Dict(values=gate.Tree())}, required=("step",), values=gate.Tree())


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's `state.json`, checked: a step, numbers in range, plain data elsewhere."""
    return gate.read_json(path / "state.json", "checkpoint state", STATE_SPEC)


def _known_whole(path: Path) -> bool:
    """`verify` that trusts an earlier verdict while no file of the checkpoint changed."""
    try:
        if _signature(path) in _WHOLE:
            return True
    except OSError:
        return False
    return verify(path) is None


def new_run_id() -> str:
    """A run's id: when it started, and a random part so two runs started at once differ."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(4)


def run_id_of(path: str | Path) -> str | None:
    """The id of the run that wrote the checkpoint at `path`; None for one written before
    runs had ids (or whose files cannot be read)."""
    for name in (MANIFEST, "state.json"):
        try:
            found = gate.read_json(Path(path) / name, name, max_bytes=gate.JSON_BYTES).get("run_id")
        except (gate.FileRefused, AttributeError):
            continue
        if found is not None:
            return str(found)
    return None


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

    def arrays(name: str) -> dict[str, np.ndarray]:
        for f in (p / array_file(name, None), p / array_file(name, 0)):  # plain, or zstd as before
            if f.is_file():
                return read_arrays(f)
        return {}

    optimizer, sync = arrays("optimizer"), arrays("sync")
    # Checkpoints from before the sync strategy had a file of its own kept it in the optimizer's.
    legacy = [k for k in optimizer if k.startswith("outer.")]
    sync.update({k[len("outer."):]: optimizer.pop(k) for k in legacy})
    return Loaded(path=p, weights=arrays("model"), optimizer=optimizer, state=read_state(p), sync=sync,
                  extra={name: arrays(name) for name in EXTRA_FILES if (p / array_file(name, None)).is_file()})


def load_latest(directory: str | Path, warn=print) -> Loaded | None:
    """Newest checkpoint that verifies; each corrupt newer one is reported and left alone."""
    for path in reversed(list_checkpoints(directory)):
        problem = verify(path)
        if problem is None:
            return load(path, verified=True)
        warn(f"checkpoint {path} is unusable ({problem}); falling back to the previous one")
    return None


def move_aside(path: Path) -> Path:
    """Rename a checkpoint that failed verification to `unverified_step_*` beside it, so the run
    does not write that step over it and nothing reads it as a checkpoint; returns the new path."""
    target = path.with_name(UNVERIFIED_PREFIX + path.name)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{UNVERIFIED_PREFIX}{path.name}.{n}")
    path.rename(target)
    return target


def remove_temporaries(directory: Path) -> list[tuple[Path, int]]:
    """Delete what interrupted saves left in `directory` (`.tmp_step_*`, `.old_step_*`); returns
    each with its bytes."""
    if not directory.is_dir():
        return []
    removed = []
    for p in sorted(directory.iterdir()):
        if p.is_dir() and p.name.startswith(TEMP_PREFIXES):
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append((p, size))
    return removed


_RETENTION_WARNED: set[str] = set()


def apply_retention(directory: str | Path, keep_last: int, keep_best: bool,
                    run_ids: Collection[str | None] | None = None, newest: Path | None = None,
                    warn: Callable[[str], None] | None = None) -> list[Path]:
    """Delete old *valid* checkpoints beyond the newest `keep_last` (and the best by eval loss).

    Only checkpoints of the runs in `run_ids` (this run's id, and None where it continued a
    checkpoint from before run ids) are considered; None: all of them. `newest`, the one just
    written, is always kept, even where the run went back to an older step. Corrupt
    checkpoints and other runs' are never deleted automatically: they may be someone's only copy.
    One that cannot be deleted (permissions, a read-only disk) is reported once through `warn`
    and kept: training goes on, it only costs disk space.
    """
    ours = [p for p in list_checkpoints(directory) if run_ids is None or run_id_of(p) in run_ids]
    valid = [p for p in ours if _known_whole(p)]
    keep = set(valid[-keep_last:]) | ({Path(newest)} if newest is not None else set())
    if keep_best:
        scored = []
        for p in valid:
            try:
                loss = read_state(p).get("eval_loss")
            except gate.FileRefused:
                continue
            if loss is not None:
                scored.append((loss, p))
        if scored:
            keep.add(min(scored)[1])
    removed = []
    for p in (p for p in valid if p not in keep):
        try:
            shutil.rmtree(p)
            removed.append(p)
        except OSError as e:
            if str(p) not in _RETENTION_WARNED:
                _RETENTION_WARNED.add(str(p))
                (warn or _stderr)(f"warning: retention (checkpoint.keep_last={keep_last}) cannot delete {p}: "
                                  f"{e.strerror or e}; it is kept and training goes on (delete it by hand to free "
                                  "the space)")
    return removed


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
