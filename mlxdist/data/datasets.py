"""Sources of fixed-length training windows (T+1 tokens: inputs and shifted targets)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ConfigError, DataConfig
from .shards import TokenStream, read_shards
from .synthetic import SEP, synthetic_window
from .tokenizer import VOCAB_SIZE


class Dataset:
    """Windows of `seq_len + 1` tokens; index i is stable for the life of the data."""

    def __len__(self) -> int:
        raise NotImplementedError

    def window(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def batch(self, indices) -> np.ndarray:
        return np.stack([self.window(int(i)) for i in indices]).astype(np.int32)


@dataclass
class TokenWindows(Dataset):
    """Overlapping windows over one token stream (documents already joined with EOS).

    Overlap lets a long document's every token appear with left context in some window.
    """

    tokens: TokenStream
    seq_len: int
    overlap: int = 0

    def __post_init__(self):
        self.stride = self.seq_len - self.overlap
        n = (len(self.tokens) - (self.seq_len + 1)) // self.stride + 1
        if n < 1:
            raise ValueError(f"data: {len(self.tokens)} tokens is fewer than one window of {self.seq_len + 1}")
        self.n = n

    def __len__(self) -> int:
        return self.n

    def window(self, i: int) -> np.ndarray:
        start = i * self.stride
        return np.asarray(self.tokens.read(start, start + self.seq_len + 1), dtype=np.int32)


@dataclass
class SyntheticTask(Dataset):
    task: str
    seed: int
    seq_len: int
    size: int = 1_000_000

    def __len__(self) -> int:
        return self.size

    def window(self, i: int) -> np.ndarray:
        return synthetic_window(self.task, self.seed, i, self.seq_len)


def build_datasets(cfg: DataConfig, seed: int, vocab_size: int = 258) -> tuple[Dataset, Dataset]:
    """(train, eval) for the configured source; eval is a held-out tail, never trained on."""
    need = {"synthetic": SEP + 1, "builtin": VOCAB_SIZE}.get(cfg.source, 0)
    if vocab_size < need:  # byte ids: a smaller embedding table would be read out of bounds
        raise ConfigError(f"model.vocab_size: data.source={cfg.source} has byte token ids that need a vocabulary "
                          f"of {need}, the model's is {vocab_size}; set model.vocab_size={need} or more")
    if cfg.source == "synthetic":
        return (SyntheticTask(cfg.task, seed, cfg.seq_len),
                SyntheticTask(cfg.task, seed + 1_000_003, cfg.seq_len, size=10_000))
    if cfg.source == "builtin":
        from .corpus import builtin_tokens

        tokens = TokenStream([builtin_tokens()])
    else:
        tokens, index = read_shards(cfg.path, vocab_size)
        if index.get("vocab_size", 0) > vocab_size:
            raise ConfigError(f"data.path: shards in {cfg.path} use a vocabulary of {index['vocab_size']} "
                              f"> model.vocab_size {vocab_size}; set model.vocab_size={index['vocab_size']}")
    n_eval = max(cfg.seq_len + 1, int(len(tokens) * cfg.eval_fraction))
    if len(tokens) < n_eval + cfg.seq_len + 1:
        raise ConfigError(f"data: {len(tokens)} tokens is too few for data.seq_len={cfg.seq_len} "
                          "(need one training window plus a held-out one)")
    cut = len(tokens) - n_eval
    return (TokenWindows(tokens.view(0, cut), cfg.seq_len, cfg.overlap),
            TokenWindows(tokens.view(cut, len(tokens)), cfg.seq_len, 0))
