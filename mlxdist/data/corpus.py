"""The built-in corpus: Python's own standard library source, present on every machine.

It is real text with real structure (code, docstrings, comments), so the default run
learns something visible in `mlxdist.generate`, and nothing is downloaded.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from .tokenizer import ByteTokenizer

MAX_BYTES = 4_000_000


def builtin_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"built-in corpus: no Python files under {root}; use data.source=shards")
    return files


def builtin_tokens(max_bytes: int = MAX_BYTES) -> np.ndarray:
    tok = ByteTokenizer()
    parts, total = [], 0
    for path in builtin_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(tok.encode(text, eos=True))
        total += len(parts[-1])
        if total >= max_bytes:
            break
    return np.concatenate(parts)
