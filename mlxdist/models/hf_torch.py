"""The torch engine's view of a transformers model: token ids in, logits out, HF names kept."""

from __future__ import annotations

import torch


class HFCausalLM(torch.nn.Module):
    """`forward(input_ids) -> logits`, with `named_parameters()` exactly the inner model's.

    The wrapper shares the inner model's module/parameter tables instead of holding it as a
    child, which would prefix every name and break checkpoint exchange with the MLX engine.
    """

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "hf", hf)
        self._modules = hf._modules
        self._parameters = hf._parameters
        self._buffers = hf._buffers
        self.config = hf.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits

    def train(self, mode: bool = True) -> HFCausalLM:
        self.hf.train(mode)
        return super().train(mode)
