"""Parameters' gradients as the torch gradient sum reads them (`TorchGradSync.arm`): their
sizes, the order backward finishes them, each one (zeros where this rank's batches did not
reach it) and a call as each becomes final. The torch engine and `mlxdist.torch`'s
DistributedOptimizer both hand these to the same sum."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class ParamGradients:
    def __init__(self, params: Sequence[torch.Tensor], model: torch.nn.Module):
        self.params, self.model = list(params), model
        self._hooked = False
        self._on_ready: Callable[[int], None] | None = None

    def backward_order(self) -> list[int]:
        """Parameter indices roughly as backward finishes them: the reverse of the modules'
        registration order, as DDP assumes."""
        index = {id(p): i for i, p in enumerate(self.params)}
        order = [index[id(p)] for p in self.model.parameters() if id(p) in index][::-1]
        return order + [i for i in range(len(self.params)) if i not in set(order)]

    def gradient_sizes(self) -> list[int]:
        return [p.numel() for p in self.params]

    def gradient(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def gradients(self) -> list[torch.Tensor]:
        return [self.gradient(i) for i in range(len(self.params))]

    def on_gradient_ready(self, callback: Callable[[int], None] | None) -> None:
        """`callback(i)` as soon as backward has finished parameter i's gradient, until it is
        set to None."""
        if not self._hooked:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_ready and self._on_ready(i))
            self._hooked = True
        self._on_ready = callback
