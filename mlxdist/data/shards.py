"""Token shards on disk: flat uint16/uint32 files plus a JSON index, read through memmap.

Memmap keeps a 10 GB corpus off the heap, so every rank of a Mac cluster can open the
same files without each holding a copy in RAM.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

INDEX = "shards.json"


def write_shards(docs: Iterable[np.ndarray], out_dir: str | Path, shard_tokens: int = 50_000_000,
                 vocab_size: int = 258) -> dict:
    """Concatenate token documents into shard files; returns the index written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    shards: list[dict] = []
    buf: list[np.ndarray] = []
    count = 0

    def flush():
        nonlocal buf, count
        if not buf:
            return
        name = f"shard_{len(shards):05d}.bin"
        arr = np.concatenate(buf).astype(dtype)
        tmp = out / (name + ".tmp")
        arr.tofile(tmp)
        tmp.replace(out / name)
        shards.append({"file": name, "tokens": int(arr.size)})
        buf, count = [], 0

    for doc in docs:
        buf.append(np.asarray(doc))
        count += len(doc)
        if count >= shard_tokens:
            flush()
    flush()
    index = {"dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "shards": shards,
             "tokens": sum(s["tokens"] for s in shards)}
    (out / INDEX).write_text(json.dumps(index, indent=1))
    return index


def read_shards(path: str | Path) -> np.ndarray:
    """All shards as one token array (memmapped when there is a single shard)."""
    root = Path(path)
    index_file = root / INDEX if root.is_dir() else root
    if not index_file.is_file():
        raise FileNotFoundError(f"data.path: no {INDEX} in '{path}'; make one with `python -m mlxdist.prepare`")
    index = json.loads(index_file.read_text())
    arrays = [np.memmap(index_file.parent / s["file"], dtype=index["dtype"], mode="r")
              for s in index["shards"]]
    if not arrays:
        raise ValueError(f"data.path: '{path}' has no shards")
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
