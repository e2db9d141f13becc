"""The model's own tokenizer and chat template, through transformers' AutoTokenizer.

Training text tokenized by anything else would teach the base a vocabulary it never saw;
for a GGUF file the tokenizer comes from the cached Hugging Face conversion
(`models.pretrained.hf_dir`), so both kinds of base behave the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..models.pretrained import PretrainedError, hf_dir, inspect, require


class HFTokenizer:
    """A thin, list-of-int face over a transformers tokenizer, the shape our data code wants."""

    def __init__(self, tok: Any, eos_ids: tuple[int, ...], name: str):
        self.tok = tok
        self.eos_ids = eos_ids
        self.eos = eos_ids[0]
        self.name = name
        self.vocab_size = len(tok)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; `special` adds what the model adds itself (e.g. Llama's BOS)."""
        return list(self.tok.encode(text, add_special_tokens=special))

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise PretrainedError(f"tokenizer of {self.name} has no chat template; use prompt/completion data")
        text = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.encode(text, special=False)


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    info = inspect(path)
    require("transformers", "tokenizers")
    d = hf_dir(path, info)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(d)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PretrainedError(f"model.path: {path}: no usable tokenizer ({first})") from None
    return HFTokenizer(tok, _eos_ids(d, tok), str(path))


def _eos_ids(d: Path, tok: Any) -> tuple[int, ...]:
    """EOS ids from the tokenizer and generation_config.json (chat models often stop on several)."""
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        f = d / name
        if f.is_file():
            extra = json.loads(f.read_text()).get("eos_token_id")
            for i in extra if isinstance(extra, list) else [extra]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
    if not ids:
        raise PretrainedError(f"model.path: {d}: the tokenizer defines no end-of-sequence token")
    return tuple(ids)
