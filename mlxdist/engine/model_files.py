"""One engine's way of holding a model for `mlxdist.export --task`: its names, its arrays, how
they are read and written as safetensors and read back strictly, and how a user loads them
(the engine registry's `model_files`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class TaskExportError(ValueError):
    """One line, exit code 2."""


def few(names: list[str] | set[str], n: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())  # torch's message spans lines: one line, all of it
    return text if len(text) <= 300 else text[:297] + "..."


def check_keys(path: Path, wanted: set[str], saved: set[str], cls: str) -> None:
    keys_differ(path, cls, wanted - saved, saved - wanted)


def keys_differ(path: Path, cls: str, missing: set[str], unexpected: set[str]) -> None:
    if missing or unexpected:
        parts = ([f"missing keys {few(missing)}"] if missing else []) + \
                ([f"unexpected keys {few(unexpected)}"] if unexpected else [])
        raise TaskExportError(f"{path.name} does not load strictly into a fresh {cls}: {'; '.join(parts)}")


class TorchModelFiles:
    name = "torch"
    peft = True  # a trained PeftModel is exported as an adapter too
    kind = "torch state_dict(): parameters and buffers"
    how = {
        "model.safetensors": "model.load_state_dict(safetensors.torch.load_file('{p}'), strict=True)",
        "model_ema.safetensors": "model.load_state_dict(safetensors.torch.load_file('{p}'), strict=True)",
        "adapter": "peft.PeftModel.from_pretrained(base_model, '{p}')",
        "adapter_ema": "peft.PeftModel.from_pretrained(base_model, '{p}')",
    }

    def __init__(self):
        import torch

        self.torch = torch

    def seed(self, seed: int) -> None:
        self.torch.manual_seed(seed)

    def state(self, model) -> dict[str, Any]:
        return dict(model.state_dict(keep_vars=True))

    def trained(self, model) -> set[str]:
        return {n for n, p in model.named_parameters() if p.requires_grad}

    def shape(self, t) -> tuple[int, ...]:
        return tuple(t.shape)

    @staticmethod
    def flipped(name: str) -> bool:
        """The torch engine stores a trained `*.lora_a` / `*.lora_b` transposed (mlx-lm's layout)."""
        from .torch_engine import flipped

        return flipped(name)

    def load(self, model, arrays: dict[str, np.ndarray], trained: set[str]) -> None:
        tensors = self.state(model)
        with self.torch.no_grad():
            for n, a in arrays.items():
                a = np.ascontiguousarray(a.T) if n in trained and self.flipped(n) else np.asarray(a)
                tensors[n].copy_(self.torch.from_numpy(np.array(a)))  # copy_ casts to the tensor's dtype

    def write(self, model, path: Path) -> None:
        from safetensors.torch import save_file

        # Clones: tied weights share storage, which safetensors refuses; each name gets its own copy
        # so that `load_state_dict(strict=True)` finds every key it asks for.
        tensors = {n: t.detach().to("cpu").clone(memory_format=self.torch.contiguous_format)
                   for n, t in model.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": "pt"})

    def load_strict(self, model, path: Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        saved = load_file(str(path))
        cls = type(model).__name__
        check_keys(path, set(self.state(model)), set(saved), cls)
        try:
            found = model.load_state_dict(saved, strict=False)  # the keys it takes, to name those it does not
            keys_differ(path, cls, set(getattr(found, "missing_keys", ())), set(getattr(found, "unexpected_keys", ())))
            model.load_state_dict(saved, strict=True)  # as the user's code will
        except RuntimeError as e:
            raise TaskExportError(f"{path.name} does not load strictly into a fresh {type(model).__name__}: "
                                  f"{one_line(e)}") from None
        return saved

    def differs(self, model, saved: dict[str, Any]) -> list[str]:
        got = model.state_dict()

        def same(a, b) -> bool:  # exactly, a NaN where the other has one included
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.is_floating_point():
                return self.torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
            return self.torch.equal(a, b)

        return [n for n, t in saved.items() if not same(got[n].cpu(), t)]


class MLXModelFiles:
    name = "mlx"
    peft = False
    kind = "MLX tree_flatten(model.parameters()): parameters, frozen ones and BatchNorm statistics included"
    how = {
        "model.safetensors": "model.load_weights('{p}', strict=True)",
        "model_ema.safetensors": "model.load_weights('{p}', strict=True)",
    }

    def __init__(self):
        import mlx.core as mx

        self.mx = mx
        mx.set_default_device(mx.cpu)

    def seed(self, seed: int) -> None:
        self.mx.random.seed(seed)

    def state(self, model) -> dict[str, Any]:
        from mlx.utils import tree_flatten

        return dict(tree_flatten(model.parameters()))

    def trained(self, model) -> set[str]:
        from mlx.utils import tree_flatten

        return {n for n, _ in tree_flatten(model.trainable_parameters())}

    def shape(self, a) -> tuple[int, ...]:
        return tuple(a.shape)

    @staticmethod
    def flipped(name: str) -> bool:
        return False

    def load(self, model, arrays: dict[str, np.ndarray], trained: set[str]) -> None:
        from mlx.utils import tree_unflatten

        current = self.state(model)
        model.update(tree_unflatten([(n, self.mx.array(np.asarray(a)).astype(current[n].dtype))
                                     for n, a in arrays.items()]))
        self.mx.eval(model.parameters())

    def write(self, model, path: Path) -> None:
        self.mx.save_safetensors(str(path), self.state(model), metadata={"format": "mlx"})

    def load_strict(self, model, path: Path) -> dict[str, Any]:
        saved = self.mx.load(str(path))
        check_keys(path, set(self.state(model)), set(saved), type(model).__name__)
        try:
            model.load_weights(str(path), strict=True)
        except ValueError as e:
            raise TaskExportError(f"{path.name} does not load strictly into a fresh {type(model).__name__}: "
                                  f"{one_line(e)}") from None
        return saved

    def differs(self, model, saved: dict[str, Any]) -> list[str]:
        got = self.state(model)
        return [n for n, a in saved.items()
                if got[n].dtype != a.dtype or not bool(self.mx.array_equal(got[n], a, equal_nan=True).item())]
