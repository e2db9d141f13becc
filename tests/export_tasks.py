"""Tasks for tests/test_export_task.py, written the way a user would: trained by `task.factory:
export_tasks:...` from the tests directory, exported with `python -m mlxdist.export`, then loaded
into the user's own class.

Each model has a frozen part that is not in the checkpoint (a "base" seeded by BASE_SEED, in
bfloat16), trained weights and buffers (BatchNorm's statistics), so an export must rebuild the
first, lay the checkpoint over it and keep every tensor's dtype.
"""

from __future__ import annotations

import os

import numpy as np
from user_tasks import Regression

import mlxdist


def _base_seed() -> int:
    return int(os.environ.get("BASE_SEED", "0"))


def torch_net():
    """The user's torch class: a frozen bf16 projection (the 'base'), then Linear-BatchNorm-ReLU-Linear."""
    import torch

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                self.base.weight.copy_(torch.randn(8, 8, generator=torch.Generator().manual_seed(_base_seed())))
            self.base.requires_grad_(False)
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                            torch.nn.Linear(16, 3))

        def forward(self, x):
            return self.body(self.base(x.to(torch.bfloat16)).float())

    if os.environ.get("EXPORT_BROKEN"):  # a load_state_dict that renames keys (a refactor's migration)
        class Broken(TorchNet):
            def load_state_dict(self, state_dict, strict=True, assign=False):
                state_dict = {k.replace("body.", "trunk."): v for k, v in state_dict.items()}
                return super().load_state_dict(state_dict, strict=strict, assign=assign)

        return Broken()
    return TorchNet()


def torch_bn(n: int = 64) -> mlxdist.Task:
    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    return mlxdist.Task(build=lambda ctx: torch_net(), loss=loss, dataset=Regression(n))


def mlx_net():
    """The user's MLX class: the same shape as `torch_net`."""
    import mlx.core as mx
    import mlx.nn as nn

    class MLXNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(8, 8, bias=False)
            self.base.weight = mx.random.normal((8, 8), key=mx.random.key(_base_seed())).astype(mx.bfloat16)
            self.base.freeze()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm(16), nn.ReLU(), nn.Linear(16, 3))

        def __call__(self, x):
            return self.body(self.base(x.astype(mx.bfloat16)).astype(mx.float32))

    return MLXNet()


def mlx_bn(n: int = 64) -> mlxdist.Task:
    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    return mlxdist.Task(build=lambda ctx: mlx_net(), loss=loss, dataset=Regression(n))


class Tokens:
    def __init__(self, n: int, vocab: int, length: int = 17, seed: int = 0):
        self.tokens = np.random.default_rng(seed).integers(0, vocab, size=(n, length)).astype(np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i]


def lora_model(base: str):
    """What the user's own code does: a pretrained Llama from `base`, LoRA on q and v."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def torch_lora(base: str, n: int = 64) -> mlxdist.Task:
    def loss(model, tokens):
        import torch.nn.functional as F

        logits = model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")

    import json
    from pathlib import Path

    vocab = json.loads((Path(base) / "config.json").read_text())["vocab_size"]
    return mlxdist.Task(build=lambda ctx: lora_model(base), loss=loss, dataset=Tokens(n, vocab),
                        count=lambda b: b[:, 1:].size, unit="tokens")
