"""Initial weights made with numpy, so both engines start from the very same numbers."""

from __future__ import annotations

from .presets import ModelArgs


def param_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    hd = a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (a.vocab_size, a.dim)}
    for i in range(a.n_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm.weight": (a.dim,),
            p + "attn.wq.weight": (a.n_heads * hd, a.dim),
            p + "attn.wk.weight": (a.n_kv_heads * hd, a.dim),
            p + "attn.wv.weight": (a.n_kv_heads * hd, a.dim),
            p + "attn.wo.weight": (a.dim, a.n_heads * hd),
            p + "ffn_norm.weight": (a.dim,),
            p + "ffn.w1.weight": (a.ffn_dim, a.dim),
            p + "ffn.w3.weight": (a.ffn_dim, a.dim),
            p + "ffn.w2.weight": (a.dim, a.ffn_dim),
        }
    shapes["norm.weight"] = (a.dim,)
    if not a.tie_embeddings:
        shapes["head.weight"] = (a.vocab_size, a.dim)
    return shapes


def initial_weights(a: ModelArgs, seed: int, np) -> dict:
    rng = np.random.default_rng(seed)
    out_scale = 0.02 / (2 * a.n_layers) ** 0.5
    weights = {}
    for name, shape in param_shapes(a).items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, np.float32)
        else:
            std = out_scale if name.endswith(("wo.weight", "w2.weight")) else 0.02
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
    return weights
