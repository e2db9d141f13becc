"""Instruction data from JSONL into fixed windows with a loss mask.

Three line shapes, the ones people already have:
  {"text": ...}                                  every token trains
  {"prompt": ..., "completion": ...}             the completion trains (prompt masked)
  {"messages": [{"role": ..., "content": ...}]}  assistant turns train (chat template applied)

The tokenizer needs little: `encode(text) -> list[int]` (no special tokens added), an
`eos_token_id`, and for chat data either `apply_chat(messages, add_generation_prompt) ->
list[int] | str` or Hugging Face's `apply_chat_template`. Assistant turns are found by
tokenizing the conversation up to each assistant turn with the generation prompt, so
what trains is exactly what the template renders as the model's answer, whatever the
template looks like.

Windows are `seq_len + 1` tokens; `mask[j]` says whether target `tokens[j + 1]` counts.
Each example ends with EOS (chat: the template's own end marker). With packing, short
examples share a window back to back (attention crosses the EOS boundary; the first
token of each example is never a target, so no answer is trained on another's context
as if it were its own prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import gate
from ..problems import ConfigError
from .batch import TokenBatch


@dataclass
class Example:
    """One tokenized example: ids and, per token, whether it is a trained target."""

    ids: list[int]
    trained: list[bool]


@dataclass
class InstructStats:
    """Counts the loop logs at startup, so a user sees what the data became."""

    examples: int = 0
    truncated: int = 0
    dropped: int = 0  # no trained token left after truncation
    windows: int = 0
    packed: bool = False
    trained_tokens: int = 0
    tokens: int = 0

    def summary(self, name: str = "data") -> str:
        how = "packed into" if self.packed else "as"
        return (f"{name}: {self.examples} examples {how} {self.windows} windows, "
                f"{self.truncated} truncated, {self.dropped} dropped (nothing to train), "
                f"{self.trained_tokens}/{self.tokens} tokens trained")


def read_jsonl(path: str | Path) -> list[dict]:
    """Parsed lines; a bad line (not UTF-8, not JSON, not one of the three shapes) is one
    `ConfigError` naming FILE:LINE and what was expected: the file is data from elsewhere,
    and a FIFO in its place is refused rather than waited on."""
    out = []
    for n, raw in gate.jsonl_lines(path, "JSONL file"):
        if not raw.strip():
            continue
        row = gate.parse_json_line(raw, path, n, "JSONL file")
        _check_row(row, f"{path}:{n}")
        out.append(row)
    if not out:
        raise gate.refuse(path, "no examples (empty file)", "give a JSONL file with one example a line")
    return out


def _check_row(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise gate.refuse(where, f"expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise gate.refuse(where, "'messages' must be a non-empty list of {role, content}")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise gate.refuse(where, f"messages[{i}] needs string 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in msgs):
            raise gate.refuse(where, "no assistant message, nothing to train on")
    elif "prompt" in row or "completion" in row:
        for k in ("prompt", "completion"):
            if not isinstance(row.get(k), str):
                raise gate.refuse(where, f"'{k}' must be a string (shape is {{prompt, completion}})")
    elif "text" in row:
        if not isinstance(row["text"], str):
            raise gate.refuse(where, "'text' must be a string")
    else:
        raise gate.refuse(where, f"expected a 'text', 'prompt'+'completion' or 'messages' key, got {sorted(row)}")


def _encode(tok, text: str) -> list[int]:
    try:
        ids = tok.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tok.encode(text)
    return [int(i) for i in ids]


def _chat_ids(tok, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    if hasattr(tok, "apply_chat"):
        out = tok.apply_chat(messages, add_generation_prompt=add_generation_prompt)
    else:
        out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return _encode(tok, out) if isinstance(out, str) else [int(i) for i in out]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_example(row: dict, tok, mask_prompt: bool = True) -> Example:
    """Ids plus the trained flag of each token (token 0 never trains: it has no context)."""
    eos = tok.eos_token_id
    if "messages" in row:
        msgs = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        ids = _chat_ids(tok, msgs, add_generation_prompt=False)
        trained = [not mask_prompt] * len(ids)
        if mask_prompt:
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                start = _common_prefix(_chat_ids(tok, msgs[:i], add_generation_prompt=True), ids)
                end = _common_prefix(_chat_ids(tok, msgs[: i + 1], add_generation_prompt=False), ids)
                for k in range(start, end):
                    trained[k] = True
    elif "prompt" in row:
        p, c = _encode(tok, row["prompt"]), _encode(tok, row["completion"]) + [eos]
        ids = p + c
        trained = [not mask_prompt] * len(p) + [True] * len(c)
    else:
        ids = _encode(tok, row["text"]) + [eos]
        trained = [True] * len(ids)
    if trained:
        trained[0] = False
    return Example(ids, trained)


def build_windows(examples: list[Example], seq_len: int, pad_id: int, pack: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, InstructStats]:
    """(tokens [n, seq_len+1] int32, mask [n, seq_len] bool, stats)."""
    width = seq_len + 1
    st = InstructStats(examples=len(examples), packed=pack)
    kept: list[Example] = []
    for ex in examples:
        if len(ex.ids) > width:
            st.truncated += 1
            ex = Example(ex.ids[:width], ex.trained[:width])
        if not any(ex.trained):
            st.dropped += 1
            continue
        kept.append(ex)
    rows: list[tuple[list[int], list[bool]]] = []
    if pack:
        ids: list[int] = []
        tr: list[bool] = []
        for ex in kept:
            if len(ids) + len(ex.ids) > width:
                rows.append((ids, tr))
                ids, tr = [], []
            ids, tr = ids + ex.ids, tr + ex.trained
        if ids:
            rows.append((ids, tr))
    else:
        rows = [(ex.ids, ex.trained) for ex in kept]
    tokens = np.full((len(rows), width), pad_id, np.int32)
    trained = np.zeros((len(rows), width), bool)
    for r, (ids, tr) in enumerate(rows):
        tokens[r, : len(ids)] = ids
        trained[r, : len(tr)] = tr
    mask = trained[:, 1:].copy()
    st.windows = len(rows)
    st.trained_tokens = int(mask.sum())
    st.tokens = int(sum(len(ids) for ids, _ in rows))
    return tokens, mask, st


class InstructWindows:
    """Masked windows, Dataset-like: `len`, `window(i)`, `batch(indices) -> TokenBatch`."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, stats: InstructStats):
        self.tokens, self.mask, self.stats = tokens, mask, stats

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, i: int) -> np.ndarray:
        return self.tokens[i]

    def batch(self, indices) -> TokenBatch:
        idx = np.asarray(list(indices), dtype=np.int64)
        return TokenBatch(self.tokens[idx], self.mask[idx])


def _pad_id(tok) -> int:
    pad = getattr(tok, "pad_token_id", None)
    return int(pad if pad is not None else tok.eos_token_id)


def load_instruct(path: str | Path, tok, seq_len: int, mask_prompt: bool = True, pack: bool = False
                  ) -> InstructWindows:
    rows = read_jsonl(path)
    return windows_from_rows(rows, tok, seq_len, mask_prompt, pack, where=str(path))


def windows_from_rows(rows: list[dict], tok, seq_len: int, mask_prompt: bool = True, pack: bool = False,
                      where: str = "data") -> InstructWindows:
    examples = [tokenize_example(r, tok, mask_prompt) for r in rows]
    tokens, mask, st = build_windows(examples, seq_len, _pad_id(tok), pack)
    if not len(tokens):
        raise ValueError(f"{where}: no example has a trained token within data.seq_len={seq_len} "
                         "(prompts too long?); raise data.seq_len")
    return InstructWindows(tokens, mask, st)


def build_instruct_datasets(cfg, seed: int, tok) -> tuple[InstructWindows, InstructWindows]:
    """(train, eval) for `data.source=jsonl` or `hf`.

    jsonl: `data.path` is a .jsonl file or a directory with `train.jsonl` and, if present,
    `valid.jsonl` as eval (mlx-lm's layout). hf: a `datasets` name or directory, eval from its
    validation split if it has one. Without a held-out file or split, eval is a seeded random
    `eval_fraction` of the examples (at least one), split by example before packing, so no
    example is in both.
    """
    if not cfg.path:
        raise ValueError(f"data.path: data.source={cfg.source} needs data.path "
                         + ("(a .jsonl file or a dir with train.jsonl)" if cfg.source == "jsonl"
                            else "(a datasets name or a local dataset directory)"))
    build = dict(tok=tok, seq_len=cfg.seq_len, mask_prompt=cfg.mask_prompt, pack=cfg.pack)
    if cfg.source == "hf":
        from .hf_datasets import read_hf

        rows, eval_rows, where = read_hf(cfg.path)
    else:
        rows, eval_rows, where = _read_jsonl_source(Path(cfg.path))
    if eval_rows is not None:
        return (windows_from_rows(rows, where=f"{where} (train)", **build),
                windows_from_rows(eval_rows, where=f"{where} (eval)", **build))
    if len(rows) < 2:
        raise ValueError(f"{where}: {len(rows)} example; need at least 2 (one to train, one held out)")
    order = np.random.default_rng(seed).permutation(len(rows))
    n_eval = min(len(rows) - 1, max(1, round(len(rows) * cfg.eval_fraction)))
    ev, tr = order[:n_eval], order[n_eval:]
    return (windows_from_rows([rows[i] for i in sorted(tr)], where=f"{where} (train)", **build),
            windows_from_rows([rows[i] for i in sorted(ev)], where=f"{where} (eval)", **build))


def _read_jsonl_source(path: Path) -> tuple[list[dict], list[dict] | None, str]:
    if path.is_dir():
        train_file = path / "train.jsonl"
        if not train_file.exists():
            raise ConfigError(f"data.path: {path} has no train.jsonl; put the examples in {path}/train.jsonl")
        valid = next((path / n for n in ("valid.jsonl", "eval.jsonl") if (path / n).exists()), None)
        if valid is not None:
            return read_jsonl(train_file), read_jsonl(valid), str(path)
        path = train_file
    if not path.exists():
        raise ConfigError(f"data.path: {path} does not exist; give a .jsonl file or a folder with train.jsonl")
    return read_jsonl(path), None, str(path)
