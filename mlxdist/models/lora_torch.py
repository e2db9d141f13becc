"""LoRA / DoRA on a transformers model through PEFT, under the MLX side's names.

PEFT names and shapes (inside a `PeftModel`)     our names (mlx-lm's, see lora.py)
  base_model.model.P.lora_A.default.weight [r,in]   P.lora_a [in,r]   (transposed)
  base_model.model.P.lora_B.default.weight [out,r]  P.lora_b [r,out]  (transposed)
  base_model.model.P.lora_magnitude_vector.default.weight [out]   P.m [out]
  base_model.model.N.modules_to_save.default.weight               N.weight (a trained norm)
Both scale the update by alpha / rank (PEFT `lora_alpha`, mlx-lm `scale`), and both put
DoRA's magnitude per output row, so one state dict drives either engine.
"""

from __future__ import annotations

import numpy as np

from ..config import ConfigError, FinetuneConfig
from .lora import LoraInfo, adapted_layers, targets

_PREFIX = "base_model.model."


def _n_layers(model) -> int:
    n = getattr(model.config, "num_hidden_layers", None)
    if n is None:
        raise ConfigError("finetune: cannot tell how many layers this model has (no config.num_hidden_layers)")
    return int(n)


def norm_names(model) -> list[str]:
    """Leaf names of the model's norm modules (input_layernorm, norm, ...)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if n and "norm" in type(m).__name__.lower()})


def peft_config(cfg: FinetuneConfig, n_layers: int, norms: list[str] | None = None):
    from peft import LoraConfig

    layers = adapted_layers(cfg, n_layers)
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=targets(cfg), use_dora=cfg.method == "dora",
                      layers_to_transform=None if len(layers) == n_layers else layers,
                      modules_to_save=norms or None, bias="none", task_type="CAUSAL_LM")


def apply_lora_torch(model, cfg: FinetuneConfig):
    """(peft_model, LoraInfo): base frozen, adapters (and norms, if asked) trainable.
    Seed torch first: lora_A starts random."""
    from peft import get_peft_model

    if cfg.method not in ("lora", "dora"):
        raise ConfigError(f"finetune.method: apply_lora_torch needs lora or dora, got {cfg.method}")
    n_layers = _n_layers(model)
    linears = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"}
    missing = [t for t in targets(cfg) if t not in linears]
    if missing:
        raise ConfigError(f"finetune.targets: {','.join(missing)} not a linear layer of this model; "
                          f"it has {','.join(sorted(linears))}")
    n_total = sum(p.numel() for p in model.parameters())
    pm = get_peft_model(model, peft_config(cfg, n_layers, norm_names(model) if cfg.train_norms else None))
    names = [to_ours(n) for n, p in pm.named_parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    n_added = sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    keys = sorted({_layer_key(n) for n in names if n.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m")})
    return pm, LoraInfo(cfg.method, names, n_trainable, n_total + n_added, keys,
                        adapted_layers(cfg, n_layers), n_layers)


def _layer_key(name: str) -> str:
    parts = name.split(".")
    i = parts.index("layers")
    return ".".join(parts[i + 2:-1])


def to_ours(peft_name: str) -> str:
    n = peft_name.removeprefix(_PREFIX).replace(".modules_to_save.default", "")
    for theirs, ours in ((".lora_A.default.weight", ".lora_a"), (".lora_B.default.weight", ".lora_b"),
                         (".lora_magnitude_vector.default.weight", ".m")):
        if n.endswith(theirs):
            return n[: -len(theirs)] + ours
    return n


def lora_state_torch(pm) -> dict[str, np.ndarray]:
    """Trainable parameters under our names and shapes (fp32 numpy)."""
    out = {}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            ours = to_ours(n)
            v = p.detach().float().cpu().numpy()
            out[ours] = v.T.copy() if ours.endswith((".lora_a", ".lora_b")) else v
    return out


def load_lora_state_torch(pm, state: dict[str, np.ndarray], where: str = "adapter") -> None:
    import torch

    params = {to_ours(n): p for n, p in pm.named_parameters() if p.requires_grad}
    missing = sorted(set(state) ^ set(params))
    if missing:
        raise ValueError(f"{where}: adapter names differ from this model's ({len(missing)}, first: {missing[0]}); "
                         "was it trained with other finetune.targets/layers/train_norms?")
    with torch.no_grad():
        for k, v in state.items():
            v = v.T if k.endswith((".lora_a", ".lora_b")) else v
            p = params[k]
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, model wants {tuple(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(v)).to(p.dtype))
