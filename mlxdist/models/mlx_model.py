"""Decoder-only transformer in MLX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Parameter names are the contract with the PyTorch twin (`torch_model.py`) and the
checkpoint format: `embed.weight`, `layers.{i}.attn.{wq,wk,wv,wo}.weight`,
`layers.{i}.{attn_norm,ffn_norm}.weight`, `layers.{i}.ffn.{w1,w2,w3}.weight`,
`norm.weight`, and `head.weight` when embeddings are not tied.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .presets import ModelArgs


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.rope = nn.RoPE(a.head_dim, traditional=False, base=a.rope_base)

    def __call__(self, x: mx.array) -> mx.array:
        b, t, _ = x.shape
        q = self.wq(x).reshape(b, t, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q), self.rope(k)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask="causal")
        return self.wo(o.transpose(0, 2, 1, 3).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.ffn = FeedForward(a)

    def __call__(self, x: mx.array) -> mx.array:
        h = x + self.attn(self.attn_norm(x))
        return h + self.ffn(self.ffn_norm(h))


def _checkpointed(block: Block, x: mx.array) -> mx.array:
    """Recompute this block's activations in the backward pass instead of storing them."""

    def run(params, x):
        block.update(params)
        return block(x)

    return mx.checkpoint(run)(block.trainable_parameters(), x)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.layers = [Block(a) for _ in range(a.n_layers)]
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        if not a.tie_embeddings:
            self.head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def __call__(self, tokens: mx.array) -> mx.array:
        h = self.embed(tokens)
        k = self.args.grad_checkpoint_every
        for i, layer in enumerate(self.layers):
            h = _checkpointed(layer, h) if k and i % k == 0 else layer(h)
        return self._out(h)

    def _out(self, h: mx.array) -> mx.array:
        h = self.norm(h)
        return self.embed.as_linear(h) if self.args.tie_embeddings else self.head(h)

    def stages(self) -> list[tuple[list[str], Callable[[mx.array], mx.array]]]:
        """The forward pass as a chain of calls, each with the parameters it reads (names as
        `parameters()` flattens them): the embedding, each block, the head. Composed they are
        `__call__` (without its recomputation, which a staged run does anyway): what lets
        `dist.shard=weights` hold one block's weights at a time."""
        head = ["norm.weight", "embed.weight" if self.args.tie_embeddings else "head.weight"]
        blocks = [([f"layers.{i}.{n}" for n, _ in tree_flatten(layer.parameters())], layer)
                  for i, layer in enumerate(self.layers)]
        return [(["embed.weight"], self.embed), *blocks, (head, self._out)]


def init_params(a: ModelArgs, seed: int) -> dict[str, mx.array]:
    """Deterministic fp32 initial weights (std 0.02, output projections scaled by depth)."""
    import numpy as np

    from .init import initial_weights

    return {k: mx.array(v) for k, v in initial_weights(a, seed, np).items()}
