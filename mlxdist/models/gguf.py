"""GGUF files (llama architecture) without llama.cpp: header, config, names, MLX weights.

The header reader is plain Python so `inspect` stays framework-free; the weights come from
`mx.load`, which returns Q4_0/Q4_1/Q8_0 blocks as MLX affine quantization (group 32).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from .errors import PretrainedError

# GGUF value types -> struct format (strings and arrays handled apart).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, list[int], int]]]:
    """Metadata and tensor table of a GGUF file (v2/v3), read without any framework.

    String arrays (the vocabulary, merges) are returned as their length only: the tokenizer
    comes from transformers' conversion, and skipping them keeps this read in milliseconds.
    """
    with open(path, "rb") as f:
        data = f.read(1 << 20)
        pos = 0

        def need(n: int) -> None:
            nonlocal data
            while pos + n > len(data):
                more = f.read(max(n, 1 << 22))
                if not more:
                    raise PretrainedError(f"model.path: {path}: truncated GGUF header")
                data += more

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize("<" + fmt)
            need(size)
            val = struct.unpack_from("<" + fmt, data, pos)
            pos += size
            return val[0] if len(val) == 1 else val

        def string() -> str:
            nonlocal pos
            n = take("Q")
            need(n)
            s = data[pos:pos + n].decode("utf-8", errors="replace")
            pos += n
            return s

        def value(t: int):
            nonlocal pos
            if t == 8:
                return string()
            if t == 9:
                et, n = take("I"), take("Q")
                if et == 8:
                    for _ in range(n):
                        m = take("Q")
                        need(m)
                        pos += m
                    return n
                fmt = _GGUF_SCALARS[et]
                size = struct.calcsize(fmt) * n
                need(size)
                vals = list(struct.unpack_from(f"<{n}{fmt}", data, pos))
                pos += size
                return vals if n <= 64 else n
            return take(_GGUF_SCALARS[t])

        if take("4s") != b"GGUF":
            raise PretrainedError(f"model.path: {path}: not a GGUF file (bad magic)")
        version = take("I")
        if version < 2:
            raise PretrainedError(f"model.path: {path}: GGUF version {version} is too old (need 2 or 3)")
        n_tensors, n_kv = take("Q"), take("Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("Q") for _ in range(take("I"))]
            ttype = take("I")
            take("Q")
            tensors.append((name, dims, ttype))
    return meta, tensors


def gguf_hf_config(meta: dict, tensors: list[tuple[str, list[int], int]]) -> dict:
    """A transformers/mlx-lm config.json for a llama-architecture GGUF file.

    `rope_theta` is written top-level as well as in `rope_parameters`: mlx-lm's llama reads
    only the former and silently falls back to 10000 without it.
    """
    a = meta["general.architecture"]
    names = {t[0]: t[1] for t in tensors}
    n_heads = int(meta[f"{a}.attention.head_count"])
    dim = int(meta[f"{a}.embedding_length"])
    vocab = int(meta.get(f"{a}.vocab_size") or names["token_embd.weight"][1])
    theta = float(meta.get(f"{a}.rope.freq_base", 10000.0))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": int(meta[f"{a}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{a}.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", n_heads)),
        "head_dim": int(meta.get(f"{a}.rope.dimension_count", dim // n_heads)),
        "rms_norm_eps": float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 2048)),
        "vocab_size": vocab,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": eos,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    # float32 keeps the JSON stable (the header stores float32; Python would print 1e-05 as 9.99e-06).
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    return cfg


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{kind}"
    if base == "output_norm":
        return f"model.norm.{kind}"
    if base == "output":
        return f"lm_head.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{kind}"
    raise PretrainedError(f"GGUF tensor {name!r} has no Hugging Face llama name")


def _unpermute(a, n_heads: int):
    """Undo llama.cpp's Q/K row interleave so the standard (non-traditional) RoPE applies."""
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def load_mlx_gguf(p: Path, cfg: dict, quantize: int | None):
    """An mlx-lm llama from a GGUF file: float weights, or the file's own Q4/Q8 blocks kept."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    raw = mx.load(str(p))
    weights: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for name, a in raw.items():
        hf = gguf_to_hf_name(name)
        module, _, kind = hf.rpartition(".")
        if kind in ("scales", "biases"):
            a = a.astype(mx.float32)
        elif kind == "weight" and f"{name[:-len('.weight')]}.scales" in raw:
            in_dim = raw[name[:-len(".weight")] + ".scales"].shape[-1] * 32
            bits[module] = a.shape[-1] * 32 // in_dim
        elif a.dtype != mx.float32:
            a = a.astype(mx.float32)
        if ".q_proj." in hf:
            a = _unpermute(a, cfg["num_attention_heads"])
        elif ".k_proj." in hf:
            a = _unpermute(a, cfg["num_key_value_heads"])
        weights[hf] = a
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    if quantize is None:
        for module, b in bits.items():
            w = weights.pop(f"{module}.weight")
            s, z = weights.pop(f"{module}.scales"), weights.pop(f"{module}.biases")
            weights[f"{module}.weight"] = mx.dequantize(w, s, z, group_size=32, bits=b)
    else:
        nn.quantize(model, class_predicate=lambda path, m: (
            {"group_size": 32, "bits": bits[path]} if path in bits else False))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    if quantize is not None and not bits:
        from mlx_lm.utils import quantize_model

        model, _ = quantize_model(model, cfg, group_size=64, bits=quantize)
    model.eval()
    return model
