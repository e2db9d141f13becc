"""Token shards on disk: flat uint16/uint32 files plus a JSON index, read through memmap.

Memmap keeps a 10 GB corpus off the heap, so every rank of a Mac cluster can open the
same files without each holding a copy in RAM.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..config import ConfigError

INDEX = "shards.json"


class DataError(ConfigError):
    """Data that cannot be trained as it is (an id outside the vocabulary, a shard outside
    data.path): one line naming the file and what to do, exit code 2, not a crash."""


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
    ever copied, so a 10 GB corpus costs each rank only the windows it reads. For the same
    reason ids are checked against `vocab_size` as they are read, not by a scan at open: an
    id past the embedding table is an out-of-bounds read in the engine (a segfault, or
    silent garbage), so it is refused with its file and position before it gets there.
    """

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None, *,
                 files: list[Path] | None = None, vocab_size: int | None = None):
        self.arrays = arrays
        self._plain = [np.asarray(a) for a in arrays]  # a memmap's slices and max() cost 3x more
        self.offsets = np.cumsum([0] + [len(a) for a in arrays])
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop
        self.files = files
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> TokenStream:
        return TokenStream(self.arrays, self.start + start, self.start + stop, files=self.files,
                           vocab_size=self.vocab_size)

    def read(self, start: int, stop: int) -> np.ndarray:
        lo, hi = self.start + start, self.start + min(stop, len(self))
        parts = []
        while lo < hi:
            k = int(np.searchsorted(self.offsets, lo, side="right")) - 1
            end = min(hi, int(self.offsets[k + 1]))
            part = self._plain[k][lo - self.offsets[k] : end - self.offsets[k]]
            if self.vocab_size is not None:
                self._check_ids(part, k, lo - int(self.offsets[k]))
            parts.append(part)
            lo = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _check_ids(self, part: np.ndarray, k: int, at: int) -> None:
        vocab = self.vocab_size
        if not part.size or (part.max() < vocab and (part.dtype.kind == "u" or part.min() >= 0)):
            return
        j = int(np.flatnonzero((part >= vocab) | (part < 0))[0])
        bad = int(part[j])
        name = self.files[k] if self.files else f"shard {k}"
        fix = f", or for a preset model set model.vocab_size={bad + 1} or more" if bad >= vocab else ""
        raise DataError(f"data.path: {name}: token id {bad} at position {at + j} (token offset in that file) "
                        f"is outside the model's vocabulary of {vocab} (ids 0..{vocab - 1}); re-tokenize the "
                        f"data with the model's tokenizer (python -m mlxdist.prepare){fix}")


def read_shards(path: str | Path, vocab_size: int | None = None) -> tuple[TokenStream, dict]:
    """All shards as one lazily read token stream, and the index describing them. With
    `vocab_size`, an id outside 0..vocab_size-1 is a `DataError` when its window is read.

    The index is data, not configuration: a `file` entry may only name a file inside the
    index's directory (after symlinks), so a downloaded or shared shards.json cannot make a
    rank read /etc/passwd or a neighbour's home as tokens.
    """
    root = Path(path)
    index_file = root / INDEX if root.is_dir() else root
    if not index_file.is_file():
        raise FileNotFoundError(f"data.path: no {INDEX} in '{path}'; make one with `python -m mlxdist.prepare`")
    base = index_file.parent.resolve()
    try:
        index = json.loads(index_file.read_text())
        dtype = np.dtype(index["dtype"])
        entries = [s["file"] for s in index["shards"]]
        files = [_inside(base, index_file, entry) for entry in entries]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"data.path: {index_file} is not a valid shard index ({e}); "
                         "remake it with `python -m mlxdist.prepare`") from None
    if dtype.kind not in "iu":
        raise DataError(f"data.path: {index_file}: dtype '{dtype.name}' is not an integer type; "
                        "remake the shards with `python -m mlxdist.prepare`")
    if not files:
        raise ValueError(f"data.path: '{path}' has no shards")
    arrays = []
    for f in files:
        try:
            arrays.append(np.memmap(f, dtype=dtype, mode="r"))
        except (OSError, ValueError) as e:
            raise DataError(f"data.path: {f}: cannot read it as {dtype.name} tokens ({e}); "
                            "remake the shards with `python -m mlxdist.prepare`") from None
    return TokenStream(arrays, files=files, vocab_size=vocab_size), index


def _inside(base: Path, index_file: Path, entry: str) -> Path:
    if not isinstance(entry, str):
        raise TypeError(f"shard file entry {entry!r} is not a string")
    f = (base / entry).resolve()
    if not f.is_relative_to(base):
        raise DataError(f"data.path: {index_file}: shard entry '{entry}' resolves to {f}, outside {base}; "
                        "shard files must lie inside data.path (move them there and name them relative to it)")
    return f
