"""Sources of fixed-length training windows (T+1 tokens: inputs and shifted targets)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import DataConfig
from .synthetic import synthetic_window


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

    tokens: np.ndarray
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
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


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


def build_datasets(cfg: DataConfig, seed: int) -> tuple[Dataset, Dataset]:
    """(train, eval) for the configured source; eval is a held-out tail, never trained on."""
    if cfg.source == "synthetic":
        return (SyntheticTask(cfg.task, seed, cfg.seq_len),
                SyntheticTask(cfg.task, seed + 1_000_003, cfg.seq_len, size=10_000))
    if cfg.source == "builtin":
        from .corpus import builtin_tokens

        tokens = builtin_tokens()
    else:
        from .shards import read_shards

        tokens = read_shards(cfg.path)
    n_eval = max(cfg.seq_len + 1, int(len(tokens) * cfg.eval_fraction))
    train, held = tokens[:-n_eval], tokens[-n_eval:]
    return TokenWindows(train, cfg.seq_len, cfg.overlap), TokenWindows(held, cfg.seq_len, 0)
