"""Model sizes by name, and parameter counting without building a model.

Pure Python so the CLI can print a preset's size (and the torch twin can share it)
before any framework is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    grad_checkpoint_every: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352),
    "small": dict(dim=512, n_layers=10, n_heads=8, n_kv_heads=4, ffn_dim=1536),
    "base": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3840),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=3584),
    "1b": dict(dim=2048, n_layers=22, n_heads=16, n_kv_heads=8, ffn_dim=5632),
}


def resolve(cfg: ModelConfig) -> ModelArgs:
    """Preset values, with any field set explicitly in the config taking precedence."""
    from ..config import ConfigError

    base = dict(PRESETS[cfg.preset])
    for key in base:
        value = getattr(cfg, key)
        if value is not None:
            base[key] = value
    if base["dim"] % base["n_heads"]:
        raise ConfigError(f"model.dim: {base['dim']} is not divisible by model.n_heads ({base['n_heads']})")
    if base["n_heads"] % base["n_kv_heads"]:
        raise ConfigError(f"model.n_kv_heads: {base['n_kv_heads']} must divide model.n_heads ({base['n_heads']})")
    if (base["dim"] // base["n_heads"]) % 2:
        raise ConfigError("model.dim / model.n_heads must be even (RoPE rotates pairs)")
    return ModelArgs(
        **base,
        vocab_size=cfg.vocab_size,
        rope_base=cfg.rope_base,
        norm_eps=cfg.norm_eps,
        tie_embeddings=cfg.tie_embeddings,
        grad_checkpoint_every=cfg.grad_checkpoint_every,
    )


def param_count(a: ModelArgs) -> int:
    hd = a.head_dim
    attn = a.dim * a.n_heads * hd * 2 + a.dim * a.n_kv_heads * hd * 2
    ffn = 3 * a.dim * a.ffn_dim
    layer = attn + ffn + 2 * a.dim
    head = 0 if a.tie_embeddings else a.vocab_size * a.dim
    return a.vocab_size * a.dim + a.n_layers * layer + a.dim + head


def human(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}T"
