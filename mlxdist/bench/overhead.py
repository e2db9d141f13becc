"""`python -m mlxdist.bench overhead`: the trainer against the shortest correct MLX loop."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _bare_mlx_steps(cfg, steps: int) -> list[float]:
    """The baseline: the same model and batch, trained by the shortest correct MLX loop."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from ..data.datasets import build_datasets
    from ..data.sampler import GlobalSampler
    from ..models.mlx_model import Transformer
    from ..models.presets import resolve

    model = Transformer(resolve(cfg.model))
    opt = optim.AdamW(learning_rate=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    train_set, _ = build_datasets(cfg.data, cfg.train.seed)
    sampler = GlobalSampler(len(train_set), cfg.train.seed)
    b = cfg.train.batch_size

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)
    times = []
    for step in range(steps):
        batch = mx.array(train_set.batch(sampler.indices(step * b, b)))
        t0 = time.perf_counter()
        loss, grads = step_fn(model, batch[:, :-1], batch[:, 1:])
        grads, _ = optim.clip_grad_norm(grads, cfg.train.grad_clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        times.append(time.perf_counter() - t0)
    return times


def _trainer_steps(cfg, steps: int) -> list[float]:
    from ..train import train

    with tempfile.TemporaryDirectory() as d:
        cfg.train.out_dir = d
        cfg.train.steps = steps
        train(cfg, "mlx")
        events = [json.loads(line) for line in (Path(d) / "logs" / "rank0.jsonl").read_text().splitlines()]
    return [e["step_s"] for e in events if e["event"] == "step"]


def overhead(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench overhead")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.preset=small")
    args = p.parse_args(argv)
    from ..config import load_config

    base = ["data.source=synthetic", "data.seq_len=128", "train.batch_size=16", "metrics.port=0",
            "train.progress=false", "train.eval_every=0", "checkpoint.every=0", "dist.sync_weights_every=0"]
    ratios = []
    tokens = None
    for r in range(args.rounds):
        cfg = load_config(None, base + args.overrides)
        tokens = cfg.train.batch_size * cfg.data.seq_len
        bare = statistics.median(_bare_mlx_steps(cfg, args.steps)[args.warmup:])
        ours = statistics.median(_trainer_steps(load_config(None, base + args.overrides), args.steps)[args.warmup:])
        ratios.append(bare / ours)
        print(f"round {r + 1}: bare MLX {tokens / bare:,.0f} tok/s | mlxdist {tokens / ours:,.0f} tok/s | "
              f"ratio {bare / ours:.3f}", flush=True)
    print(f"overhead: mlxdist / bare MLX throughput = {statistics.median(ratios):.3f} "
          f"(median of {args.rounds} rounds; target >= 0.98)")
    return 0
