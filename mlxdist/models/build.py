"""Which network a run trains, built for one engine: a built-in preset (from scratch) or a
pretrained model (`model.path`), optionally with adapters (`finetune`).

Engines take the result and never ask where it came from: they train `params` (the
trainable parameters, by name) through `module(tokens) -> logits`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..config import Config, ConfigError
from .presets import ModelArgs, human, param_count, resolve


@dataclass
class BuiltModel:
    module: Any  # framework module: module(tokens [b, T]) -> logits [b, T, vocab]
    params: dict[str, Any]  # trainable parameters by name: initial values (framework arrays)
    total_params: int
    vocab_size: int
    summary: str  # one banner line
    fingerprint: str | None = None  # of a pretrained base; every rank must train the same one
    base: Any = None  # models.pretrained.PretrainedInfo of that base
    # A task's own module: its whole state (buffers, frozen weights) is saved beside the trained
    # parameters so a checkpoint loads strictly into the user's class. The built-in LM's frozen
    # base is fingerprinted instead (`fingerprint`), not written into every checkpoint.
    whole_state: bool = False


def inspect_base(cfg: Config):
    """The pretrained base's facts (None for a preset), read before any framework loads: its
    vocabulary is the run's (`lm_vocab_size`), so data checks compare against the real one."""
    if not cfg.model.path:
        if cfg.finetune.method != "full":
            raise ConfigError(f"finetune.method={cfg.finetune.method}: adapters need a pretrained base; "
                              "set model.path to a Hugging Face directory or a .gguf file")
        if cfg.model.quantize:
            raise ConfigError("model.quantize: quantizes a pretrained base; set model.path too")
        return None
    from .pretrained import PretrainedError, inspect

    try:
        info = inspect(cfg.model.path)
    except PretrainedError as e:
        raise ConfigError(str(e)) from None
    if cfg.model.quantize and cfg.finetune.method == "full":
        raise ConfigError("model.quantize: a quantized base cannot be trained in full; "
                          "set finetune.method=lora (QLoRA) or drop model.quantize")
    if cfg.finetune.method != "full" and info.model_type == "gpt2":
        # Said before the run: the adapter is written at its end, in PEFT's layout.
        raise ConfigError(f"finetune.method={cfg.finetune.method} on {cfg.model.path}: a GPT-2 base's adapter "
                          "(PEFT's Conv1D layout, transformer.h.*) is not written yet; use finetune.method=full "
                          "or a Llama/Mistral/Qwen base")
    return info


def lm_vocab_size(cfg: Config, base: Any) -> int:
    """The built-in LM's vocabulary: a pretrained base's own (`inspect_base`), else `model.vocab_size`."""
    return base.vocab_size if base is not None else cfg.model.vocab_size


def _pretrained_summary(info, n_total: int, lora_banner: str | None) -> str:
    what = f"model: {info.model_type} from {info.path}" + (f" ({info.quantized_bits}-bit base)"
                                                         if info.quantized_bits else "")
    return f"{what}, {human(n_total)} parameters" + (f"; {lora_banner}" if lora_banner else ", all trained")


def _preset_summary(cfg: Config, a: ModelArgs) -> tuple[str, int]:
    n = param_count(a)
    return (f"model: preset {cfg.model.preset}, {human(n)} parameters (dim {a.dim}, {a.n_layers} layers, "
            f"{a.n_heads}/{a.n_kv_heads} heads)"), n


def build_mlx(cfg: Config, args: ModelArgs | None = None) -> BuiltModel:
    """`args` overrides the preset's shape (tests build odd sizes)."""
    from .mlx_model import Transformer, init_params

    if cfg.model.path:
        return _pretrained_mlx(cfg)
    a = args or resolve(cfg.model)
    summary, n = _preset_summary(cfg, a)
    return BuiltModel(Transformer(a), init_params(a, cfg.train.seed), n, a.vocab_size, summary)


def _pretrained_mlx(cfg: Config) -> BuiltModel:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .pretrained import PretrainedError, load_mlx

    try:
        model, info = load_mlx(cfg.model.path, cfg.model.quantize)
    except PretrainedError as e:
        raise ConfigError(str(e)) from None
    banner = None
    n_total = info.n_params
    if cfg.finetune.method != "full":
        from .lora import apply_lora

        mx.random.seed(cfg.train.seed)  # every rank starts from the same adapters
        lora = apply_lora(model, cfg.finetune)
        banner, n_total = lora.banner(), lora.n_total
    if cfg.model.grad_checkpoint_every:
        from mlx_lm.tuner.trainer import grad_checkpoint

        grad_checkpoint(model.layers[0])  # mlx-lm's: recompute every layer in the backward pass
    model.train()
    params = dict(tree_flatten(model.trainable_parameters()))
    return BuiltModel(model, params, n_total, info.vocab_size, _pretrained_summary(info, n_total, banner),
                      info.fingerprint, info)


def build_torch(cfg: Config, device: Any, args: ModelArgs | None = None) -> BuiltModel:
    import torch

    from .init import initial_weights
    from .torch_model import Transformer

    if cfg.model.path:
        return _pretrained_torch(cfg, device)
    a = args or resolve(cfg.model)
    summary, n = _preset_summary(cfg, a)
    module = Transformer(a).to(device)
    weights = initial_weights(a, cfg.train.seed, __import__("numpy"))
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.from_numpy(weights[name]))
    return BuiltModel(module, dict(module.named_parameters()), n, a.vocab_size, summary)


def _pretrained_torch(cfg: Config, device: Any) -> BuiltModel:
    import torch

    from .pretrained import PretrainedError, load_torch

    if cfg.model.quantize:
        raise ConfigError("model.quantize: quantized bases are an MLX-engine feature; drop it for --engine torch")
    try:
        module, info = load_torch(cfg.model.path, str(device))
    except PretrainedError as e:
        raise ConfigError(str(e)) from None
    banner = None
    n_total = info.n_params
    params = dict(module.named_parameters())
    if cfg.finetune.method != "full":
        from .lora_torch import apply_lora_torch, to_ours

        torch.manual_seed(cfg.train.seed)
        peft_model, lora = apply_lora_torch(module.hf, cfg.finetune)  # injects adapters in place
        object.__setattr__(module, "peft", peft_model)  # not a child: names stay the HF ones
        params = {to_ours(n): p for n, p in peft_model.named_parameters() if p.requires_grad}
        banner, n_total = lora.banner(), lora.n_total
    if cfg.model.grad_checkpoint_every:
        module.hf.gradient_checkpointing_enable()
    return BuiltModel(module, params, n_total, info.vocab_size, _pretrained_summary(info, n_total, banner),
                      info.fingerprint, info)


def built_from_task(obj: Any, adopt: Callable[[Any, Any, str], Adopted], device: Any, name: str) -> BuiltModel:
    """What a task's `build` returned, as the engine holds it: a BuiltModel passes through
    (the built-in LM); a user's module gives its trainable parameters by name, read by the
    engine's `adopt` (`adopt_mlx`, `adopt_torch`: the engine registry names which)."""
    if isinstance(obj, BuiltModel):
        return obj
    got = adopt(obj, device, name)
    obj, params, total, frozen, kept = got.module, got.params, got.total, got.frozen, got.kept
    if not params:
        raise ConfigError(f"task {name}: the model has no trainable parameters")
    trained = sum(math.prod(v.shape) for v in params.values())
    summary = f"model: {type(obj).__name__} from task {name}, {human(total)} parameters" + (
        ", all trained" if trained == total else f", {human(trained)} trained") + kept
    return BuiltModel(obj, params, total, 0, summary, _frozen_fingerprint(frozen), whole_state=True)


class Adopted(NamedTuple):
    """A task's module as an engine reads it: trained parameters by name, the total count,
    what does not train (fingerprinted), and the summary's note on it."""

    module: Any
    params: dict[str, Any]
    total: int
    frozen: dict[str, Any]
    kept: str


def adopt_mlx(obj: Any, device: Any, name: str) -> Adopted:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if not isinstance(obj, nn.Module):
        raise ConfigError(f"task {name}: build(ctx) returned {type(obj).__name__}, not an mlx.nn.Module "
                          "(the MLX engine trains MLX modules; use --engine torch for a torch.nn.Module)")
    obj.train()
    params = dict(tree_flatten(obj.trainable_parameters()))
    everything = dict(tree_flatten(obj.parameters()))
    total = sum(v.size for v in everything.values())
    frozen = {n: v.astype(mx.float32) for n, v in everything.items() if n not in params}  # numpy has no bf16
    kept = f"; {human(sum(v.size for v in frozen.values()))} not trained by gradients (running statistics, " \
           "frozen weights): equal on every rank, saved once they change" if frozen else ""
    return Adopted(obj, params, total, frozen, kept)


def adopt_torch(obj: Any, device: Any, name: str) -> Adopted:
    import torch

    if not isinstance(obj, torch.nn.Module):
        raise ConfigError(f"task {name}: build(ctx) returned {type(obj).__name__}, not a torch.nn.Module "
                          "(the torch engine trains torch modules; use --engine mlx for an mlx.nn.Module)")
    obj = obj.to(device)
    obj.train()
    params = {n: p for n, p in obj.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in obj.parameters())
    frozen = {n: p.detach().float().cpu() for n, p in obj.named_parameters() if not p.requires_grad}
    buffers = list(obj.state_dict().keys() - dict(obj.named_parameters()).keys())
    kept = f"; {len(buffers)} buffers ({human(sum(obj.get_buffer(n).numel() for n in buffers))} values): " \
           "saved, equal on every rank" if buffers else ""
    return Adopted(obj, params, total, frozen, kept)


def _frozen_fingerprint(frozen: dict[str, Any]) -> str | None:
    """What a task's frozen weights are (a base it loaded): every rank must hold the same,
    and a resume must find the ones it was trained on. None when everything trains."""
    if not frozen:
        return None
    import numpy as np

    from .weights import checksum

    return f"frozen weights {checksum(np.asarray(frozen[n], np.float32) for n in sorted(frozen)):08x}"
