"""`python -m mlxdist.prepare INPUT... --out DIR`: text/JSONL files -> token shards.

Text files become one document each; JSONL files one document per line (its `text` field,
or `--field`). Documents are joined with an end-of-text token, which lets the window
sampler cross document boundaries without the model confusing two documents for one.
With `--tokenizer MODEL_PATH` (a Hugging Face directory or .gguf file) the text is tokenized
with that model's own tokenizer and joined with its end-of-sequence token; otherwise bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .. import gate
from ..data.shards import INDEX, write_shards
from ..data.tokenizer import ByteTokenizer
from ..problems import ConfigError

# What prepare writes into --out: the only files --overwrite replaces.
_OWN = re.compile(r"shard_\d{5,}\.bin(\.tmp)?")


def documents(paths: list[Path], field: str) -> Iterator[str]:
    """Each input's documents, read through the gate: regular files only (a FIFO would hang
    prepare), a JSONL line at a time, each line a JSON object whose `field` is text."""
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            for n, raw in gate.jsonl_lines(path, "JSONL input"):
                if not raw.strip():
                    continue
                row = gate.parse_json_line(raw, path, n, "JSONL input")
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise ConfigError(f"{path}:{n}: not a JSON object with a '{field}' text field; give --field "
                                      "the name of the text field of every line")
                yield row[field]
        else:
            yield gate.read_bytes(path, "text input", max_bytes=gate.TEXT_BYTES).decode("utf-8", errors="replace")


def _encoder(model_path: str | None) -> tuple[Callable[[str], np.ndarray], int]:
    if model_path is None:
        tok = ByteTokenizer()
        return (lambda text: tok.encode(text, eos=True)), tok.vocab_size
    from ..data.hf_tokenizer import load_tokenizer

    hf = load_tokenizer(model_path)
    return (lambda text: np.array(hf.encode(text) + [hf.eos], dtype=np.int64)), hf.vocab_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.prepare")
    p.add_argument("inputs", nargs="+", help="text files, .jsonl files, or directories of them")
    p.add_argument("--out", required=True, help="directory for the token shards (data.path of the run)")
    p.add_argument("--field", default="text", help="JSONL field holding the text")
    p.add_argument("--shard-tokens", type=int, default=50_000_000, help="tokens per shard file")
    p.add_argument("--tokenizer", metavar="MODEL_PATH",
                   help="tokenize with this pretrained model's tokenizer (HF directory or .gguf)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the corpus an earlier prepare wrote to --out (once the new one is written)")
    args = p.parse_args(argv)
    try:
        out = _out_dir(args.out, args.overwrite)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths: list[Path] = []
    for raw in args.inputs:
        path = Path(raw)
        if path.is_dir():
            paths += sorted(q for q in path.rglob("*") if q.suffix in (".txt", ".md", ".jsonl", ".py"))
        elif path.is_file():
            paths.append(path)
        else:
            print(f"error: {raw}: no such file or directory", file=sys.stderr)
            return 2
    try:
        encode, vocab_size = _encoder(args.tokenizer)
        index = _write_then_replace(out, lambda into: write_shards((encode(d) for d in documents(paths, args.field)),
                                                                   into, args.shard_tokens, vocab_size))
    except ValueError as e:  # ConfigError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {index['tokens']} tokens in {len(index['shards'])} shard(s) to {args.out}; "
          f"train with: python -m mlxdist.train data.source=shards data.path={args.out}"
          + (f" model.path={args.tokenizer}" if args.tokenizer else ""))
    return 0


def _out_dir(value: str, overwrite: bool) -> Path:
    """The folder the corpus goes to (a link's target: the link stays), or one line on why not.
    A folder holding anything is another corpus or the user's files: replaced only when asked
    (--overwrite), and then only when all of it is what prepare writes."""
    if not value.strip() or "\x00" in value:
        raise ConfigError(f"--out {value!r}: give a folder for the token shards (--out data/NAME)")
    out = Path(value)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; nothing was changed: give a folder for the token "
                          "shards (a new name)")
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"--out {out} is a symbolic link to {os.readlink(out)}, which does not exist; make that "
                          "folder or give another --out")
    real = Path(os.path.realpath(out))
    if not real.is_dir():
        return real
    try:
        names = sorted(p.name for p in real.iterdir())
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be read ({e.strerror or e}); give another --out") from None
    if not names:
        return real
    held = _describe(real, names)
    if not overwrite:
        raise ConfigError(f"--out {out} already holds {held}; nothing was changed: give a new --out, or add "
                          "--overwrite to replace it")
    foreign = [n for n in names if n != INDEX and not _OWN.fullmatch(n)]
    if foreign:
        raise ConfigError(f"--out {out} holds files prepare did not write ({', '.join(foreign[:3])}"
                          f"{' ...' if len(foreign) > 3 else ''}); nothing was changed: --overwrite replaces only a "
                          "corpus prepare wrote, so give a new --out, or move those files out first")
    return real


def _describe(folder: Path, names: list[str]) -> str:
    if INDEX in names:
        try:
            index = gate.read_json(folder / INDEX, "shard index", gate.Dict({"tokens": gate.Int()}, values=gate.Tree()),
                                   max_bytes=16 * gate.MiB)
            if "tokens" in index:
                return f"a prepared corpus ({index['tokens']:,} tokens, {INDEX})"
        except ConfigError:
            pass
        return f"a prepared corpus ({INDEX})"
    return f"{len(names)} file(s) ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})"


def _write_then_replace(out: Path, write: Callable[[Path], dict]) -> dict:
    """The corpus is written beside `out` and renamed into place once whole: a prepare that
    fails (a bad input line, a full disk, Ctrl-C) leaves what `out` held untouched. The folder
    it replaces (--overwrite, checked by `_out_dir`) goes only after the new one is in place."""
    parent = out.parent
    tmp, old = parent / f".{out.name}.prepare-{os.getpid()}", parent / f".{out.name}.replaced-{os.getpid()}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e}); give another --out") from None
    try:
        index = write(tmp)
        if out.is_dir() and any(out.iterdir()):
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)  # over an empty folder, or none
    except OSError as e:
        raise ConfigError(f"prepare stopped: {f'{e.filename}: ' if e.filename else ''}{e.strerror or e}; --out {out} "
                          "is as it was") from None
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return index


if __name__ == "__main__":
    sys.exit(main())
