"""What a run trains: a model, a summed loss, a unit count and a dataset (`Task`).

The rule that makes unequal Macs exact: `loss(model, batch)` returns the *sum* of the
per-unit losses and `count(batch)` how many units that sum covers. The step's gradient is
(sum over every rank's micro-batches of the loss gradients) / (sum of their counts), so
ranks with batches b_1..b_N train exactly like one process with sum(b_i). A mean loss
would weigh a MacBook's 3 samples like the Studio's 5; `check_task` finds that out.

The built-in language model (`tasks/lm.py`) is a Task like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import Config, ConfigError
from ..data.sampler import StreamIndices, position_rng, position_seeds, stream_of


class TaskError(ConfigError):
    """A user task that does not keep the contract: one line, exit code 2."""


@dataclass
class TaskContext:
    """What `Task.build` may want to know. The model's weights are the same on every rank."""

    engine: str  # "mlx" or "torch"
    device: str  # the torch device ("cpu", "mps", "cuda:0"), or MLX's default device
    seed: int
    config: Config
    # This rank's micro-batch at the start (ranks differ: 3 on a MacBook, 5 on a Studio), for a
    # model that sizes a structure by it; it can change later (out of memory, the balancer).
    micro_batch: int = 0


@dataclass
class Task:
    """Any model, summed loss and dataset, trained with everything mlxdist does.

    - `build(ctx)`: an `mlx.nn.Module` (MLX engine) or `torch.nn.Module` (torch engine).
    - `loss(model, batch)`: the **sum** of the batch's per-unit losses, a scalar. The batch
      arrives as the engine's arrays (`mx.array` / torch tensors on the device), in the
      structure `collate` made.
    - `count(batch)`: units the sum covers, from the numpy batch; default its leading size.
    - `dataset`: `len()` and `[i]` -> a sample (numpy arrays, or a dict/tuple of them), the
      same on every host. `collate(samples)` makes a batch; default stacks each leaf.
    - `eval_dataset`: held-out loss with the same weighting. `unit`: shown in progress and
      metrics ("12.3k samples/s").
    - `optimizer(model)`: the task's own optimizer (a `torch.optim.Optimizer`, or a list of
      them; an `mlx.optimizers.Optimizer`) with its own parameter groups and hyperparameters,
      instead of mlxdist's AdamW. Gradients are still summed over ranks and divided by the
      units first, clipped by `train.grad_clip`; the schedule scales each group's own learning
      rate by schedule(step) / train.lr; its state is checkpointed and broadcast from rank 0.
    - `augment(sample, rng)`: random augmentation of each sample as it is read (training and
      evaluation), drawing only from `rng`, a `numpy.random.Generator` seeded by (train.seed,
      the sample's stream position): the same on every rank, in any split, after a resume.
      Randomness in the model (dropout) draws from `sample_seeds()` inside `loss`.
    - `state_dict()` / `load_state_dict(state)`: what the task carries between steps besides
      the model (a recursive model's carry, a curriculum's counters): a dict of arrays, tensors
      and numbers, this rank's own, saved in every checkpoint and handed back on resume.
    - `on_eval(model, step, metrics)` / `on_checkpoint(model, directory, step)`: rank 0's hooks
      after each evaluation (the model holds the EMA weights when `train.ema` is set; metrics
      include `loss`) and after each checkpoint (`directory` is the checkpoint's; files written
      there are kept and removed with it).
    - `config_keys`: the `model.*`, `data.*`, `finetune.*` keys the task reads from
      `ctx.config`; any other such key set in the config is an error (it would do nothing).
    """

    build: Callable[[TaskContext], Any]
    loss: Callable[[Any, Any], Any]
    dataset: Any
    count: Callable[[Any], int] | None = None
    collate: Callable[[list], Any] | None = None
    eval_dataset: Any = None
    optimizer: Callable[[Any], Any] | None = None
    unit: str = "samples"
    name: str = field(default="task", repr=False)  # banner and messages: the factory's name
    data_summary: str | None = field(default=None, repr=False)  # banner line; default: its length
    augment: Callable[[Any, np.random.Generator], Any] | None = None
    state_dict: Callable[[], dict] | None = None
    load_state_dict: Callable[[dict], None] | None = None
    on_eval: Callable[[Any, int, dict[str, float]], None] | None = None
    on_checkpoint: Callable[[Any, Any, int], None] | None = None
    config_keys: tuple[str, ...] = ()

    def make_batch(self, dataset: Any, indices) -> Batch:
        """The collated batch of these dataset indices, counted once here in numpy. Indices
        from the sampler (`StreamIndices`) carry each sample's stream position, the key of its
        `augment` rng and of its `Batch.seeds`; plain indices stand at positions equal to
        themselves, seed 0."""
        idx = stream_of(indices)
        samples = [dataset[int(i)] for i in idx]
        if self.augment is not None:
            samples = [self.augment(s, position_rng(idx.seed, p, idx.stream))
                       for s, p in zip(samples, idx.positions, strict=True)]
        data = (self.collate or default_collate)(samples)
        n = (self.count or leading_size)(data)
        return Batch(idx, data, int(n), position_seeds(idx.seed, idx.positions, idx.stream))


@dataclass
class Batch:
    """A collated micro-batch, the dataset indices it came from (an out-of-memory retry
    re-collates them at a smaller size; from the sampler they carry their stream positions),
    its unit count and one uint64 seed per sample (`sample_seeds()` during its loss)."""

    indices: np.ndarray
    data: Any
    count: int
    seeds: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.indices)


_SEEDS: ContextVar[np.ndarray | None] = ContextVar("mlxdist_sample_seeds", default=None)


def sample_seeds() -> np.ndarray:
    """Inside a task's `loss`: the uint64 seeds of the micro-batch's samples, in batch order,
    each a hash of (train.seed, the sample's stream position). Draw per-sample randomness from
    them (`np.random.default_rng(seed)` per row) and it is the same whether the sample trains
    on a rank with 3 or 5, in any micro-batch, after a resume."""
    seeds = _SEEDS.get()
    if seeds is None:
        raise RuntimeError("mlxdist.tasks.sample_seeds() is only known inside the task's loss while mlxdist "
                           "computes it, for batches made by Task.make_batch")
    return seeds


@contextmanager
def sample_seeds_of(batch: Any) -> Iterator[None]:
    """The engines' loss calls run inside this: `sample_seeds()` gives `batch.seeds`."""
    token = _SEEDS.set(getattr(batch, "seeds", None))
    try:
        yield
    finally:
        _SEEDS.reset(token)


def default_collate(samples: list) -> Any:
    """Stack each leaf of the samples' common structure (dicts, tuples, lists, arrays, numbers)."""
    first = samples[0]
    if isinstance(first, dict):
        return {k: default_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        leaves = [default_collate([s[i] for s in samples]) for i in range(len(first))]
        return type(first)(*leaves) if hasattr(first, "_fields") else type(first)(leaves)
    return np.stack([np.asarray(s) for s in samples])


def leading_size(batch: Any) -> int:
    """The default `count`: the leading dimension of the batch's first array."""
    while isinstance(batch, (dict, tuple, list)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(np.shape(batch)[0])


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`fn` on every numpy leaf of dicts/tuples/lists; other leaves pass through."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        leaves = [tree_map(fn, v) for v in tree]
        return type(tree)(*leaves) if hasattr(tree, "_fields") else type(tree)(leaves)
    if isinstance(tree, (np.ndarray, np.generic)):
        return fn(tree)
    return tree


__all__ = ["Batch", "StreamIndices", "Task", "TaskContext", "TaskError", "default_collate", "leading_size",
           "sample_seeds", "sample_seeds_of", "tree_map"]
