"""`python -m mlxdist.check_task my.yaml` or `mlxdist.check_task(task)`: before a cluster
run, does this task keep the sum/count rule?

One batch of 8 samples is run whole and split 3+5 in one process (no update): the
gradients must agree once divided by the counts, exactly what unequal ranks rely on. When
they do not, the losses tell why: a mean instead of a sum, or a model that couples the
samples of a batch (BatchNorm in training mode, in-batch negatives).

Before that, what would make ranks or a resume see different things: a dataset that
returns different samples for the same index (random when read), an augmentation that
draws from elsewhere than its rng, a random forward pass (the same batch twice gives
different gradients), and state carried between batches (the same batch, with every random
generator reseeded, gives another loss after other batches ran).
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..config import Config, ConfigError, load_config
from ..data.sampler import StreamIndices
from ..engine.registry import ENGINES, engine_spec
from ..tasks import Task, tree_map
from ..tasks.fingerprint import sample_bytes
from ..tasks.load import checked, config_file, resolve_task


@dataclass
class TaskCheck:
    ok: bool
    message: str
    grad_rel_diff: float  # max |g_whole - g_split| / max |g_whole|, after dividing by counts
    loss_whole: float
    loss_parts: list[float]


def diagnose(split: Sequence[int], counts: Sequence[int], whole_count: int, loss_whole: float,
             loss_parts: Sequence[float], grad_rel_diff: float, repeat_rel_diff: float, tol: float = 1e-4,
             carried_rel_diff: float = 0.0) -> TaskCheck:
    """The verdict from the numbers alone (plain Python: unit-tested without a framework).
    `repeat_rel_diff`: the same batch run twice in a row; `carried_rel_diff`: the same batch
    before and after other batches ran, every random generator reseeded before each."""
    total, parts = sum(split), "+".join(map(str, split))

    def result(ok: bool, msg: str) -> TaskCheck:
        return TaskCheck(ok, msg, grad_rel_diff, loss_whole, list(loss_parts))

    if carried_rel_diff > tol:
        return result(False, f"state is carried between batches: the same batch gave another loss or gradient "
                      f"(relative {carried_rel_diff:.2g}) after other batches ran, with every random generator "
                      "reseeded; the forward keeps something from one batch to the next (a statistic it trains "
                      "with, a cache, a counter, a generator of its own), so ranks that saw different batches and a "
                      "resume diverge: make the training loss depend only on the weights and the batch")
    if repeat_rel_diff > tol:
        return result(False, f"the forward pass is random: the same batch gave different gradients twice (relative "
                      f"{repeat_rel_diff:.2g}), so 3+5 != 8 and a resume != no interruption; draw the model's "
                      "randomness (dropout) per sample from mlxdist.tasks.sample_seeds() inside loss, or turn it "
                      "off (eval mode, dropout 0)")
    if sum(counts) != whole_count:
        return result(False, f"count is not additive: count({total} samples) = {whole_count} but "
                      f"count({parts}) = {sum(counts)}; count(batch) must count the units the loss sums over")
    additive = abs(loss_whole - sum(loss_parts)) <= tol * max(1.0, abs(loss_whole))
    if not additive:
        weights = [c / max(whole_count, 1) for c in counts] if whole_count else [n / total for n in split]
        mean_like = [abs(loss_whole - sum(w * lp for w, lp in zip(ws, loss_parts, strict=True)))
                     <= tol * max(1.0, abs(loss_whole)) for ws in (weights, [n / total for n in split])]
        if any(mean_like):
            return result(False, f"loss is a mean, not a sum: loss({total}) = {loss_whole:.6g} is the weighted mean "
                          f"of loss({parts}) = {', '.join(f'{x:.6g}' for x in loss_parts)}; return the sum "
                          "(reduction='sum', or losses.sum()) so unequal ranks are weighted by their samples")
        return result(False, f"samples are coupled: loss({total}) = {loss_whole:.6g} but loss({parts}) sums to "
                      f"{sum(loss_parts):.6g}; the model or loss mixes the samples of a batch (BatchNorm in training "
                      "mode, in-batch negatives, a per-batch normalisation, randomness drawn for the whole batch): "
                      "use LayerNorm/GroupNorm, a per-sample loss and per-sample randomness (sample_seeds()), or "
                      "keep every rank's micro-batch the same size and accept per-rank statistics")
    if grad_rel_diff > tol:
        return result(False, f"gradients differ by {grad_rel_diff:.2g} (relative) between {total} and {parts} "
                      "although the losses add up: the model couples samples in a way the loss hides "
                      "(e.g. BatchNorm statistics)")
    return result(True, f"ok: {total} samples whole and split {parts} give the same gradients "
                  f"(relative difference {grad_rel_diff:.1e}); loss is a sum over {whole_count} units")


def _numpy(a) -> np.ndarray:
    if hasattr(a, "detach"):
        return a.detach().float().cpu().numpy()
    return np.array(a, dtype=np.float32)


def _grads(engine, batches) -> tuple[list[np.ndarray], list[float]]:
    total: list[np.ndarray] | None = None
    losses = []
    for b in batches:
        engine.micro_step(b)
        g = engine.take_gradients()
        arrays = [_numpy(a) for a in g.arrays]
        total = arrays if total is None else [x + y for x, y in zip(total, arrays, strict=True)]
        losses.append(g.loss_sum)
    return total or [], losses


def _rel(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    scale = max((float(np.abs(x).max()) for x in a if x.size), default=0.0)
    diff = max((float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True) if x.size), default=0.0)
    return diff / max(scale, 1e-12)


def _batch_bytes(data) -> bytes:
    parts: list[bytes] = []
    tree_map(lambda a: parts.append(np.ascontiguousarray(a).tobytes()), data)
    return b"".join(parts)


def data_problem(task: Task, idx: StreamIndices) -> str | None:
    """Samples that are not a function of (index, position): a dataset random when read, or an
    augmentation that draws from elsewhere than its rng. None when the data is sound."""
    for i in sorted({int(i) for i in idx}):
        if sample_bytes(task.dataset[i]) != sample_bytes(task.dataset[i]):
            return (f"the dataset returns different samples for the same index (dataset[{i}] read twice differs): "
                    "it is random when read (a random transpose, crop or noise in __getitem__), so ranks, splits "
                    "and a resume see different samples; draw that randomness in Task.augment(sample, rng) from "
                    "the rng it is given (seeded by the sample's stream position)")
    if _batch_bytes(task.make_batch(task.dataset, idx).data) != _batch_bytes(task.make_batch(task.dataset, idx).data):
        return ("the same samples at the same stream positions made different batches: Task.augment must draw only "
                "from the rng it is given (not np.random, random or the framework's generator), and collate must "
                "not be random")
    return None


def _reseed(engine: str, seed: int) -> None:
    """Every random generator a forward pass may draw from, back to `seed`."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    engine_spec(engine).load("seed")(seed)


def _loss_rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def check_task(task: Task, engine: str = "mlx", device: str = "auto", config: Config | None = None,
               split: Sequence[int] = (3, 5)) -> TaskCheck:
    """Run one batch whole and split; see `data_problem` and `diagnose` for the verdicts."""
    from ..engine import make_engine

    task = checked(task, "check_task(task)")
    base = config if config is not None else Config()
    cfg = replace(base, model=replace(base.model, dtype="float32"))
    n = sum(split)
    idx = StreamIndices(np.arange(n) % len(task.dataset), np.arange(n), cfg.train.seed)  # stream positions 0..n-1
    problem = data_problem(task, idx)
    if problem is not None:
        return TaskCheck(False, problem, float("nan"), float("nan"), [])
    eng = make_engine(engine, cfg, device, task)
    whole = task.make_batch(task.dataset, idx)
    bounds = np.cumsum([0, *split])
    parts = [task.make_batch(task.dataset, idx[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    seed = cfg.train.seed
    _reseed(engine, seed)
    g_whole, (l_whole,) = _grads(eng, [whole])
    _reseed(engine, seed)
    g_split, l_parts = _grads(eng, parts)
    _reseed(engine, seed)
    g_after, (l_after,) = _grads(eng, [whole])  # the same batch, generators reseeded, after others ran
    g_again, (l_again,) = _grads(eng, [whole])  # ... and once more, generators running on
    n_whole, n_split = whole.count, sum(p.count for p in parts)
    rel = _rel([g / max(n_whole, 1) for g in g_whole], [g / max(n_split, 1) for g in g_split])
    return diagnose(split, [p.count for p in parts], n_whole, l_whole, l_parts, rel,
                    max(_rel(g_after, g_again), _loss_rel(l_after, l_again)),
                    carried_rel_diff=max(_rel(g_whole, g_after), _loss_rel(l_whole, l_after)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.check_task",
                                description="Check that a task's loss is a sum over independent units (3+5 == 8).")
    p.add_argument("config", help="YAML config with task.factory (and task.args)")
    p.add_argument("--engine", choices=ENGINES, default="mlx", help="which framework runs the check")
    p.add_argument("--device", default="auto", help="torch engine: auto|cuda|mps|cpu")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    args = p.parse_intermixed_args(argv)
    from ..engine import prepare_process

    prepare_process(args.engine)  # the Linux BLAS re-exec, before MLX loads
    try:
        config_file(args.config)
        cfg = load_config(args.config, args.overrides)
        result = check_task(resolve_task(cfg), args.engine, args.device, cfg)
    except (ConfigError, RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(("" if result.ok else "problem: ") + result.message)
    return 0 if result.ok else 1


class _CallableModule(types.ModuleType):
    """`mlxdist.check_task(task)` keeps working after `import mlxdist.check_task` binds the
    module under the function's name."""

    def __call__(self, *args, **kwargs) -> TaskCheck:
        return check_task(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
