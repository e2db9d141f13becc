"""What a model holds beyond its trained parameters (BatchNorm's running statistics, other
buffers, frozen weights a task writes), and which of it changed since the ranks last agreed.

One tracker per framework, shared by the trainer's engines and the your-loop APIs, so that
`sync.model_state.StateSync` keeps the same state equal across ranks on every way in. A
tracker knows no ranks: it answers `has_state`, `changed_state`, `get_state`, `set_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .common import check_weights


class TorchModelState:
    """`source()` gives the state tensors by name (the model's state dict less what trains)."""

    def __init__(self, model: Any, source: Callable[[], dict[str, Any]]):
        self.model, self.source = model, source
        self.touched: set[str] = set()
        self.mark_state()

    def get_state(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        tensors = self.source()
        return {n: state_numpy(tensors[n]) for n in (self.state_names() if names is None else names)}

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        import torch

        tensors = self.source()
        check_weights({n: tuple(t.shape) for n, t in tensors.items() if n in state}, state)
        with torch.no_grad():
            for n, value in state.items():
                tensors[n].copy_(torch.from_numpy(np.asarray(value)).to(tensors[n].dtype))
        self.touched |= set(state)
        self.mark_state()

    def state_names(self) -> list[str]:
        """The entries saved and kept equal: every buffer, and frozen weights that ever
        changed (a frozen base that never does is fingerprinted, not copied)."""
        buffers = {n for n, _ in self.model.named_buffers()} & set(self.source())
        self.changed_state()
        return sorted(buffers | self.touched)

    def has_state(self) -> bool:
        return bool(self.source())

    def changed_state(self) -> list[str]:
        """Names of state entries written since `mark_state`. An in-place write from Python
        bumps a tensor's version; BatchNorm's kernel updates its running statistics without
        one, so buffers (small) are compared with a copy of their agreed values."""
        import torch

        changed = [n for n, t in self.source().items()
                   if self._marks.get(n) != (t._version, t.data_ptr())
                   or (n in self._agreed and not torch.equal(t, self._agreed[n]))]
        self.touched |= set(changed)
        return changed

    def mark_state(self) -> None:
        tensors = self.source()
        self._marks = {n: (t._version, t.data_ptr()) for n, t in tensors.items()}
        self._agreed = {n: t.detach().clone() for n, t in self.model.named_buffers() if n in tensors}


class MlxModelState:
    """`source()` gives the state arrays by name (the model's parameters less what trains).
    `unmarked`: names that count as changed from the start (a tracker made after a step
    already wrote them)."""

    def __init__(self, model: Any, source: Callable[[], dict[str, Any]], unmarked: Iterable[str] = ()):
        self.model, self.source = model, source
        self.touched: set[str] = set()
        self.mark_state()
        for n in unmarked:
            self._marks.pop(n, None)

    def get_state(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        import mlx.core as mx

        arrays = self.source()
        return {n: np.array(arrays[n].astype(mx.float32) if arrays[n].dtype == mx.bfloat16 else arrays[n])
                for n in (self.state_names() if names is None else names)}

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        import mlx.core as mx
        from mlx.utils import tree_unflatten

        arrays = self.source()
        check_weights({n: tuple(a.shape) for n, a in arrays.items() if n in state}, state)
        self.model.update(tree_unflatten([(n, mx.array(np.asarray(v)).astype(arrays[n].dtype))
                                          for n, v in state.items()]))
        mx.eval(self.model.parameters())
        self.touched |= set(state)
        self.mark_state()

    def state_names(self) -> list[str]:
        """The entries saved and kept equal: those that ever changed (BatchNorm's statistics
        after a step). A frozen base that never changes is fingerprinted, not copied."""
        self.changed_state()
        return sorted(self.touched)

    def has_state(self) -> bool:
        return bool(self.source())

    def changed_state(self) -> list[str]:
        """Names whose array was replaced since `mark_state`: MLX arrays are immutable, so a
        module that updates its state (BatchNorm in training) puts a new one in its place."""
        changed = [n for n, a in self.source().items() if self._marks.get(n) is not a]
        self.touched |= set(changed)
        return changed

    def mark_state(self) -> None:
        self._marks = self.source()  # holding them keeps an id from being reused


def state_numpy(t: Any) -> np.ndarray:
    """A copy in the tensor's own dtype (ints stay ints); bf16, which numpy lacks, as fp32."""
    import torch

    t = t.detach().to("cpu")
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
