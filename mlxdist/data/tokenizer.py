"""Byte-level tokenizer: any text, any language, no vocabulary file to ship or download."""

from __future__ import annotations

import numpy as np

EOS = 256
PAD = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    vocab_size = VOCAB_SIZE
    eos = EOS

    def encode(self, text: str, eos: bool = False) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        return np.append(ids, EOS).astype(np.int32) if eos else ids

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")
