"""One pipeline stage's math on the torch engine (`dist.mode=pipeline`, `sync/pipeline.py`):
`engine/mlx_pipeline.py`'s `MlxStage` in torch, so one strategy serves both engines.

The run's weights are the strategy's (checkpoint layout, fp32 on the engine's device); while a
call runs they are the parameters' storage, and the parameters keep none between calls, as the
engine's ZeRO-3 path does. Forward runs without a graph; backward recomputes the run from its
kept input and takes `torch.autograd.grad` for the output's cotangent, so a stage in flight
keeps one boundary activation per micro-batch. `model.dtype` bf16/fp16 runs under autocast with
fp32 masters, as the engine's own step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..tasks import Batch, sample_seeds_of, tree_map
from ..tasks.metrics import MetricSums, split_loss
from .base import check_scalar
from .staged import Output, PipelineRun, model_input
from .torch_engine import _float, flipped


class TorchStage(PipelineRun):
    """Stages [first, last) of the engine's model in torch, run with weights handed in."""

    def __init__(self, engine: Any, first: int, last: int):
        super().__init__(engine, first, last)
        self.engine = engine
        self._params = [engine._by_name[n] for n in self.names]

    def _add(self, grads: list[torch.Tensor]) -> None:
        grads = [g.T if flipped(n) else g for n, g in zip(self.names, grads, strict=True)]
        self.grads = grads if self.grads is None else [a + g for a, g in zip(self.grads, grads, strict=True)]

    # -- the math -----------------------------------------------------------------------
    def data(self, batch: Batch) -> Any:
        return tree_map(self.engine._to_device, batch.data)

    def input_of(self, batch: Batch) -> torch.Tensor:
        """The first run's input: what the task's loss feeds the model."""
        return model_input(self.task_loss, self.model, self.data(batch), self.task_name)

    def _run(self, weights: list[torch.Tensor], x: torch.Tensor,
             each: Callable[[Any], None] | None = None) -> torch.Tensor:
        for n, p, w in zip(self.names, self._params, weights, strict=True):
            p.data = w.T if flipped(n) else w
        with self.engine._autocast():
            if each is not None:
                each(x)
            for call in self.calls:
                x = call(x)
                if each is not None:
                    each(x)
        return x

    def engine_weights(self) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """The whole engine's own weights of this run in checkpoint layout (views, no copy), and
        how to give the parameters their storage back after a call let go of it."""
        saved = [p.data for p in self._params]

        def restore() -> None:
            for p, d in zip(self._params, saved, strict=True):
                p.data = d

        return [d.T if flipped(n) else d for n, d in zip(self.names, saved, strict=True)], restore

    def settle(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor):
            return
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        elif x.device.type == "mps":
            torch.mps.synchronize()

    def _let_go(self) -> None:
        for p in self._params:
            p.data = self.engine._nothing

    def _grad(self, out: torch.Tensor, x: torch.Tensor | None, back: torch.Tensor | None) -> list[torch.Tensor]:
        wrt = self._params + ([x] if x is not None else [])
        got = torch.autograd.grad(out, wrt, grad_outputs=back, allow_unused=True)
        return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt, strict=True)]

    def forward(self, weights: list[torch.Tensor], x: torch.Tensor, batch: Batch,
                each: Callable[[Any], None] | None = None) -> torch.Tensor:
        """The run's output on input `x` (it goes to the next stage); `each` sees the input
        once the weights are bound, then every stage's output."""
        try:
            with sample_seeds_of(batch), torch.no_grad():
                return self._run(weights, x, each)
        finally:
            self._let_go()

    def backward(self, weights: list[torch.Tensor], x: torch.Tensor, cotangent: torch.Tensor,
                 batch: Batch) -> torch.Tensor | None:
        """The run recomputed from `x`, its weights' gradients for the output's `cotangent`
        added to the sums; returns the input's cotangent (None for integer input)."""
        floating = x.is_floating_point()
        try:
            with sample_seeds_of(batch), torch.enable_grad():
                x = x.detach().requires_grad_(floating)
                out = self._run(weights, x)
                grads = self._grad(out, x if floating else None, cotangent.to(out.dtype))
        finally:
            self._let_go()
        n = len(self._params)
        self._add(grads[:n])
        return grads[n] if floating else None

    def loss_backward(self, weights: list[torch.Tensor], x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """The last run: the task's summed loss of `batch` on input `x`, its weights' gradients
        added to the sums, loss and metrics too; returns the input's cotangent (None for
        integer input: a pipeline of one run)."""
        data = self.data(batch)
        floating = x.is_floating_point()
        try:
            with sample_seeds_of(batch), torch.enable_grad():
                x = x.detach().requires_grad_(floating)
                loss, found = self._loss(weights, x, data)
                grads = self._grad(loss, x if floating else None, None)
        finally:
            self._let_go()
        n = len(self._params)
        self._add(grads[:n])
        self.loss_sum += float(loss.detach())
        if found:
            self.metrics.add(found, _float)
        return grads[n] if floating else None

    def _loss(self, weights: list[torch.Tensor], x: torch.Tensor, data: Any) -> tuple[torch.Tensor, dict]:
        out = self._run(weights, x)
        with self.engine._autocast():
            loss, found = split_loss(self.task_loss(Output(self.model, out), data), self.task_name)
        return check_scalar(loss, self.task_name).float(), found

    @torch.no_grad()
    def forward_loss(self, weights: list[torch.Tensor], x: torch.Tensor, batch: Batch,
                     metrics: MetricSums | None) -> float:
        """Evaluation on the last run: the summed loss of `batch` (the model in eval mode, no
        gradients), the task's metrics added into `metrics`."""
        self.model.eval()
        try:
            with sample_seeds_of(batch):
                loss, found = self._loss(weights, x, self.data(batch))
        finally:
            self.model.train()
            self._let_go()
        if metrics is not None and found:
            metrics.add(found, _float)
        return float(loss)

    # -- arrays across the boundary ------------------------------------------------------
    @staticmethod
    def to_numpy(a: torch.Tensor) -> np.ndarray:
        """An activation or cotangent as the flat buffer the transport sends (bf16 as its
        16-bit pattern, which numpy has no type for)."""
        a = a.detach()
        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1)
        return a.cpu().numpy().reshape(-1)

    @staticmethod
    def dtype_name(a: torch.Tensor) -> str:
        return str(a.dtype).removeprefix("torch.")

    def from_numpy(self, buf: np.ndarray, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """`to_numpy`'s inverse, on the engine's device."""
        if dtype == "bfloat16":
            t = torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(buf)
        return t.reshape(shape).to(self.engine.dev)

    def array(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.engine.dev)

    def numpy(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().cpu().numpy()
