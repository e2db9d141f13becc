"""A model's stages: its forward pass as a chain of calls, each with the trained parameters it
reads, which is what lets a pipeline (`dist.mode=pipeline`) or ZeRO-3 (`dist.shard=weights`) hold
a run of layers instead of the whole model.

A model may offer its own (`stages()`: the built-in LM, a task's module, the torch engine's
transformers wrapper). An mlx-lm model of the plain decoder layout (`model.model.embed_tokens`,
`model.model.layers`, `model.model.norm`, then `lm_head` or the tied embedding) or GPT-2's (`wte`
plus the positions' `wpe`, `h`, `ln_f`, the tied `wte` as head) gets them derived here, each layer
called as mlx-lm's own `__call__` calls it (the causal mask mlx-lm builds, no cache), so the
stages composed are `model(tokens)` exactly. Only architectures whose `__call__` is one of those
chains and nothing more are derived (`DERIVED`: Gemma scales its embedding, ...); any other model
has none, and whoever needs stages says so in one line.

Names are the trained parameters' as `tree_flatten(model.trainable_parameters())` gives them, so a
stage of a LoRA model names its adapters (and norms, if trained) and a frozen stage names none:
its frozen base stays inside the module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# mlx-lm modules (`mlx_lm.models.<name>`) whose Model.__call__ is embed_tokens -> each layer with
# create_attention_mask's mask -> norm -> lm_head / tied embedding (mistral loads as llama), and
# GPT-2's the same with learned positions added to the embedding.
DERIVED = ("llama", "qwen2", "qwen3", "gpt2")
# Each layout's (embedding, layer list, final norm) attributes of `model.model`.
_LAYOUT = {"decoder": ("embed_tokens", "layers", "norm"), "gpt2": ("wte", "h", "ln_f")}

Stages = list[tuple[list[str], Callable[[Any], Any]]]


def model_stages(model: Any) -> Stages | None:
    """The model's stages: its own `stages()`, else derived from the mlx-lm layout; None for a
    model with neither."""
    own = getattr(model, "stages", None)
    if callable(own):
        return own()
    if derivable(model):
        return _mlx_lm_stages(model)
    return None


def has_stages(model: Any) -> bool:
    """Whether `model_stages(model)` gives stages, without building them."""
    return callable(getattr(model, "stages", None)) or derivable(model)


def _layout(model: Any) -> str | None:
    """"decoder" or "gpt2" for an mlx-lm model of a `DERIVED` architecture laid out as it expects;
    None for any other. A subclass counts when it keeps the mlx-lm class's `__call__` (mlxdist's
    GPT-2 loader overrides only `sanitize`)."""
    base = next((c for c in type(model).__mro__ if c.__module__.startswith("mlx_lm.models.")), None)
    arch = base.__module__.rsplit(".", 1)[-1] if base is not None else None
    if arch not in DERIVED or type(model).__call__ is not base.__call__:
        return None
    layout = "gpt2" if arch == "gpt2" else "decoder"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in _LAYOUT[layout]):
        return None
    if layout == "gpt2":
        return layout if hasattr(inner, "wpe") else None
    tied = bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))
    return layout if hasattr(model, "lm_head") or tied else None


def derivable(model: Any) -> bool:
    """An mlx-lm model of a `DERIVED` architecture with its expected layout."""
    return _layout(model) is not None


def _parts(model: Any) -> list[tuple[list[tuple[str, Any]], Callable[[Any], Any]]]:
    """Each derived stage's modules (with their paths in the model) and its call."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    inner, layout = model.model, _layout(model)
    embed_name, layers_name, norm_name = _LAYOUT[layout]
    embed, norm = getattr(inner, embed_name), getattr(inner, norm_name)

    def block(layer: Any) -> Callable[[Any], Any]:
        window = getattr(inner, "sliding_window", None) if getattr(layer, "use_sliding", False) else None

        def run(h: Any) -> Any:
            return layer(h, create_attention_mask(h, None, window_size=window), cache=None)

        return run

    first = [(f"model.{embed_name}", embed)]
    if layout == "gpt2":
        first.append(("model.wpe", inner.wpe))

        def embedding(tokens: Any) -> Any:
            return embed(tokens) + inner.wpe(mx.arange(tokens.shape[1]))
    else:
        embedding = embed
    if hasattr(model, "lm_head"):
        head_modules = [(f"model.{norm_name}", norm), ("lm_head", model.lm_head)]

        def head(h: Any) -> Any:
            return model.lm_head(norm(h))
    else:
        head_modules = [(f"model.{norm_name}", norm), (f"model.{embed_name}", embed)]

        def head(h: Any) -> Any:
            return embed.as_linear(norm(h))

    blocks = [([(f"model.{layers_name}.{i}", layer)], block(layer))
              for i, layer in enumerate(getattr(inner, layers_name))]
    return [(first, embedding), *blocks, (head_modules, head)]


def _mlx_lm_stages(model: Any) -> Stages:
    from mlx.utils import tree_flatten

    def names(modules: list[tuple[str, Any]]) -> list[str]:
        return list(dict.fromkeys(f"{prefix}.{n}" for prefix, m in modules
                                  for n, _ in tree_flatten(m.trainable_parameters())))

    return [(names(modules), call) for modules, call in _parts(model)]


def _frozen(modules: list[tuple[str, Any]]) -> dict[str, tuple[int, Any]]:
    """The arrays of `modules` that do not train, by name: (elements as a float weight would
    count them: a quantized weight's packed words unpacked, its scales and biases none; array)."""
    from mlx.utils import tree_flatten

    out: dict[str, tuple[int, Any]] = {}
    for prefix, module in modules:
        trained = {n for n, _ in tree_flatten(module.trainable_parameters())}
        owners = dict(module.named_modules())
        for n, a in tree_flatten(module.parameters()):
            if n in trained:
                continue
            path, _, leaf = n.rpartition(".")
            bits = getattr(owners.get(path), "bits", None)
            elements = a.size if not bits else (a.size * 32 // bits if leaf == "weight" else 0)
            out[f"{prefix}.{n}"] = (elements, a)
    return out


def frozen_loads(model: Any) -> list[tuple[int, int]]:
    """Each stage's frozen base (LoRA's, QLoRA's quantized one): (elements, bytes) of the arrays
    it reads that do not train, a weight two stages read counted in both (both hold it); zeros
    for a model's own `stages()` (all that it reads trains) or a model without stages."""
    if not derivable(model) or callable(getattr(model, "stages", None)):
        n = len(model_stages(model) or [])
        return [(0, 0)] * n
    loads = []
    for modules, _ in _parts(model):
        frozen = _frozen(modules).values()
        loads.append((sum(e for e, _ in frozen), sum(a.nbytes for _, a in frozen)))
    return loads


def keep_frozen(model: Any, first: int, last: int) -> int:
    """Let go of the frozen arrays no stage in [first, last) reads (each replaced by an empty
    array: a pipeline rank holds only its run's part of the base); returns the bytes of frozen
    base it keeps. A model's own `stages()` read only trained weights: nothing to let go of."""
    if not derivable(model) or callable(getattr(model, "stages", None)):
        return 0
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    parts = _parts(model)
    kept: dict[str, tuple[int, Any]] = {}
    for modules, _ in parts[first:last]:
        kept |= _frozen(modules)
    gone = {n: a for modules, _ in parts for n, (_, a) in _frozen(modules).items() if n not in kept}
    if gone:
        model.update(tree_unflatten([(n, mx.zeros((0,), a.dtype)) for n, a in gone.items()]))
    return sum(a.nbytes for _, a in kept.values())
