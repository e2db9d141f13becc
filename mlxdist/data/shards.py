"""Token shards on disk: flat uint16/uint32 files plus a JSON index, read a window at a time.

Reading windows (never whole files) keeps a 10 GB corpus off the heap, so every rank of a
Mac cluster can open the same files without each holding a copy in RAM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .. import gate
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


class ShardFile:
    """One shard on disk, read a window at a time with `os.pread`.

    Not memmap: a shard cut short while the run reads it (rewritten in place, a copy still
    arriving) turns a memmap read into SIGBUS, which kills the rank with no line at all.
    `pread` gives a short read instead, which is one line naming the file. It costs 1.0-1.8 µs
    more a window than a memmap slice (6.0 vs 4.9 µs at 33 tokens, 8.2 vs 6.5 at 2049, ids
    checked, Linux, warm cache); an fstat before each memmap read costs as much (1.6-1.8 µs)
    and still leaves SIGBUS a moment between the check and the read. The page cache still
    holds the data once for all ranks, never the heap.
    """

    def __init__(self, path: Path, dtype: np.dtype, fd: int, nbytes: int):
        self._file = os.fdopen(fd, "rb", buffering=0)  # owns the descriptor: closed with the last view
        self.path, self.dtype, self.fd, self.nbytes = path, dtype, fd, nbytes
        self.tokens = nbytes // dtype.itemsize

    def __len__(self) -> int:
        return self.tokens

    def read(self, lo: int, hi: int) -> np.ndarray:
        size = self.dtype.itemsize
        want = (hi - lo) * size
        try:
            got = os.pread(self.fd, want, lo * size)
        except OSError as e:
            raise DataError(f"data.path: {self.path}: cannot read tokens {lo}..{hi} ({e.strerror}); "
                            "check the disk, or copy the shards to a local disk") from None
        if len(got) < want:
            now = _size_now(self.fd)
            raise DataError(f"data.path: {self.path}: the shard is {now:,} bytes now but was {self.nbytes:,} when "
                            "the run opened it (cut short or rewritten while the run reads it); keep shards "
                            "unchanged while a run trains on them (write new ones to another folder), then "
                            "start or resume the run on whole shards")
        return np.frombuffer(got, self.dtype)


def _size_now(fd: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 0


class TokenStream:
    """Several shards (or in-memory token arrays) read as one token sequence, without loading
    them.

    Slices that cross a shard boundary are stitched from the two pieces; nothing else is
    ever copied, so a 10 GB corpus costs each rank only the windows it reads. For the same
    reason ids are checked against `vocab_size` as they are read, not by a scan at open: an
    id past the embedding table is an out-of-bounds read in the engine (a segfault, or
    silent garbage), so it is refused with its file and position before it gets there.
    """

    def __init__(self, arrays: list[np.ndarray | ShardFile], start: int = 0, stop: int | None = None, *,
                 files: list[Path] | None = None, vocab_size: int | None = None):
        self.arrays = [a if isinstance(a, ShardFile) else np.asarray(a) for a in arrays]
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
            a, at = self.arrays[k], int(self.offsets[k])
            part = a.read(lo - at, end - at) if isinstance(a, ShardFile) else a[lo - at : end - at]
            if self.vocab_size is not None:
                self._check_ids(part, k, lo - at)
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


# Integer names only: '<u2' or '>u2' would leave the byte order to whoever wrote the index.
DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
_COUNT = gate.Int(lo=0, hi=2**62)
INDEX_SPEC = gate.Dict(
    fields={"dtype": gate.OneOf(DTYPES), "vocab_size": gate.Int(lo=1, hi=2**32), "tokens": _COUNT,
            "shards": gate.List(gate.Dict(fields={"file": gate.Str(), "tokens": _COUNT}, required=("file",),
                                          values=gate.Tree()))},
    required=("dtype", "shards"), values=gate.Tree())


def read_shards(path: str | Path, vocab_size: int | None = None) -> tuple[TokenStream, dict]:
    """All shards as one lazily read token stream, and the index describing them. With
    `vocab_size`, an id outside 0..vocab_size-1 is a `DataError` when its window is read.

    The index is data, not configuration: it passes the gate's schema (one line naming the
    field), a `file` entry may only name a regular file inside the index's directory (after
    symlinks), so a downloaded or shared shards.json cannot make a rank read /etc/passwd, a
    neighbour's home or a FIFO that never ends as tokens, and every count it gives must match
    the file, so a shard cut short before the run is found at start.
    """
    root = Path(path)
    index_file = root / INDEX if root.is_dir() else root
    if not index_file.exists():
        raise FileNotFoundError(f"data.path: no {INDEX} in '{path}'; make one with `python -m mlxdist.prepare`")
    remake = "remake the shards with `python -m mlxdist.prepare`"
    try:
        index = gate.read_json(index_file, "shard index", INDEX_SPEC)
    except gate.FileRefused as e:
        raise DataError(f"data.path: {e} (not a valid shard index: {remake})") from None
    dtype = np.dtype(index["dtype"])
    base = index_file.parent.resolve()
    entries = index["shards"]
    if not entries:
        raise DataError(f"data.path: {index_file}: 'shards' is empty; {remake}")
    files = [_inside(base, index_file, s["file"]) for s in entries]
    shards = []
    for i, (entry, f) in enumerate(zip(entries, files, strict=True)):
        try:
            fd, st = gate.open_regular(f, "shard")
        except gate.FileRefused as e:
            raise DataError(f"data.path: {e} (named by {index_file} 'shards[{i}].file')") from None
        shard = ShardFile(f, dtype, fd, st.st_size)
        if st.st_size % dtype.itemsize or entry.get("tokens", shard.tokens) != shard.tokens:
            said = f"'shards[{i}].tokens' says {entry['tokens']:,}" if "tokens" in entry else f"'dtype' is {dtype.name}"
            raise DataError(f"data.path: {index_file}: {said} but {f} is {st.st_size:,} bytes "
                            f"({st.st_size / dtype.itemsize:,.1f} {dtype.name} tokens): the shard is cut short "
                            f"or not the one the index was written for; copy it again or {remake}")
        shards.append(shard)
    held = sum(len(s) for s in shards)
    if index.get("tokens", held) != held:
        raise DataError(f"data.path: {index_file}: 'tokens' is {index['tokens']:,} but its shards hold {held:,} "
                        f"(was it edited?); fix the total or {remake}")
    return TokenStream(shards, files=files, vocab_size=vocab_size), index


def _inside(base: Path, index_file: Path, entry: str) -> Path:
    try:
        f = (base / entry).resolve()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise DataError(f"data.path: {index_file}: shard entry {entry!r} is not a file name ({e}); "
                        "remake the shards with `python -m mlxdist.prepare`") from None
    if not f.is_relative_to(base):
        raise DataError(f"data.path: {index_file}: shard entry '{entry}' resolves to {f}, outside {base}; "
                        "shard files must lie inside data.path (move them there and name them relative to it)")
    return f
