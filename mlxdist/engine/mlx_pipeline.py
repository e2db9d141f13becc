"""One pipeline stage's math on the MLX engine (`dist.mode=pipeline`, `sync/pipeline.py`).

A pipeline cuts the model's stages (`models/stages.py`: the built-in LM's embedding, each block,
its head; an mlx-lm model's the same from its layer list) into contiguous runs, one per rank.
This module runs one such run and knows nothing of ranks: the strategy hands it the run's
weights (it holds them, not the engine), an input, and for backward the cotangent of the run's
output that came from the next stage; it hands back the output, the input's cotangent for the
previous stage, and adds the weights' gradients into its own sums.

Backward recomputes the run's forward from its kept input (`mx.vjp`), as ZeRO-3's staged step
does: a stage in flight keeps only its micro-batch's input, so 1F1B's activation memory is about
the stages in flight times one boundary activation. The last run also computes the task's loss
on the micro-batch (`loss(model, batch)` with the model standing in for what the stages
computed, as `engine/staged.py`'s `Output`); the first run's input is what the loss feeds the
model (`model_input`), integer tokens with no cotangent.

A LoRA (QLoRA) run's stages name only their adapters: the frozen base stays inside the module,
and each rank lets go of the base its run never reads (`keep_frozen`).

Weights are fp32 masters; with `model.dtype` bf16/fp16 a stage computes on a cast copy and the
cast's gradient brings fp32 gradients back, as the engine's own step does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from ..models.stages import keep_frozen
from ..tasks import Batch, sample_seeds_of, tree_map
from ..tasks.metrics import MetricSums, split_loss
from .base import check_scalar
from .staged import Output, PipelineRun, model_input

_NOTHING = mx.zeros((0,), mx.float32)


def _item(a: mx.array) -> float:
    return float(a.item())


def _pairs(totals: dict, counts: dict) -> dict:
    return {n: (t, counts.get(n)) for n, t in totals.items()}


class MlxStage(PipelineRun):
    """Stages [first, last) of the engine's model in MLX, run with weights handed in."""

    adapters = True

    def __init__(self, engine: Any, first: int, last: int):
        super().__init__(engine, first, last)
        self.engine = engine
        self.dtype = engine.compute_dtype
        self.frozen_bytes = keep_frozen(self.model, first, last)  # a LoRA run's base: this run's part only

    def _add(self, grads: list[mx.array]) -> None:
        self.grads = list(grads) if self.grads is None else [a + g for a, g in zip(self.grads, grads, strict=True)]
        mx.eval(self.grads)

    # -- the math -----------------------------------------------------------------------
    @staticmethod
    def data(batch: Batch) -> Any:
        """A batch's numpy data as MLX arrays (float64 as fp32, as the engine converts it)."""
        return tree_map(lambda a: mx.array(a.astype(np.float32) if a.dtype == np.float64 else a), batch.data)

    def input_of(self, batch: Batch) -> mx.array:
        """The first run's input: what the task's loss feeds the model."""
        return model_input(self.task_loss, self.model, self.data(batch), self.task_name)

    def _run(self, weights: list[mx.array], x: mx.array, each: Callable[[Any], None] | None = None) -> mx.array:
        if self.dtype != mx.float32:
            weights = [w.astype(self.dtype) for w in weights]
        self.model.update(tree_unflatten(list(zip(self.names, weights, strict=True))))
        if each is not None:
            each(x)
        for call in self.calls:
            x = call(x)
            if each is not None:
                each(x)
        return x

    @staticmethod
    def settle(x: mx.array) -> None:
        mx.eval(x)

    def engine_weights(self) -> tuple[list[mx.array], Callable[[], None]]:
        """The whole engine's own weights of this run (no copy); the engine binds its module
        from them at each call, so nothing to put back."""
        return [self.engine.params[n] for n in self.names], lambda: None

    def _let_go(self) -> None:
        """The module keeps no reference to the run's (cast) weights between calls."""
        self.model.update(tree_unflatten([(n, _NOTHING) for n in self.names]))

    def _loss(self, weights: list[mx.array], x: mx.array, data: Any) -> tuple[mx.array, dict, dict]:
        out = self._run(weights, x)  # in the compute dtype, as the engine's loss sees the model's output
        loss, metrics = split_loss(self.task_loss(Output(self.model, out), data), self.task_name)
        totals = {n: mx.array(t, mx.float32) for n, (t, _) in metrics.items()}
        counts = {n: mx.array(c, mx.float32) for n, (_, c) in metrics.items() if c is not None}
        return check_scalar(loss, self.task_name).astype(mx.float32), totals, counts

    def forward(self, weights: list[mx.array], x: mx.array, batch: Batch,
                each: Callable[[Any], None] | None = None) -> mx.array:
        """The run's output on input `x` (evaluated: it goes to the next stage); `each` sees
        the input once the weights are bound, then every stage's output."""
        with sample_seeds_of(batch):
            out = self._run(weights, x, each)
            mx.eval(out)
        self._let_go()
        return out

    def backward(self, weights: list[mx.array], x: mx.array, cotangent: mx.array, batch: Batch) -> mx.array | None:
        """The run recomputed from `x`, its weights' gradients for the output's `cotangent`
        added to the sums; returns the input's cotangent (None for integer input)."""
        floating = mx.issubdtype(x.dtype, mx.floating)
        n = len(weights)
        if not n and not floating:  # a frozen first run (a LoRA run's embedding): nothing to differentiate
            self._add([])
            return None

        def f(*args):
            return self._run(list(args[:n]), args[n] if floating else x)

        with sample_seeds_of(batch):
            _, grads = mx.vjp(f, [*weights, *([x] if floating else [])], [cotangent])
            mx.eval(grads)
        self._let_go()
        self._add(grads[:n])
        return grads[n] if floating else None

    def loss_backward(self, weights: list[mx.array], x: mx.array, batch: Batch) -> mx.array | None:
        """The last run: the task's summed loss of `batch` on input `x`, its weights' gradients
        added to the sums, loss and metrics too; returns the input's cotangent (None for
        integer input: a pipeline of one run)."""
        data = self.data(batch)
        floating = mx.issubdtype(x.dtype, mx.floating)
        argnums = (0, 1) if floating else 0
        with sample_seeds_of(batch):
            if weights or floating:
                (loss, totals, counts), grads = mx.value_and_grad(lambda w, h: self._loss(w, h, data),
                                                                  argnums=argnums)(weights, x)
            else:  # nothing here trains and nothing comes before: the loss alone
                (loss, totals, counts), grads = self._loss(weights, x, data), []
            mx.eval(loss, totals, counts, grads)
        self._let_go()
        wgrads, back = grads if floating else (grads, None)
        self._add(wgrads)
        self.loss_sum += loss.item()
        self.metrics.add(_pairs(totals, counts), _item)
        return back

    def forward_loss(self, weights: list[mx.array], x: mx.array, batch: Batch,
                     metrics: MetricSums | None) -> float:
        """Evaluation on the last run: the summed loss of `batch` (the model in eval mode, no
        gradients), the task's metrics added into `metrics`."""
        self.model.eval()
        try:
            with sample_seeds_of(batch):
                loss, totals, counts = self._loss(weights, x, self.data(batch))
                mx.eval(loss, totals, counts)
        finally:
            self.model.train()
            self._let_go()
        if metrics is not None:
            metrics.add(_pairs(totals, counts), _item)
        return loss.item()

    # -- arrays across the boundary ------------------------------------------------------
    @staticmethod
    def to_numpy(a: mx.array) -> np.ndarray:
        """An activation or cotangent as the flat buffer the transport sends (bf16 as its
        uint16 bits), and its shape and dtype name for the header."""
        if a.dtype == mx.bfloat16:
            return np.array(a.view(mx.uint16)).reshape(-1)
        return np.array(a).reshape(-1)

    @staticmethod
    def dtype_name(a: mx.array) -> str:
        return str(a.dtype).removeprefix("mlx.core.")

    @staticmethod
    def from_numpy(buf: np.ndarray, shape: tuple[int, ...], dtype: str) -> mx.array:
        """`to_numpy`'s inverse."""
        out = mx.array(buf).reshape(shape)
        return out.view(mx.bfloat16) if dtype == "bfloat16" else out

    def array(self, a: np.ndarray) -> mx.array:
        return mx.array(a)

    def numpy(self, a: mx.array) -> np.ndarray:
        return np.array(a)
