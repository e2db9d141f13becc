"""The built-in language model as a Task: presets, pretrained models and LoRA on token
windows (built-in corpus, shards, synthetic, JSONL instructions). Its config keys
(`model.*`, `finetune.*`, `data.*`) keep their meaning; the loop sees only a Task.

Its unit is the trained token: a masked prompt or padding counts nothing, so instruction
data with unequal answers is weighted exactly across ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import Config, ConfigError
from ..data import build_datasets
from ..data.batch import TokenBatch
from . import Task, TaskContext


class Windows:
    """A token-window dataset seen as samples: {"tokens": [T+1]} (+ "mask": [T] for instructions)."""

    def __init__(self, windows: Any):
        self.windows = windows
        self.masked = hasattr(windows, "mask")

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self.masked:
            return {"tokens": self.windows.tokens[i], "mask": self.windows.mask[i]}
        return {"tokens": np.asarray(self.windows.window(i), np.int32)}


def lm_collate(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out = {"tokens": np.stack([s["tokens"] for s in samples]).astype(np.int32)}
    if "mask" in samples[0]:
        out["mask"] = np.stack([s["mask"] for s in samples])
    return out


def lm_count(batch: dict[str, np.ndarray]) -> int:
    """Trained targets: the mask's ones, or every position after the first."""
    if "mask" in batch:
        return int(np.asarray(batch["mask"]).sum())
    t = batch["tokens"]
    return int(t.shape[0] * (t.shape[1] - 1))


def lm_batch_data(batch: TokenBatch | np.ndarray) -> dict[str, np.ndarray]:
    """A bare token array or TokenBatch (tools, tests) in this task's batch structure."""
    b = TokenBatch.of(batch)
    return {"tokens": b.tokens} if b.mask is None else {"tokens": b.tokens, "mask": b.mask}


def lm_loss(model: Any, batch: dict[str, Any]) -> Any:
    """Summed next-token cross-entropy over trained targets, on either engine."""
    tokens = batch["tokens"]
    if type(tokens).__module__.startswith("torch"):
        import torch.nn.functional as F

        tokens = tokens.long()
        logits = model(tokens[:, :-1]).float()
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
        return (losses * batch["mask"].reshape(-1).float()).sum() if "mask" in batch else losses.sum()
    import mlx.core as mx
    import mlx.nn as nn

    logits = model(tokens[:, :-1]).astype(mx.float32)
    losses = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="none")
    return (losses * batch["mask"].astype(mx.float32)).sum() if "mask" in batch else losses.sum()


def lm_build(cfg: Config, args: Any = None) -> Callable[[TaskContext], Any]:
    """The preset or pretrained model (with adapters) for the context's engine."""

    def build(ctx: TaskContext) -> Any:
        from ..engine.registry import engine_spec

        return engine_spec(ctx.engine).load("build_lm")(cfg, ctx.device, args)

    return build


def lm_model(cfg: Config, args: Any = None) -> Task:
    """The built-in LM's model and loss without data (engines built directly: tools, tests)."""
    return Task(build=lm_build(cfg, args), loss=lm_loss, dataset=None, count=lm_count, collate=lm_collate,
                unit="tokens", name="built-in LM")


def lm_task(cfg: Config, base: Any = None, say: Callable[[str], None] | None = None) -> Task:
    """The built-in LM task of this config; `base` is `models.build.inspect_base(cfg)`."""
    train_set, eval_set = _datasets(cfg, base, say)
    return Task(build=lm_build(cfg), loss=lm_loss, dataset=Windows(train_set), count=lm_count, collate=lm_collate,
                eval_dataset=Windows(eval_set), unit="tokens", name="built-in LM",
                data_summary=f"{cfg.data.source}, {len(train_set)} windows of {cfg.data.seq_len}")


def _datasets(cfg: Config, base: Any, say: Callable[[str], None] | None):
    data = cfg.data
    if data.source not in ("jsonl", "hf"):
        from ..models.build import lm_vocab_size

        return build_datasets(data, cfg.train.seed, lm_vocab_size(cfg, base))
    if base is None:
        raise ConfigError(f"data.source={data.source}: tokenizing needs the model's tokenizer; set model.path")
    from ..data.hf_tokenizer import load_tokenizer
    from ..data.instruct import build_instruct_datasets

    train_set, eval_set = build_instruct_datasets(data, cfg.train.seed, load_tokenizer(base.path).tok)
    if say is not None:
        say(train_set.stats.summary("train") + "; " + eval_set.stats.summary("eval"))
    return train_set, eval_set
