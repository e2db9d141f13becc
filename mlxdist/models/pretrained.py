"""Pretrained bases (a Hugging Face directory or a GGUF file) through the ecosystem's loaders.

mlx-lm builds the MLX model and transformers the torch one, so both engines see the same
architecture code their users already trust, with the Hugging Face parameter names on both
sides (GPT-2 is the one exception: see `to_hf_state`). Nothing heavy is imported at module
top: `inspect` and the fingerprint run before any framework is chosen, and a machine
without the `hf` extra must still get a one-line error instead of an ImportError.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import gate
from .errors import PretrainedError

if TYPE_CHECKING:
    import mlx.nn
    import numpy as np
    import torch

EXTRA = "pip install 'mlxdist[hf]'"
# Architectures whose loading, names and logits are tested on both engines.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
GGUF_SUPPORTED = ("llama",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# GGUF tensor types whose bits MLX keeps as affine quantization (group 32).
_GGUF_BITS = {2: 4, 3: 4, 8: 8}  # Q4_0, Q4_1, Q8_0
_SAMPLES = 16
_CHUNK = 1 << 16


@dataclass(frozen=True)
class PretrainedInfo:
    path: str
    model_type: str
    vocab_size: int
    n_params: int
    hf_config: dict = field(hash=False)
    gguf_file: str | None
    quantized_bits: int | None
    files: dict[str, str] = field(hash=False)
    fingerprint: str

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def require(*modules: str) -> None:
    """Fail with the extra's install line when one of its packages cannot be imported."""
    import importlib

    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError:
            raise PretrainedError(f"model.path needs the 'hf' extra ({mod} cannot be imported): {EXTRA}") from None


# ---------------------------------------------------------------------------------------------
# Inspection and fingerprint (no framework imports)


def file_digest(path: Path, full: bool = False) -> str:
    """sha256 of the size, the first MiB (the header) and 16 evenly spaced 64 KiB samples.

    Two different bases of the same architecture differ in every sampled block, and reading
    ~2 MiB keeps the start-up check instant for a 3B model (a full sha256 runs at ~1.1 GB/s here,
    so ~6 s
    per rank here); `full=True` hashes everything for the paranoid.
    """
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if full or size <= (1 << 20) + _SAMPLES * _CHUNK:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(f.read(1 << 20))
            for i in range(_SAMPLES):
                f.seek((1 << 20) + (size - (1 << 20) - _CHUNK) * (i + 1) // _SAMPLES)
                h.update(f.read(_CHUNK))
    return h.hexdigest()


def inspect(path: str | os.PathLike, full_hash: bool = False) -> PretrainedInfo:
    """Describe a base without loading it: what it is, how big, and a fingerprint of its bytes."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise PretrainedError(f"model.path: {path}: no such file or directory")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise PretrainedError(f"model.path: {path}: expected a Hugging Face directory or a .gguf file")
        return _inspect_gguf(p, full_hash)
    return _inspect_dir(p, full_hash)


def _fingerprint(config: dict, files: dict[str, str]) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name in sorted(files):
        h.update(f"{name}:{files[name]}".encode())
    return h.hexdigest()[:32]


def _safetensors_shapes(path: Path) -> list[list[int]]:
    """Every tensor's shape, from the header alone (the file is mapped, not read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            names = f.keys()  # a safe_open handle is not iterable itself
            return [f.get_slice(name).get_shape() for name in names]
    except SafetensorError as e:
        raise PretrainedError(f"model.path: {path}: not a readable safetensors file ({e})") from None


def _inspect_dir(p: Path, full_hash: bool) -> PretrainedInfo:
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise PretrainedError(f"model.path: {p}: not a Hugging Face model directory (no config.json)")
    try:  # a downloaded model's files are from elsewhere: read through the gate
        config = gate.read_json(cfg_file, "model config", gate.Dict(values=gate.Tree()))
        index = p / "model.safetensors.index.json"
        index_map = (gate.read_json(index, "weight index", gate.Dict(
            {"weight_map": gate.Dict(values=gate.Str(255))}, required=("weight_map",), values=gate.Tree()))
            ["weight_map"] if index.is_file() else {})
    except gate.FileRefused as e:
        raise PretrainedError(f"model.path: {e}") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise PretrainedError(f"model.path: {cfg_file}: unsupported model_type {model_type!r} "
                              f"(supported: {', '.join(SUPPORTED)})")
    weights = sorted(q for q in p.glob("*.safetensors"))
    if not weights:
        raise PretrainedError(f"model.path: {p}: no *.safetensors weights (re-save the model with "
                              "transformers' save_pretrained(..., safe_serialization=True))")
    if index_map:
        wanted = set(index_map.values())
        missing = sorted(wanted - {w.name for w in weights})
        if missing:
            raise PretrainedError(f"model.path: {index}: shard {missing[0]} is missing")
    if not any((p / t).is_file() for t in TOKENIZER_FILES):
        raise PretrainedError(f"model.path: {p}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                              "copy the tokenizer files of the base model into it")
    n_params, bits = 0, None
    for w in weights:
        for shape in _safetensors_shapes(w):
            count = 1
            for d in shape:
                count *= d
            n_params += count
    q = config.get("quantization") or {}
    if isinstance(q, dict) and q.get("bits"):
        bits = int(q["bits"])
    files = {w.name: file_digest(w, full_hash) for w in weights}
    return PretrainedInfo(path=str(p), model_type=model_type, vocab_size=int(_vocab(config)),
                          n_params=n_params, hf_config=config, gguf_file=None, quantized_bits=bits,
                          files=files, fingerprint=_fingerprint(config, files))


def _vocab(config: dict) -> int:
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)


def _inspect_gguf(p: Path, full_hash: bool) -> PretrainedInfo:
    from .gguf import gguf_hf_config, read_gguf_header

    try:
        meta, tensors = read_gguf_header(p)
    except (struct.error, KeyError, UnicodeDecodeError) as e:
        raise PretrainedError(f"model.path: {p}: unreadable GGUF header ({e})") from None
    arch = meta.get("general.architecture")
    if arch not in GGUF_SUPPORTED:
        raise PretrainedError(f"model.path: {p}: unsupported GGUF architecture {arch!r} "
                              f"(supported: {', '.join(GGUF_SUPPORTED)}; or use a Hugging Face directory)")
    if "tokenizer.ggml.tokens" not in meta:
        raise PretrainedError(f"model.path: {p}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    config = gguf_hf_config(meta, tensors)
    n_params = 0
    bits_seen = set()
    for _, dims, ttype in tensors:
        count = 1
        for d in dims:
            count *= d
        n_params += count
        if ttype in _GGUF_BITS:
            bits_seen.add(_GGUF_BITS[ttype])
        elif ttype not in (0, 1, 30):
            raise PretrainedError(f"model.path: {p}: GGUF tensor type {ttype} is not supported "
                                  "(F32, F16, BF16, Q4_0, Q4_1, Q8_0 are)")
    files = {p.name: file_digest(p, full_hash)}
    return PretrainedInfo(path=str(p), model_type=arch, vocab_size=config["vocab_size"], n_params=n_params,
                          hf_config=config, gguf_file=p.name, quantized_bits=min(bits_seen) if bits_seen else None,
                          files=files, fingerprint=_fingerprint(config, files))


# ---------------------------------------------------------------------------------------------
# Names shared by both engines


_GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_hf_state(weights: dict[str, np.ndarray], model_type: str) -> dict[str, np.ndarray]:
    """MLX parameter names/layout -> transformers' (identity except GPT-2).

    mlx-lm names GPT-2 `model.h.0...` with Linear [out, in] weights, transformers
    `transformer.h.0...` with Conv1D [in, out] weights; every other supported
    architecture already shares names and layouts.
    """
    return _renamed(weights, model_type, "model.", "transformer.")


def from_hf_state(weights: dict[str, np.ndarray], model_type: str) -> dict[str, np.ndarray]:
    """Inverse of `to_hf_state`."""
    return _renamed(weights, model_type, "transformer.", "model.")


def _renamed(weights: dict[str, np.ndarray], model_type: str, old: str, new: str) -> dict[str, np.ndarray]:
    if model_type != "gpt2":
        return dict(weights)
    out = {}
    for name, w in weights.items():
        name = new + name[len(old):] if name.startswith(old) else name
        out[name] = w.T if name.endswith(_GPT2_TRANSPOSED) else w
    return out


def mlx_state(model: mlx.nn.Module) -> dict[str, np.ndarray]:
    """The MLX model's parameters as numpy, by name (what a checkpoint stores)."""
    import numpy as np
    from mlx.utils import tree_flatten

    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def torch_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy() for k, v in module.named_parameters()}


# ---------------------------------------------------------------------------------------------
# MLX


def _mlx_config(config: dict) -> dict:
    cfg = dict(config)
    rp = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and isinstance(rp, dict) and "rope_theta" in rp:
        cfg["rope_theta"] = rp["rope_theta"]
    if cfg.get("model_type") == "gpt2":
        cfg.setdefault("n_ctx", cfg.get("n_positions", 1024))
    return cfg


def load_mlx(path: str | os.PathLike, quantize: int | None = None) -> tuple[mlx.nn.Module, PretrainedInfo]:
    """An mlx-lm model (`model(tokens[b, T]) -> logits[b, T, V]`) and what it was loaded from.

    quantize=None gives float weights (a quantized GGUF is dequantized, so full fine-tuning
    works); 4 or 8 quantizes an HF model with MLX affine quantization (group 64), while a
    quantized GGUF keeps its own Q4/Q8 blocks (group 32) whatever the number.
    """
    info = inspect(path)
    require("mlx_lm", "transformers")
    if quantize not in (None, 4, 8):
        raise PretrainedError(f"model.quantize: {quantize}: expected 4 or 8")
    if info.is_gguf:
        from .gguf import load_mlx_gguf

        model = load_mlx_gguf(Path(info.path), info.hf_config, quantize)
    else:
        model = _load_mlx_dir(Path(info.path), info)
        if quantize is not None and info.quantized_bits is None:
            from mlx_lm.utils import quantize_model

            model, _ = quantize_model(model, _mlx_config(info.hf_config), group_size=64, bits=quantize)
    if quantize is not None:
        info = _with_bits(info, info.quantized_bits or quantize)
    elif info.is_gguf:
        info = _with_bits(info, None)
    return model, info


def _with_bits(info: PretrainedInfo, bits: int | None) -> PretrainedInfo:
    from dataclasses import replace

    return replace(info, quantized_bits=bits)


def _load_mlx_dir(p: Path, info: PretrainedInfo):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    def classes(config: dict):
        import importlib

        from mlx_lm.utils import MODEL_REMAPPING

        t = config["model_type"]
        arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(t, t)}")
        if t != "gpt2":
            return arch.Model, arch.ModelArgs

        class GPT2(arch.Model):
            # mlx-lm's GPT-2 expects the original OpenAI key names; transformers saves them
            # under `transformer.`, which would otherwise skip its Conv1D transposes.
            def sanitize(self, weights):
                return super().sanitize({k.removeprefix("transformer."): v for k, v in weights.items()})

        return GPT2, arch.ModelArgs

    model, _ = load_model(p, lazy=True, model_config=_mlx_config(info.hf_config), get_model_classes=classes)
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------------------------------------
# torch


def cache_root() -> Path:
    return Path(os.environ.get("MLXDIST_CACHE") or Path.home() / ".cache" / "mlxdist")


def hf_dir(path: str | os.PathLike, info: PretrainedInfo | None = None, log=None) -> Path:
    """A Hugging Face directory for the base: itself, or a GGUF file's cached conversion.

    transformers parses a GGUF vocabulary in ~20 s, so the conversion (fp32 weights,
    tokenizer, config) is done once and kept under ~/.cache/mlxdist/gguf-<fingerprint>.
    """
    info = info or inspect(path)
    if not info.is_gguf:
        return Path(info.path)
    out = cache_root() / f"gguf-{info.fingerprint}"
    if (out / "config.json").is_file():
        return out
    require("transformers", "gguf", "torch")
    (log or (lambda m: print(m, file=sys.stderr)))(
        f"converting {info.path} to a Hugging Face directory once (~20 s), cached in {out}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(info.path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.setdefault("rope_theta", info.hf_config["rope_theta"])
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another rank on this host finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_torch(path: str | os.PathLike, device: str = "cpu") -> tuple[torch.nn.Module, PretrainedInfo]:
    """A transformers model in fp32, callable as `module(input_ids) -> logits`.

    The wrapper shares the inner model's submodules, so `named_parameters()` and
    `state_dict()` carry the Hugging Face names, the same ones mlx-lm uses.
    """
    info = inspect(path)
    require("torch", "transformers")
    d = hf_dir(path, info)
    import torch
    from transformers import AutoModelForCausalLM

    try:
        # mlx-lm's models have no dropout; without this GPT-2 would train differently per engine.
        no_dropout = ({"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0} if info.model_type == "gpt2"
                      else {"attention_dropout": 0.0})
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **no_dropout)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PretrainedError(f"model.path: {path}: transformers cannot load it ({first})") from None
    from .hf_torch import wrap

    return wrap(hf).to(device), info
