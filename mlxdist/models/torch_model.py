"""PyTorch twin of `mlx_model.py`: same parameter names, same math, same initial numbers.

The two must agree to float32 rounding so that a checkpoint written by one engine can be
resumed by the other and a loss curve means the same thing on a Mac and on a CUDA box.
Every choice below that looks arbitrary (rotate-half RoPE, kv-head grouping, fp32 norms)
is there to reproduce what MLX does; `tests/test_torch.py` compares logits against MLX.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .presets import ModelArgs


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the input dtype, as `mx.fast.rms_norm` does.

    Under autocast the residual stream may arrive in bf16/fp16; normalising in low
    precision loses enough accuracy to make the engines' losses visibly diverge.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(
    head_dim: int, seq_len: int, base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim/2] for `mx.fast.rope(traditional=False)`.

    MLX's frequencies are base ** (-i / (head_dim/2)) for i < head_dim/2, i.e. the usual
    base ** (-2i / head_dim); positions start at 0 (no offset: there is no KV cache here).
    Built in float32 on every call because T varies between training and sampling and
    the cost is negligible next to attention.
    """
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = t[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE on [b, heads, T, head_dim]: dimension j pairs with j + d/2,
    which is MLX's non-traditional layout (the traditional one pairs 2j with 2j+1)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.rope_base = a.rope_base
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(self.head_dim, t, self.rope_base, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # MLX gives query head h the kv head h // (n_heads / n_kv_heads); repeat_interleave
        # (what enable_gqa does) reproduces exactly that grouping. Done explicitly because
        # enable_gqa is not implemented by every backend (MPS, older flash kernels).
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn = FeedForward(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM; `state_dict()` keys equal `init.param_shapes(args)` keys."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList([Block(a) for _ in range(a.n_layers)])
        self.norm = RMSNorm(a.dim, a.norm_eps)
        if not a.tie_embeddings:
            self.head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        k = self.args.grad_checkpoint_every
        # Same rule as MLX (layer i recomputed when i % k == 0) so that memory estimates and
        # batch-size controllers tuned on one engine carry over to the other. Only worth
        # doing when a backward will follow.
        recompute = bool(k) and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            h = checkpoint(layer, h, use_reentrant=False) if recompute and i % k == 0 else layer(h)
        return self._out(h)

    def _out(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        if self.args.tie_embeddings:
            return F.linear(h, self.embed.weight)
        return self.head(h)

    def stages(self) -> list[tuple[list[str], Callable[[torch.Tensor], torch.Tensor]]]:
        """The forward pass as a chain of calls with the parameters each reads, as the MLX
        twin's `stages()` (what `dist.shard=weights` runs)."""
        head = ["norm.weight", "embed.weight" if self.args.tie_embeddings else "head.weight"]
        blocks = [([f"layers.{i}.{n}" for n, _ in layer.named_parameters()], layer)
                  for i, layer in enumerate(self.layers)]
        return [(["embed.weight"], self.embed), *blocks, (head, self._out)]
