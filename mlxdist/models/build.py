"""Which network a run trains, built for one engine: a built-in preset (from scratch) or a
pretrained model (`model.path`), optionally with adapters (`finetune`).

Engines take the result and never ask where it came from: they train `params` (the
trainable parameters, by name) through `module(tokens) -> logits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import Config
from .presets import ModelArgs, human, param_count, resolve


@dataclass
class BuiltModel:
    module: Any  # framework module: module(tokens [b, T]) -> logits [b, T, vocab]
    params: dict[str, Any]  # trainable parameters by name: initial values (framework arrays)
    total_params: int
    vocab_size: int
    summary: str  # one banner line
    fingerprint: str | None = None  # of a pretrained base; every rank must train the same one


def _preset_summary(cfg: Config, a: ModelArgs) -> tuple[str, int]:
    n = param_count(a)
    return (f"model: preset {cfg.model.preset}, {human(n)} parameters (dim {a.dim}, {a.n_layers} layers, "
            f"{a.n_heads}/{a.n_kv_heads} heads)"), n


def build_mlx(cfg: Config, args: ModelArgs | None = None) -> BuiltModel:
    """`args` overrides the preset's shape (tests build odd sizes)."""
    from .mlx_model import Transformer, init_params

    a = args or resolve(cfg.model)
    summary, n = _preset_summary(cfg, a)
    return BuiltModel(Transformer(a), init_params(a, cfg.train.seed), n, a.vocab_size, summary)


def build_torch(cfg: Config, device: Any, args: ModelArgs | None = None) -> BuiltModel:
    import torch

    from .init import initial_weights
    from .torch_model import Transformer

    a = args or resolve(cfg.model)
    summary, n = _preset_summary(cfg, a)
    module = Transformer(a).to(device)
    weights = initial_weights(a, cfg.train.seed, __import__("numpy"))
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.from_numpy(weights[name]))
    return BuiltModel(module, dict(module.named_parameters()), n, a.vocab_size, summary)
