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


class TokenStream:
    """Several shard memmaps read as one token sequence, without loading them.

    Slices that cross a shard boundary are stitched from the two pieces; nothing else is
    ever copied, so a 10 GB corpus costs each rank only the windows it reads.
    """

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.arrays = arrays
        self.offsets = np.cumsum([0] + [len(a) for a in arrays])
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> TokenStream:
        return TokenStream(self.arrays, self.start + start, self.start + stop)

    def read(self, start: int, stop: int) -> np.ndarray:
        lo, hi = self.start + start, self.start + min(stop, len(self))
        parts = []
        while lo < hi:
            k = int(np.searchsorted(self.offsets, lo, side="right")) - 1
            end = min(hi, int(self.offsets[k + 1]))
            parts.append(self.arrays[k][lo - self.offsets[k] : end - self.offsets[k]])
            lo = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def read_shards(path: str | Path) -> tuple[TokenStream, dict]:
    """All shards as one lazily read token stream, and the index describing them."""
    root = Path(path)
    index_file = root / INDEX if root.is_dir() else root
    if not index_file.is_file():
        raise FileNotFoundError(f"data.path: no {INDEX} in '{path}'; make one with `python -m mlxdist.prepare`")
    try:
        index = json.loads(index_file.read_text())
        arrays = [np.memmap(index_file.parent / s["file"], dtype=index["dtype"], mode="r")
                  for s in index["shards"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"data.path: {index_file} is not a valid shard index ({e}); "
                         "remake it with `python -m mlxdist.prepare`") from None
    if not arrays:
        raise ValueError(f"data.path: '{path}' has no shards")
    return TokenStream(arrays), index
