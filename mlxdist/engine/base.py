"""The contract between the training loop and an engine (MLX or PyTorch).

An engine does the math of one rank and nothing else: forward/backward of a micro-batch,
an update from given gradients, weights and optimizer state in and out, memory readings.
It knows no ranks: the sync strategy (`sync/`) takes its local gradients, exchanges them
and hands back the sums. Weights and state cross as numpy or plain Python, so data,
checkpoints and controllers never import a framework. Gradients are of the *summed* loss:
the engine divides by the cluster's unit count once, which is what makes unequal per-rank
batches (and masked prompts) exact.

What every engine has (`Engine`, the core):

    name, model, device            which engine, the task's module, where it computes
    capabilities                   `Capabilities`: what it trains and can do, filled once when built
    optimizer, trained_names       mlxdist's optimizer; the trained parameters, in gradient order
    micro_step, take_gradients,    the step: forward/backward, this rank's gradients out, the
    apply_gradients,               update from the (summed) gradients, forgetting a half step,
    discard_gradients, eval_loss   a held-out loss
    get_weights, set_weights,      state in and out as numpy (checkpoint layout), and the
    get_optimizer_state,           fingerprint ranks compare; `gradient_sizes` for the plans
    set_optimizer_state,
    weight_checksum, gradient_sizes
    model_state                    `ModelState`: buffers and other state beside the trained weights
    memory                         `Memory`: readings, peak reset, cache release
    describe()                     one banner line

What only some callers ask for, each an interface of its own that the engine declares in
`Capabilities` (a caller reads the flag, never probes the engine's attributes):

    capabilities.generation  `Generation`: logits, sample (`mlxdist.generate`)
    capabilities.shards      `Sharding`: shard_ops() -> `ShardOps` (ZeRO-1/2, `sync/sharded.py`)
    capabilities.staged      ...and shard_ops() is a `StagedOps` that runs the model a stage at a
                             time (ZeRO-3, `sync/fully_sharded.py`)
    capabilities.adapters    `Adapters`: save_adapter (a fine-tune's adapter, written at the end)
    capabilities.overlap     `Overlap`: gradients, a `GradientFeed` the gradient sum reads while
                             backward runs (`sync/torch_grad.py`)

`tests/test_engine_contract.py` checks both engines against this: the core members, and each
flag against the interface the engine offers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..optim import Optimizer
from ..tasks import Batch, TaskError
from ..tasks.metrics import MetricSums, means
from .memory import MemoryReading


@dataclass
class LocalGradients:
    """What one rank accumulated since the last update: gradients of its summed loss (engine
    arrays, in parameter-name order), that sum, and the units it covers."""

    arrays: list
    loss_sum: float
    count: int
    metrics: MetricSums = field(default_factory=MetricSums)  # the task's metrics, summed here


@dataclass
class StepStats:
    loss_sum: float  # summed token cross-entropy over the whole cluster's step
    tokens: int  # trained tokens the loss was summed over (cluster-wide)
    grad_norm: float  # global L2 norm of the averaged gradient, before clipping
    skipped: bool  # True when loss or gradients were non-finite and no update was made
    sync_seconds: float = 0.0
    sync_bytes: int = 0
    sync_overlapped: int = 0  # gradient buckets sent while backward still ran
    local: bool = False  # loss, tokens and norm are this rank's own (no exchange this step)
    why_skipped: str = "non-finite loss/gradients"
    metrics: dict[str, float] = field(default_factory=dict)  # the task's, per unit (or per its count)


    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)


@dataclass(frozen=True)
class Capabilities:
    """What an engine trains and can do, and how it runs, filled once when it is built: the one
    record strategies and the loop read to decide (a sharded mode refuses a task's own optimizer
    or a scaled loss; ZeRO-3 needs stages; a resume checks the base), so no caller probes an
    engine's attributes. The flags below `notes` say which optional interfaces it offers."""

    task_name: str  # the task it trains, for messages
    own_optimizer: bool = False  # the task's `Task.optimizer` updates the weights, not mlxdist's AdamW
    loss_scaling: bool = False  # gradients are of a scaled loss (torch's fp16 GradScaler), unscaled in its update
    compiled: bool = False  # the model's forward runs compiled (torch.compile): hooks inside it break the graph
    staged: bool = False  # the model has `stages()`, so shard_ops() can run it a stage at a time (`StagedOps`, ZeRO-3)
    notes: tuple[str, ...] = ()  # lines for the run's banner (a slow autocast, parameters no optimizer updates)
    model_summary: str = ""  # banner line: which model, how many (trainable) parameters
    base_fingerprint: str | None = None  # of a pretrained base (every rank must train the same one)
    base: Any = None  # that base's facts (`models.pretrained.PretrainedInfo`: path, files), None without one
    # -- the optional interfaces it offers ------------------------------------------------
    generation: bool = False  # `Generation`: logits, sample
    shards: bool = False  # `Sharding`: shard_ops() (ZeRO-1/2; with `staged`, ZeRO-3)
    adapters: bool = False  # `Adapters`: save_adapter
    overlap: bool = False  # `Overlap`: `gradients`, read as backward finishes each one


class Piece(NamedTuple):
    """Elements [start, end) of trained parameter `index`, flattened in checkpoint layout,
    at offset `at` of a rank's shard (`sync/sharded.py`)."""

    index: int
    start: int
    end: int
    at: int


class ShardOps(Protocol):
    """What the sharded strategy (`sync/sharded.py`, ZeRO-1/2) needs of an engine, so the
    sharding itself is written once for both. The strategy cuts the trained parameters,
    flattened one after another in checkpoint layout (`get_weights`'), into ranges, one per
    rank; `pieces` are a range's parts, one per parameter it touches. Checkpoint layout, not
    the engine's own, so gathered state is the checkpoint's `<state name>.<param>` as it is and
    checkpoints move between sharded and unsharded runs of either engine. The math (norm, the
    optimizer's update) stays on the engine's device; only flat fp32 numpy crosses between
    ranks, so the exchange never knows which framework it serves. The update is the engine's
    optimizer's (`mlxdist.optim`, the same formula as its unsharded step), element for element,
    so a sharded run equals data parallel."""

    names: list[str]  # trained parameters, in `take_gradients()` order
    shapes: list[tuple[int, ...]]  # each one's shape in checkpoint layout
    optimizer: Optimizer  # the engine's (its state names, bytes per parameter, the math)

    def flat(self, index: int, grad) -> np.ndarray:
        """Gradient `index` (as `take_gradients` handed it) as flat fp32 numpy in checkpoint
        layout: a view where the engine allows, so dropping `grad` frees it (ZeRO-2)."""

    def weights(self, pieces: tuple[Piece, ...]) -> Any:
        """The current weights' elements of `pieces`, one flat fp32 array on the device."""

    def array(self, a: np.ndarray) -> Any:
        """`a` on the device (it may share `a`'s memory)."""

    def numpy(self, x) -> np.ndarray:
        """A device array as numpy (a view where the engine allows)."""

    def squares(self, g, pieces: tuple[Piece, ...]) -> float:
        """Sum of squares of the shard `g`, summed per piece in fp32 as the engine sums per
        parameter (one fp32 sum over a long range drifts), then in float64."""

    def update(self, p, state: tuple, g, pieces: tuple[Piece, ...], lr: float, t: int, coef: float) -> tuple:
        """(p, state) after the optimizer's update number `t` of the shard (`state` in
        `optimizer.state_names` order; the gradient `g` times the clip coefficient `coef`;
        decoupled decay on pieces of >= 2-D parameters)."""

    def drop_moments(self, step: int) -> None:
        """Let go of the engine's own optimizer state (the shards hold it) and keep `step` as
        its update count; `set_optimizer_state` brings it back (checkpoints, drift repair)."""


class StagedOps(ShardOps, Protocol):
    """What ZeRO-3 (`sync/fully_sharded.py`) needs besides: the model run stage by stage
    (`model.stages()`), its weights let go of. `shard_ops()` gives one where
    `capabilities.staged`."""

    def stage_names(self) -> list[list[str]] | None:
        """Each stage's parameter names, in order; None: the model has no `stages()`."""

    def staged(self, batch: Batch, fetch: Callable[[int], list], hand: Callable[[int, list], None]) -> None:
        """Forward and backward of `batch` a stage at a time: `fetch(i)` gives stage i's weights,
        `hand(i, grads)` takes its gradients (last stage first)."""

    def staged_eval(self, batch: Batch, fetch: Callable[[int], list], metrics: MetricSums | None) -> tuple[float, int]:
        """`Engine.eval_loss` a stage at a time (forward only)."""

    def totals(self) -> LocalGradients:
        """Loss, units and metrics of the batches run since the last call (no gradients)."""

    def pipeline_run(self, first: int, last: int) -> Any:
        """A pipeline rank's run of stages [first, last): their math (`engine.staged.PipelineRun`),
        what `sync/pipeline.py` computes with."""

    def release(self) -> None:
        """Let go of the whole weights (lazy stand-ins; reading them is an error until the
        engine is given weights again)."""

    @property
    def released(self) -> bool:
        """Whether the weights are in the strategy's shards (`release`d, not set since)."""


class ModelState(Protocol):
    """The rest of a task's model state beside its trained parameters (buffers, frozen weights
    a task writes): `engine.model_state`, empty for the built-in LM. The trackers of
    `engine/model_state.py` are it, for both engines and both your-loop APIs."""

    def state_names(self) -> list[str]:
        """What is saved and kept equal: buffers, and entries that ever changed."""

    def has_state(self) -> bool:
        """Whether the model has anything besides its trained parameters."""

    def get_state(self, names=None) -> dict[str, np.ndarray]:
        """Copies in each entry's own dtype (bf16 as fp32), all or the named ones."""

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        """Overwrite the named entries (any subset); marks them as the agreed state."""

    def changed_state(self) -> list[str]:
        """Entries written since they were last agreed on (`set_state`/`mark_state`)."""

    def mark_state(self) -> None: ...


class Memory(Protocol):
    """The device's memory as the batch-size controller and the loop read it: `engine.memory`."""

    def reading(self) -> MemoryReading:
        """Bytes in use, peak since `reset_peak`, and the limit to stay under."""

    def reset_peak(self) -> None: ...

    def clear_cache(self) -> None:
        """Return cached allocator memory to the system."""


class Engine(Protocol):
    """The core: what every engine has, and all the loop and the strategies may use without
    reading `capabilities` first."""

    name: str
    model: Any  # the task's module (torch.nn.Module / mlx.nn.Module), as its hooks receive it
    device: str
    capabilities: Capabilities  # what it trains and can do; which optional interfaces below it offers
    optimizer: Optimizer  # mlxdist's (`train.optimizer`); a task's own, where it brings one, is the engine's affair
    trained_names: list[str]  # the trained parameters, in `take_gradients()` order
    model_state: ModelState  # buffers and the rest beside the trained parameters
    memory: Memory

    # -- the step ------------------------------------------------------------------
    def micro_step(self, batch: Batch) -> None:
        """Forward+backward; gradients accumulate until `take_gradients`."""

    def take_gradients(self) -> LocalGradients:
        """This rank's accumulated gradients; the accumulators start afresh."""

    def apply_gradients(self, grads: list, loss_sum: float, count: int, lr: float) -> StepStats:
        """Divide the (summed) gradients by `count`, check they are finite, clip, apply the optimizer.
        A non-finite loss or norm skips the update (`StepStats.skipped`)."""

    def discard_gradients(self) -> None:
        """Forget gradients accumulated since the last `take_gradients` (retry after out-of-memory)."""

    def eval_loss(self, batch: Batch, metrics: MetricSums | None = None) -> tuple[float, int]:
        """(summed loss, unit count) without touching gradients, the model in eval mode; the
        task's metrics added into `metrics`."""

    # -- state (trainable parameters only: a frozen base is fingerprinted, not saved) --
    def get_weights(self) -> dict[str, np.ndarray]:
        """fp32 master weights by parameter name."""

    def set_weights(self, weights: dict[str, np.ndarray]) -> None: ...

    def get_optimizer_state(self) -> tuple[dict[str, np.ndarray], int]:
        """The optimizer's state as `<state name>.<param>` fp32 arrays (AdamW: `m.`, `v.`; Lion:
        `m.`), and the update count."""

    def set_optimizer_state(self, state: dict[str, np.ndarray], step: int) -> None: ...

    def weight_checksum(self) -> int:
        """Bit-exact fingerprint of this rank's weights (equal on all ranks iff they agree)."""

    def gradient_sizes(self) -> list[int]:
        """Elements of each trained parameter, in `trained_names` order."""

    def describe(self) -> str:
        """One banner line: framework, device, precision, speed settings."""


# -- the optional interfaces: an engine offers each where `capabilities` says so ------------


@runtime_checkable
class Generation(Protocol):
    """`capabilities.generation`: tokens in, logits or sampled tokens out (`mlxdist.generate`)."""

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 logits [b, T, vocab] for int32 tokens [b, T]."""

    def sample(self, prompt: list[int], max_new: int, temperature: float = 0.8, seed: int = 0,
               context: int | None = None, stop: set[int] | None = None,
               on_token: Callable[[int], None] | None = None) -> list[int]:
        """Generated tokens (not the prompt), drawn by `common.sample_tokens`."""


@runtime_checkable
class Sharding(Protocol):
    """`capabilities.shards`: what sharding mlxdist's optimizer over ranks needs
    (`sync/sharded.py`); a `StagedOps` where `capabilities.staged` (`sync/fully_sharded.py`)."""

    def shard_ops(self) -> ShardOps: ...


@runtime_checkable
class Adapters(Protocol):
    """`capabilities.adapters`: a fine-tune's adapter written at the end of a run."""

    def save_adapter(self, out_dir: Path) -> Path | None:
        """The adapter in PEFT's layout; None when the whole model trained."""


class GradientFeed(Protocol):
    """The parameters' gradients as the gradient sum reads them while backward still runs
    (`engine/torch_grads.py`'s `ParamGradients`, the torch engine's and md.DistributedOptimizer's)."""

    def gradient_sizes(self) -> list[int]: ...

    def backward_order(self) -> list[int]:
        """Parameter indices roughly as backward finishes them."""

    def gradient(self, i: int) -> Any:
        """Parameter i's gradient (zeros where this rank's batches did not reach it)."""

    def on_gradient_ready(self, callback: Callable[[int], None] | None) -> None:
        """`callback(i)` as backward finishes parameter i's gradient, until set to None."""


@runtime_checkable
class Overlap(Protocol):
    """`capabilities.overlap`: gradients a reducer may send while backward runs
    (`Reducer.arm(engine.gradients)` before the step's last backward)."""

    gradients: GradientFeed


def local_step(engine: Engine, lr: float) -> StepStats:
    """One rank's update from its own gradients alone (a one-rank run, a reference in tests)."""
    g = engine.take_gradients()
    stats = engine.apply_gradients(g.arrays, g.loss_sum, g.count, lr)
    stats.local = True
    stats.metrics = means(g.metrics.names(), g.metrics.flat(g.count))
    return stats


def set_model(engine: Engine, arrays: dict[str, np.ndarray]) -> list[str]:
    """A checkpoint's model (trained parameters and the rest of the state) into the engine;
    returns the state entries it lacked (written before buffers were saved), kept as built."""
    trained = set(engine.trained_names)
    engine.set_weights({n: a for n, a in arrays.items() if n in trained})
    rest = {n: a for n, a in arrays.items() if n not in trained}
    if rest:
        engine.model_state.set_state(rest)
    return sorted(set(engine.model_state.state_names()) - set(rest))


def nothing_to_learn(loss_sum: float) -> StepStats:
    """A step whose batches covered no unit anywhere (e.g. every answer masked): no update,
    rather than a division by zero."""
    return StepStats(loss_sum, 0, 0.0, skipped=True, why_skipped="the task's count was 0 on every rank")


def as_batch(batch) -> Batch:
    """A task's Batch as it is; a bare token array or TokenBatch (tools, tests, the built-in
    LM's generation) as the built-in LM's batch."""
    if isinstance(batch, Batch):
        return batch
    from ..tasks.lm import lm_batch_data, lm_count

    data = lm_batch_data(batch)
    return Batch(np.arange(len(data["tokens"])), data, lm_count(data))


def check_scalar(loss, task: str):
    """The task's loss as a 0-d array/tensor, or one line saying what it returned instead."""
    numel = getattr(loss, "numel", None)
    n = numel() if callable(numel) else getattr(loss, "size", None)
    if not isinstance(n, int):
        raise TaskError(f"task {task}: loss(model, batch) returned {type(loss).__name__}, not an array or tensor "
                        "of the framework (return the summed loss, e.g. losses.sum())")
    if n != 1:
        raise TaskError(f"task {task}: loss(model, batch) returned shape {tuple(loss.shape)}, not a scalar; "
                        "return the sum of the per-unit losses (e.g. losses.sum())")
    return loss.reshape(())
