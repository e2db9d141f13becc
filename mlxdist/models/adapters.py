"""Adapter files other tools read: PEFT's layout and mlx-lm's, from our adapter state.

`state` is the dict that `lora.lora_state` / `lora_torch.lora_state_torch` return (our
names, see lora.py). Writing needs only numpy and safetensors, no torch, so an MLX-only
Mac can export for PEFT users.

  PEFT    adapter_config.json + adapter_model.safetensors, keys
          `base_model.model.P.lora_A.weight` [r,in], `.lora_B.weight` [out,r],
          `.lora_magnitude_vector` [out]; trained norms as `base_model.model.N.weight`
          with their leaf names in `modules_to_save`.
  mlx-lm  adapter_config.json (`fine_tune_type`, `num_layers`, `lora_parameters` with
          `rank`, `scale`, `dropout`, `keys`) + adapters.safetensors under our own names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import FinetuneConfig
from .lora import ADAPTER_LEAVES, lora_scale

PEFT_PREFIX = "base_model.model."


@dataclass
class BaseInfo:
    """The base an adapter belongs to: where it was loaded from and how deep it is."""

    path: str
    n_layers: int
    fingerprint: str | None = None


def base_fingerprint(model_path: str | Path) -> str:
    """sha256 over the base's weight and config files (names, sizes, bytes), so a resumed
    or loaded adapter can refuse a different base. Engine-independent: hashes files, not
    tensors, so an MLX and a torch run of the same directory agree."""
    p = Path(model_path)
    files = [p] if p.is_file() else sorted(
        f for f in p.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin") or f.name == "config.json")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _split(name: str) -> tuple[str, str]:
    path, leaf = name.rsplit(".", 1)
    return path, leaf


def to_peft_tensors(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, v in state.items():
        path, leaf = _split(name)
        v = np.ascontiguousarray(v, dtype=np.float32)  # safetensors writes a strided view's raw memory
        if leaf == "lora_a":
            out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = np.ascontiguousarray(v.T)
        elif leaf == "lora_b":
            out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = np.ascontiguousarray(v.T)
        elif leaf == "m":
            out[f"{PEFT_PREFIX}{path}.lora_magnitude_vector"] = v
        else:
            out[f"{PEFT_PREFIX}{name}"] = v
    return out


def from_peft_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for key, v in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for theirs, ours, transpose in ((".lora_A.weight", ".lora_a", True), (".lora_B.weight", ".lora_b", True),
                                        (".lora_magnitude_vector", ".m", False)):
            if name.endswith(theirs):
                name = name[: -len(theirs)] + ours
                v = np.ascontiguousarray(v.T) if transpose else v
                break
        out[name] = np.asarray(v, dtype=np.float32)
    return out


def _keys(state) -> list[str]:
    keys = set()
    for name in state:
        path, leaf = _split(name)
        if leaf in ADAPTER_LEAVES:
            parts = path.split(".")
            keys.add(".".join(parts[parts.index("layers") + 2:]))
    return sorted(keys)


def _layers(state) -> list[int]:
    out = set()
    for name in state:
        parts = name.split(".")
        if _split(name)[1] in ADAPTER_LEAVES:
            out.add(int(parts[parts.index("layers") + 1]))
    return sorted(out)


def _norm_leaves(state) -> list[str]:
    return sorted({_split(_split(n)[0])[1] for n in state if _split(n)[1] not in ADAPTER_LEAVES})


def save_peft(state: dict[str, np.ndarray], base: BaseInfo, cfg: FinetuneConfig, out_dir: str | Path) -> Path:
    """Write a PEFT adapter that `peft.PeftModel.from_pretrained(hf_base, out_dir)` loads."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = _layers(state)
    norms = _norm_leaves(state)
    conf = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base.path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "bias": "none",
        "target_modules": sorted({k.rsplit(".", 1)[-1] for k in _keys(state)}),
        "layers_to_transform": None if len(layers) == base.n_layers else layers,
        "use_dora": cfg.method == "dora", "use_rslora": False, "fan_in_fan_out": False,
        "modules_to_save": norms or None, "init_lora_weights": True, "inference_mode": True,
    }
    meta = {"format": "pt", "mlxdist_method": cfg.method, "mlxdist_base_fingerprint": base.fingerprint or ""}
    save_file(to_peft_tensors(state), str(out / "adapter_model.safetensors"), metadata=meta)
    (out / "adapter_config.json").write_text(json.dumps(conf, indent=2))
    return out


def read_peft(path: str | Path) -> tuple[dict[str, np.ndarray], FinetuneConfig]:
    """(state under our names, the FinetuneConfig that rebuilds the same adapters)."""
    from safetensors.numpy import load_file

    p = Path(path)
    conf_file = p / "adapter_config.json"
    if not conf_file.exists():
        raise ValueError(f"{p}: no adapter_config.json (not a PEFT adapter directory)")
    conf = json.loads(conf_file.read_text())
    if conf.get("peft_type", "LORA") != "LORA" or conf.get("use_rslora") or conf.get("fan_in_fan_out"):
        raise ValueError(f"{conf_file}: only plain LoRA/DoRA adapters load here "
                         f"(peft_type={conf.get('peft_type')}, use_rslora, fan_in_fan_out unsupported)")
    if not isinstance(conf.get("target_modules"), list):
        raise ValueError(f"{conf_file}: target_modules must be a list of module names")
    weights = p / "adapter_model.safetensors"
    if not weights.exists():
        raise ValueError(f"{p}: no adapter_model.safetensors (convert .bin adapters with PEFT first)")
    state = from_peft_tensors(load_file(str(weights)))
    layers = _layers(state)
    last = {"layers": len(layers)} if conf.get("layers_to_transform") else {}  # else the default
    cfg = FinetuneConfig(method="dora" if conf.get("use_dora") else "lora", rank=int(conf["r"]),
                         alpha=float(conf["lora_alpha"]), dropout=float(conf.get("lora_dropout", 0.0)),
                         targets=",".join(conf["target_modules"]), train_norms=bool(conf.get("modules_to_save")),
                         **last)
    return state, cfg


def peft_base_fingerprint(path: str | Path) -> str | None:
    """The base fingerprint we stored in the adapter's safetensors metadata (None if an
    adapter made elsewhere)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="numpy") as f:
        return (f.metadata() or {}).get("mlxdist_base_fingerprint") or None


def load_peft_into_mlx(model, path: str | Path):
    """Wrap an mlx-lm model's layers as the PEFT adapter at `path` says and load its
    weights (unmerged: the base stays as it is). Returns the LoraInfo."""
    from .lora import apply_lora, load_lora_state

    state, cfg = read_peft(path)
    n = len(model.layers)
    if cfg.layers and _layers(state) != list(range(n - cfg.layers, n)):
        raise ValueError(f"{path}: adapted layers {_layers(state)} are not the last {cfg.layers} of {n}")
    info = apply_lora(model, cfg)
    load_lora_state(model, state, where=str(path))
    return info


def save_mlx_lm_adapter(state: dict[str, np.ndarray], cfg: FinetuneConfig, n_layers: int,
                        out_dir: str | Path) -> Path:
    """Write mlx-lm's layout (`mlx_lm.load(base, adapter_path=out_dir)`, `mlx_lm.fuse`)."""
    from safetensors.numpy import save_file

    norms = _norm_leaves(state)
    if norms:
        raise ValueError(f"mlx-lm's adapter layout cannot hold trained norms ({','.join(norms)}; "
                         "finetune.train_norms=true): export the PEFT layout or a fused model instead")
    layers = _layers(state)
    if layers != list(range(n_layers - len(layers), n_layers)):
        raise ValueError(f"adapted layers {layers} are not the last {len(layers)} of {n_layers}; "
                         "mlx-lm adapts only a tail of layers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conf = {"fine_tune_type": cfg.method, "num_layers": len(layers),
            "lora_parameters": {"rank": cfg.rank, "scale": lora_scale(cfg), "dropout": cfg.dropout,
                                "keys": _keys(state)}}
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}, str(out / "adapters.safetensors"),
              metadata={"format": "mlx"})
    (out / "adapter_config.json").write_text(json.dumps(conf, indent=2))
    return out


_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def save_fused(model, config: dict, out_dir: str | Path, base_dir: str | Path | None = None,
               dequantized: bool = False) -> Path:
    """Write a merged model (after `lora.fuse`) as a Hugging Face style directory that
    mlx-lm and transformers both open; tokenizer files are copied from `base_dir`.
    `dequantized`: the base was quantized and the merge dequantized it, so the config
    must no longer claim quantization."""
    import shutil

    from mlx_lm.utils import save_config, save_model

    out = Path(out_dir)
    if any(hasattr(m, "lora_a") for _, m in model.named_modules()):
        raise ValueError(f"{out}: the model still has unmerged adapters; call lora.fuse(model) first")
    config = dict(config)
    if dequantized:
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    save_model(out, model)
    save_config(config, out / "config.json")
    if base_dir is not None and Path(base_dir).is_dir():
        for name in _SIDE_FILES:
            if (Path(base_dir) / name).exists():
                shutil.copy(Path(base_dir) / name, out / name)
    return out
