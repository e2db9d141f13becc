"""`python -m mlxdist.prepare INPUT... --out DIR`: text/JSONL files -> token shards.

Text files become one document each; JSONL files one document per line (its `text` field,
or `--field`). Documents are joined with an end-of-text token, which lets the window
sampler cross document boundaries without the model confusing two documents for one.
With `--tokenizer MODEL_PATH` (a Hugging Face directory or .gguf file) the text is tokenized
with that model's own tokenizer and joined with its end-of-sequence token; otherwise bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..data.shards import write_shards
from ..data.tokenizer import ByteTokenizer


def documents(paths: list[Path], field: str) -> Iterator[str]:
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)[field]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{path}:{n}: not a JSON object with a '{field}' field") from None
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


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
    args = p.parse_args(argv)
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
        index = write_shards((encode(d) for d in documents(paths, args.field)), args.out,
                             args.shard_tokens, vocab_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {index['tokens']} tokens in {len(index['shards'])} shard(s) to {args.out}; "
          f"train with: python -m mlxdist.train data.source=shards data.path={args.out}"
          + (f" model.path={args.tokenizer}" if args.tokenizer else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
