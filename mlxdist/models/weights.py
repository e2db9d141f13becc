"""Strict weight loading for any model, MLX or torch, that says in one line what does not fit.

MLX's `load_weights(strict=True)` lists every missing parameter on a line of its own, and
torch's `load_state_dict` every key: a checkpoint of another model size (a forgotten
`task.args.model`, say) printed dozens of names before the one hint that matters. Here the
names and shapes are checked first and a mismatch is one line: how many parameters are
missing, unexpected or of another shape, a few of each, and the caller's hint.

    from mlxdist.models.weights import load_mlx
    load_mlx(model, loaded.weights, what=f"init_from {loaded.path}", hint="task.args.model must be ...")

Neither framework is imported until a loader is called (MLX must come after mlxdist's BLAS
set-up on Linux).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

EXAMPLES = 2  # names shown per kind of mismatch


def checksum(arrays: Iterable[np.ndarray]) -> int:
    """Bit-exact fingerprint of a set of arrays: equal on all ranks iff weights agree. Here,
    beside the loaders, because models fingerprint their frozen weights with it and the
    engines their trained ones, and model code does not import the engines."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
    return crc


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, tuple | list) else tuple(v.shape)


def weights_mismatch(expected: Mapping[str, Any], weights: Mapping[str, Any], what: str = "checkpoint",
                     hint: str | None = None, examples: int = EXAMPLES) -> str | None:
    """None when `weights` has exactly `expected`'s names with the same shapes (values: arrays
    or shape tuples); otherwise one line: the counts of missing and unexpected parameters
    and of those with another shape, up to `examples` names of each, then `hint`."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    other = sorted(n for n in set(expected) & set(weights) if _shape(weights[n]) != _shape(expected[n]))
    if not (missing or extra or other):
        return None

    def some(names: list[str], show: Callable[[str], str] = str) -> str:
        if not names:
            return ""
        more = f", ... {len(names) - examples} more" if len(names) > examples else ""
        return " (" + ", ".join(show(n) for n in names[:examples]) + more + ")"

    parts = [f"{len(missing)} missing{some(missing)}", f"{len(extra)} unexpected{some(extra)}"]
    if other:
        parts.append(f"{len(other)} of another shape"
                     f"{some(other, lambda n: f'{n} {_shape(weights[n])} not {_shape(expected[n])}')}")
    line = f"{what} does not fit the model's {len(expected)} parameters: {', '.join(parts)}"
    return " ".join((f"{line}; {hint}" if hint else line).split())  # one line, whatever a name or hint holds


def load_mlx(model, weights: Mapping[str, Any], what: str = "checkpoint", hint: str | None = None) -> None:
    """Set every parameter of the MLX `model` from `weights` (name -> numpy or MLX array, the
    names of `tree_flatten(model.parameters())`); raises ValueError, one line, on a mismatch."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    problem = weights_mismatch({k: v.shape for k, v in tree_flatten(model.parameters())}, weights, what, hint)
    if problem:
        raise ValueError(problem)
    model.load_weights([(k, v if isinstance(v, mx.array) else mx.array(v)) for k, v in weights.items()],
                       strict=True)


def load_torch(module, weights: Mapping[str, Any], what: str = "checkpoint", hint: str | None = None) -> None:
    """`module.load_state_dict(weights, strict=True)` (values: numpy arrays or tensors), with a
    one-line ValueError on a mismatch instead of torch's list of every key."""
    import numpy as np
    import torch

    problem = weights_mismatch({k: v.shape for k, v in module.state_dict().items()}, weights, what, hint)
    if problem:
        raise ValueError(problem)
    module.load_state_dict({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))
                            for k, v in weights.items()}, strict=True)
