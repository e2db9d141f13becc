"""`python -m mlxdist.bench overhead`: the trainer against the shortest correct MLX loop.

With `--task` and `train.ema=...`, what a recipe's extras cost is in the ratio: the bare loop
computes neither the task's metrics nor an average of the weights."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path


def _bare_mlx_steps(cfg, steps: int) -> tuple[list[float], int]:
    """The baseline: the same task (the built-in LM, or `task.factory`), model and batches,
    trained by the shortest correct MLX loop. Returns step times and units per step."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from ..data.sampler import GlobalSampler
    from ..models.build import adopt_mlx, built_from_task
    from ..tasks import TaskContext, tree_map
    from ..tasks.load import resolve_task

    task = resolve_task(cfg)
    mx.random.seed(cfg.train.seed)
    model = built_from_task(task.build(TaskContext("mlx", str(mx.default_device()), cfg.train.seed, cfg)), adopt_mlx,
                            None, task.name).module
    opt = optim.AdamW(learning_rate=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    sampler = GlobalSampler(len(task.dataset), cfg.train.seed)
    b = cfg.train.batch_size

    def loss_fn(model, data, count):
        out = task.loss(model, data)
        return (out[0] if isinstance(out, tuple) else out) / count  # a task's metrics: not computed here

    step_fn = nn.value_and_grad(model, loss_fn)
    times, units = [], 0
    for step in range(steps):
        batch = task.make_batch(task.dataset, sampler.indices(step * b, b))
        data, units = tree_map(mx.array, batch.data), batch.count
        t0 = time.perf_counter()
        loss, grads = step_fn(model, data, batch.count)
        grads, _ = optim.clip_grad_norm(grads, cfg.train.grad_clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        times.append(time.perf_counter() - t0)
    return times, units


def _trainer_steps(cfg, steps: int) -> list[float]:
    from ..commands.train import train

    with tempfile.TemporaryDirectory() as d:
        train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=d, steps=steps)), "mlx")
        events = [json.loads(line) for line in (Path(d) / "logs" / "rank0.jsonl").read_text().splitlines()]
    return [e["step_s"] for e in events if e["event"] == "step"]


def overhead(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench overhead")
    p.add_argument("--steps", type=int, default=30, help="steps per run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of each trainer")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--task", help="a task factory (package.module:callable) instead of the built-in LM")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.preset=small")
    args = p.parse_args(argv)
    from ..config import load_config

    base = ["train.batch_size=16", "metrics.port=0", "train.progress=false", "train.eval_every=0",
            "checkpoint.every=0", "dist.sync_weights_every=0"]
    if args.task:
        base += [f"task.factory={args.task}"]
    else:
        base += ["data.source=synthetic", "data.seq_len=128"]
    ratios = []
    for r in range(args.rounds):
        cfg = load_config(None, base + args.overrides)
        bare_times, units = _bare_mlx_steps(cfg, args.steps)
        bare = statistics.median(bare_times[args.warmup:])
        ours = statistics.median(_trainer_steps(load_config(None, base + args.overrides), args.steps)[args.warmup:])
        ratios.append(bare / ours)
        unit = "tok" if cfg.task.factory is None else "units"
        print(f"round {r + 1}: bare MLX {units / bare:,.0f} {unit}/s | mlxdist {units / ours:,.0f} {unit}/s | "
              f"ratio {bare / ours:.3f}", flush=True)
    print(f"overhead: mlxdist / bare MLX throughput = {statistics.median(ratios):.3f} "
          f"(median of {args.rounds} rounds; target >= 0.98)")
    return 0
