"""The torch engine's view of a transformers model: token ids in, logits out, HF names kept."""

from __future__ import annotations

from collections.abc import Callable

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


_LAYOUT = ("embed_tokens", "layers", "norm", "rotary_emb")


class HFStagedLM(HFCausalLM):
    """A transformers model laid out as Llama and most decoder-only models are
    (`model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`), with
    `stages()`."""

    def stages(self) -> list[tuple[list[str], Callable[[torch.Tensor], torch.Tensor]]]:
        """The forward pass as a chain of calls with the parameters each reads (the embedding,
        each decoder layer, the final norm and head); composed they are `forward`. What lets a
        pipeline or ZeRO-3 hold a run of layers."""
        from transformers.masking_utils import create_causal_mask

        inner, head = self.hf.model, self.hf.lm_head

        ids = {id(p): n for n, p in self.named_parameters()}

        def names(module: torch.nn.Module) -> list[str]:
            return list(dict.fromkeys(ids[id(p)] for p in module.parameters()))

        def block(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            def run(h: torch.Tensor) -> torch.Tensor:
                pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
                mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                          position_ids=pos)
                out = layer(h, attention_mask=mask, position_embeddings=inner.rotary_emb(h, position_ids=pos),
                            position_ids=pos)
                return out[0] if isinstance(out, tuple) else out

            return run

        def last(h: torch.Tensor) -> torch.Tensor:
            return head(inner.norm(h))

        layers = list(inner.layers[: self.config.num_hidden_layers])
        return [(names(inner.embed_tokens), inner.embed_tokens), *[(names(layer), block(layer)) for layer in layers],
                (list(dict.fromkeys(names(inner.norm) + names(head))), last)]


def wrap(hf: torch.nn.Module) -> HFCausalLM:
    """The engine's view of `hf`: with `stages()` when its layout allows them."""
    inner = getattr(hf, "model", None)
    staged = hasattr(hf, "lm_head") and inner is not None and all(hasattr(inner, p) for p in _LAYOUT)
    return (HFStagedLM if staged else HFCausalLM)(hf)
