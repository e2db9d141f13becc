"""A model run stage by stage (`dist.shard=weights`, `sync/fully_sharded.py`), framework-free.

A model with stages (`models/stages.py`: its own `stages()` -> [(parameter names, callable), ...],
or derived from an mlx-lm model's layer list; the calls, composed, are its forward pass) can run
one stage's weights at a time. The task's loss still calls the model as a whole, so the engines
hand it stand-ins: one that only records what the loss feeds the model (the first stage's
input), one whose call returns what the last stage computed, and one whose call runs the stages
itself (evaluation: forward only). Each passes any other attribute through to the model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..models.stages import frozen_loads, model_stages
from ..tasks import Batch, TaskError
from ..tasks.metrics import MetricSums
from .base import LocalGradients, Piece
from .common import decays


class _Input(Exception):
    def __init__(self, x: Any):
        self.x = x


class _StandIn:
    def __init__(self, model: Any):
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @staticmethod
    def _one_input(args: tuple, kwargs: dict) -> None:
        if args or kwargs:
            raise TaskError("dist.shard=weights: the task's loss calls the model with more than one input; a "
                            "staged run feeds the first stage one array")


class _Recorder(_StandIn):
    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self._one_input(args, kwargs)
        raise _Input(x)


class Output(_StandIn):
    """The model as the loss sees it when the last stage's output is already computed."""

    def __init__(self, model: Any, out: Any):
        super().__init__(model)
        self._out = out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._out


class Staged(_StandIn):
    """The model as the loss sees it, each stage run by `run(i, names, call, x)`."""

    def __init__(self, model: Any, run: Callable[[int, list[str], Callable, Any], Any]):
        super().__init__(model)
        self._run = run

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self._one_input(args, kwargs)
        for i, (names, call) in enumerate(model_stages(self._model)):
            x = self._run(i, names, call, x)
        return x


def model_input(loss: Callable, model: Any, data: Any, task: str) -> Any:
    """What the task's loss feeds the model (the first stage's input), without computing."""
    try:
        loss(_Recorder(model), data)
    except _Input as got:
        return got.x
    raise TaskError(f"task {task}: dist.shard=weights runs the model stage by stage, but its loss never calls the "
                    "model; use dist.shard=gradients")


class ReleasesWeights:
    """What an engine adds for ZeRO-3: weights that may be released (`release_weights`), after
    which reading them is an error, not zeros."""

    released: bool = False

    def _whole(self, what: str) -> None:
        if self.released:
            raise RuntimeError(f"{what}: the weights are in shards (dist.shard=weights); the strategy gathers "
                               "them first (Strategy.whole_model)")


class StagedShardOps:
    """`engine.base.StagedOps`' part that is the same for both engines: it hands on to the
    engine (`ReleasesWeights` and its `staged_step`, `staged_eval`, `take_totals`, `release_weights`)."""

    engine: Any
    shapes: list[tuple[int, ...]]
    array: Callable[[np.ndarray], Any]
    _masks: dict[tuple[Piece, ...], Any]  # each subclass's __init__ starts it empty
    _mixed: tuple[Piece, ...] | None = None  # the one kept mask that is not a single flag

    def _decay(self, pieces: tuple[Piece, ...]) -> Any:
        """The decay mask of `pieces` on the device. A chunk inside parameters that all decay (or
        none does) gets one flag, kept; a chunk that mixes them a byte per element, only the
        latest kept (keeping all would add a byte per shard element beside the moments)."""
        masks = self._masks
        if pieces not in masks:
            flags = {decays(self.shapes[pc.index]) for pc in pieces}
            if len(flags) > 1:
                mask = np.zeros(sum(pc.end - pc.start for pc in pieces), bool)
                for pc in pieces:
                    mask[pc.at:pc.at + pc.end - pc.start] = decays(self.shapes[pc.index])
                masks.pop(self._mixed, None)
                self._mixed = pieces
            else:
                mask = np.asarray(flags.pop() if flags else False)
            masks[pieces] = self.array(mask)
        return masks[pieces]

    def stage_names(self) -> list[list[str]] | None:
        """Each stage's parameters in `model.stages()`' order, or None for a model without stages."""
        if not self.engine.capabilities.staged:
            return None
        return [list(names) for names, _ in model_stages(self.engine.model)]

    def pipeline_run(self, first: int, last: int) -> PipelineRun:
        """The math of a pipeline rank's run of stages [first, last), from the engine's registry
        entry (`EngineSpec.pipeline`)."""
        from .registry import ENGINES

        return ENGINES[self.engine.name].load("pipeline")(self.engine, first, last)

    def stage_frozen(self) -> list[tuple[int, int]]:
        """Each stage's frozen base (a LoRA run's): (elements, bytes) it reads that do not train."""
        return frozen_loads(self.engine.model)

    def staged(self, batch: Batch, fetch: Callable, hand: Callable) -> None:
        self.engine.staged_step(batch, fetch, hand)

    def staged_eval(self, batch: Batch, fetch: Callable, metrics) -> tuple[float, int]:
        return self.engine.staged_eval(batch, fetch, metrics)

    def totals(self) -> LocalGradients:
        """The step's loss, units and metrics (its gradients went to `hand`)."""
        return self.engine.take_totals()

    def release(self) -> None:
        self.engine.release_weights()

    @property
    def released(self) -> bool:
        return self.engine.released


class PipelineRun:
    """What a pipeline rank's run of stages [first, last) keeps whatever the framework
    (`mlx_pipeline.MlxStage`, `torch_pipeline.TorchStage` add the math: input_of, forward,
    backward, loss_backward, settle, engine_weights): the run's calls, the parameters it reads
    (`names`: once each, in order of first use) and the sums of the step's micro-batches,
    handed over by `take`."""

    frozen_bytes: int = 0  # of a frozen base (a LoRA run's) this run holds: its own part only
    adapters: bool = False  # runs a LoRA/QLoRA run's stages over a frozen base it partly lets go of

    def __init__(self, engine: Any, first: int, last: int):
        self.model = engine.model
        self.task_loss, self.task_name = engine.task_loss, engine.task_name
        stages = model_stages(self.model)
        self.count_stages = len(stages)
        self.first, self.last = first, last
        self.is_first, self.is_last = first == 0, last == len(stages)
        self.calls = [call for _, call in stages[first:last]]
        self.names: list[str] = []
        for names, _ in stages[first:last]:
            self.names += [n for n in names if n not in self.names]
        self._reset()

    def _reset(self) -> None:
        self.grads: list | None = None
        self.loss_sum = 0.0
        self.metrics = MetricSums()

    def take(self) -> tuple[list | None, float, MetricSums]:
        """The gradients of the summed loss (None: no micro-batch ran here), loss and metrics
        (the last run's) since the last take; the sums start afresh."""
        out = (self.grads, self.loss_sum, self.metrics)
        self._reset()
        return out

    def forward_eval(self, weights: list, x: Any, batch: Batch) -> Any:
        """`forward` with the model in eval mode (evaluation's earlier runs)."""
        self.model.eval()
        try:
            return self.forward(weights, x, batch)
        finally:
            self.model.train()

    def stage_seconds(self, weights: list, batch: Batch) -> list[float]:
        """Each of the run's stages' seconds in a forward pass of `batch` (what the cut weighs
        with `dist.measure_stages`: an embedding's lookup costs next to nothing, a head's
        vocabulary matmul much more than its parameters say)."""
        marks: list[float] = []

        def each(out: Any) -> None:  # the input once the weights are bound, then each stage's output
            self.settle(out)
            marks.append(time.perf_counter())

        self.forward(weights, self.input_of(batch), batch, each)
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    @staticmethod
    def wire_dtype(dtype: str) -> np.dtype:
        """The numpy dtype `to_numpy` gives for an array of dtype `dtype` (bf16 as its 16 bits)."""
        return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def time_stages(run: PipelineRun, batch, repeats: int = 3) -> list[float]:
    """The median seconds of each stage of `run` (a run of all the model's stages, made as the
    pipeline makes its own: `StagedOps.pipeline_run`) in a forward pass of `batch` (eval mode: no
    dropout drawn, no statistics moved), on the whole engine's own weights (at start, no copy: a
    model the pipeline exists for may barely fit once)."""
    weights, restore = run.engine_weights()
    run.model.eval()
    try:
        run.stage_seconds(weights, batch)  # warm-up: compiles, first allocations
        times = [run.stage_seconds(weights, batch) for _ in range(repeats)]
    finally:
        run.model.train()
        restore()
    return [statistics.median(t[i] for t in times) for i in range(len(run.calls))]
