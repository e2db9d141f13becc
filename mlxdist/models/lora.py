"""LoRA / DoRA adapters on an MLX model (mlx-lm's layers), on a float or quantized base.

A quantized base (`nn.QuantizedLinear`) gives QLoRA with no extra code: mlx-lm's
`LoRALinear`/`DoRALinear` wrap it and train only their own low-rank factors.

Adapter parameter names are mlx-lm's, which for Hugging Face architectures are the HF
module paths: `model.layers.3.self_attn.q_proj.lora_a` [in, r], `.lora_b` [r, out], and
for DoRA `.m` [out]; trained norms keep their own names (`model.norm.weight`). These are
the names every engine and checkpoint uses (`lora_torch.py` maps PEFT onto them).
The update is `scale * x @ lora_a @ lora_b` with `scale = alpha / rank` (PEFT's convention
for `lora_alpha`; mlx-lm's config stores the resulting `scale`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..config import ConfigError, FinetuneConfig

ADAPTER_LEAVES = ("lora_a", "lora_b", "m")


@dataclass
class LoraInfo:
    """What was made trainable, for the startup banner and the adapter files."""

    method: str
    trainable: list[str]
    n_trainable: int
    n_total: int
    keys: list[str] = field(default_factory=list)  # adapted modules, relative to a layer
    layers: list[int] = field(default_factory=list)  # adapted layer indices
    n_layers: int = 0

    def banner(self) -> str:
        pct = 100.0 * self.n_trainable / max(self.n_total, 1)
        return (f"{self.method}: trainable {self.n_trainable:,} / {self.n_total:,} parameters "
                f"({pct:.3f}%), {len(self.keys)} module kinds in {len(self.layers)} of {self.n_layers} layers")


def targets(cfg: FinetuneConfig) -> list[str]:
    names = [t.strip() for t in cfg.targets.split(",") if t.strip()]
    if not names:
        raise ConfigError("finetune.targets: empty; name the projections to adapt, e.g. q_proj,v_proj")
    return names


def adapted_layers(cfg: FinetuneConfig, n_layers: int) -> list[int]:
    if cfg.layers > n_layers:
        raise ConfigError(f"finetune.layers: {cfg.layers} but the model has {n_layers} layers; "
                          f"use 0 (all) or at most {n_layers}")
    n = cfg.layers or n_layers
    return list(range(n_layers - n, n_layers))


def lora_scale(cfg: FinetuneConfig) -> float:
    return cfg.alpha / cfg.rank


def _base_count(model: nn.Module) -> int:
    """Parameters with quantized weights counted at full size (not as packed words)."""
    from mlx_lm.utils import get_total_parameters

    return int(get_total_parameters(model))


def _layer_keys(model: nn.Module, names: list[str]) -> list[str]:
    """Paths inside a layer whose last part is a target name (q_proj -> self_attn.q_proj)."""
    found = [p for p, m in model.layers[0].named_modules()
             if p.rsplit(".", 1)[-1] in names and isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    missing = [n for n in names if not any(p.rsplit(".", 1)[-1] == n for p in found)]
    if missing:
        have = sorted({p.rsplit(".", 1)[-1] for p, m in model.layers[0].named_modules()
                       if isinstance(m, (nn.Linear, nn.QuantizedLinear))})
        raise ConfigError(f"finetune.targets: {','.join(missing)} not a linear layer of this model; "
                          f"it has {','.join(have)}")
    return sorted(found)


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.RMSNorm, nn.LayerNorm)) or type(m).__name__.endswith("RMSNorm")


def apply_lora(model: nn.Module, cfg: FinetuneConfig) -> LoraInfo:
    """Freeze the base, wrap the target projections of the last `cfg.layers` layers in
    LoRA (DoRA) layers, optionally unfreeze every norm. Seed `mx.random` first: lora_a
    starts random, and every rank must start from the same adapters."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    if cfg.method not in ("lora", "dora"):
        raise ConfigError(f"finetune.method: apply_lora needs lora or dora, got {cfg.method}")
    n_layers = len(model.layers)
    layers = adapted_layers(cfg, n_layers)
    keys = _layer_keys(model, targets(cfg))
    n_base = _base_count(model)
    model.freeze()
    linear_to_lora_layers(model, len(layers),
                          {"rank": cfg.rank, "scale": lora_scale(cfg), "dropout": cfg.dropout, "keys": keys},
                          use_dora=cfg.method == "dora")
    if cfg.train_norms:
        for _, m in model.named_modules():
            if _is_norm(m):
                m.unfreeze()
    trainable = tree_flatten(model.trainable_parameters())
    n_adapter = sum(v.size for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[-1] in ADAPTER_LEAVES)
    return LoraInfo(cfg.method, [k for k, _ in trainable], int(sum(v.size for _, v in trainable)),
                    n_base + int(n_adapter), keys, layers, n_layers)


def lora_state(model: nn.Module) -> dict[str, np.ndarray]:
    """The trainable parameters only (adapters, and norms if trained), as numpy."""
    params = tree_flatten(model.trainable_parameters())
    mx.eval([v for _, v in params])
    return {k: np.array(v) for k, v in params}


def load_lora_state(model: nn.Module, state: dict[str, np.ndarray], where: str = "adapter") -> None:
    """Set adapters (and norms) from `state`; every name must exist with the same shape."""
    have = dict(tree_flatten(model.parameters()))
    bad = [f"{k} {tuple(v.shape)} vs {tuple(have[k].shape) if k in have else 'missing'}"
           for k, v in state.items() if k not in have or tuple(have[k].shape) != tuple(v.shape)]
    if bad:
        raise ValueError(f"{where}: {len(bad)} tensors do not fit this model (first: {bad[0]}); "
                         "was it trained on another base or finetune.targets/layers?")
    model.update(tree_unflatten([(k, mx.array(v).astype(have[k].dtype)) for k, v in state.items()]))


@dataclass
class FuseReport:
    fused: int
    dequantized: bool  # the base was quantized: merged into dequantized weights


def fuse(model: nn.Module, dequantize: bool = True) -> FuseReport:
    """Merge adapters into plain linears in place. A quantized base is dequantized first
    (merging into 4-bit weights would throw the update away in rounding); with
    `dequantize=False` the merged weights are re-quantized, which loses precision."""
    from mlx_lm.utils import dequantize_model

    quantized = any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    fused = [(n, m.fuse(dequantize=dequantize)) for n, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dequantize and quantized:
        dequantize_model(model)
    return FuseReport(len(fused), dequantize and quantized)
