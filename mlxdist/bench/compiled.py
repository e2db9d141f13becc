"""`python -m mlxdist.bench compiled`: your MLX loop's step under `mx.compile` with
`md.average_gradients` inside it (the sums in MLX's graph) against the same step uncompiled
with the sum after backward (on the host under `auto`), on N ranks.

Run plainly, it launches itself under `mpirun` (this host, or namespace hosts with
`--simcluster N --rate 1gbit`). Each round times both steps in turn, step after step, in the
same ranks on the same model and stream of batches, so a round's ratio of medians compares
like with like on a noisy box.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench compiled")
    p.add_argument("--np", type=int, default=2, help="ranks")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each timing both steps")
    p.add_argument("--steps", type=int, default=20, help="timed steps per step kind and round")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of each timing")
    p.add_argument("--backend", default="auto", help="md.init's backend (auto: mpi4py + MLX's in-graph sums)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows of --context tokens)")
    p.add_argument("--simcluster", type=int, default=0, help="namespace hosts (root), 0: this host")
    p.add_argument("--rate", default=None, help="their links' rate, e.g. 1gbit")
    p.add_argument("--subnet", default="10.93.0")
    p.add_argument("--trainer", action="store_true",
                   help="the trainer's MLX data-parallel step (its engine, GradSync, AdamW, clipping) instead")
    p.add_argument("--preset", default="tiny", help="--trainer: model.preset")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    return p


def _worker(args: argparse.Namespace) -> int:
    from ..blas import ensure_blas

    ensure_blas()  # a fast BLAS, and thread counts that share the cores among the ranks
    if args.trainer:
        return _trainer_worker(args)
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    import mlxdist.mlx as md

    info = md.init(backend=args.backend)
    mx.random.seed(0)
    vocab = 1024
    model = _model(nn, mx, vocab, args.dim, args.layers)
    opt = optim.AdamW(learning_rate=1e-4)
    md.broadcast(model)
    data = np.random.default_rng(0).integers(0, vocab, size=(512, args.context + 1)).astype(np.int32)
    sampler = md.DistributedSampler(len(data), args.batch)
    state = [model.state, opt.state]

    def loss_fn(model, tokens):
        return nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], reduction="mean")

    def step(tokens):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, tokens)
        opt.update(model, md.average_gradients(grads, count=tokens.shape[0]))
        return loss

    kinds = {"uncompiled, sum after backward": step,
             "compiled, sum in the graph": partial(mx.compile, inputs=state, outputs=state)(step)}

    def run(kind: str, at: int) -> None:
        kinds[kind](mx.array(data[sampler.indices(at)]))
        mx.eval(state)

    times = _timed(list(kinds), run, args)
    if info.rank == 0:
        from mlx.utils import tree_flatten

        params = sum(v.size for _, v in tree_flatten(model.parameters()))
        Path(args._out).write_text(json.dumps({"n": info.size, "backend": md._SYNC["backend"], "params": params,
                                               "median_step_s": times}))
    return 0


def _timed(kinds: list[str], run, args: argparse.Namespace) -> dict[str, list[float]]:
    """Each round's median step time of each kind; the kinds take turns step by step (the
    box's noise hits them alike), each on the next global batch. Rank 0's clock: every rank
    waits for the same sums."""
    at, times = 0, {k: [] for k in kinds}
    for _ in range(args.rounds):
        took: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(args.warmup + args.steps):
            for kind in kinds:
                t0 = time.perf_counter()
                run(kind, at)
                at += 1
                if i >= args.warmup:
                    took[kind].append(time.perf_counter() - t0)
        for kind in kinds:
            times[kind].append(statistics.median(took[kind]))
    return times


def _trainer_worker(args: argparse.Namespace) -> int:
    """The trainer's step as data parallel runs it today (micro_step's eval, GradSync's sum on
    the host, the loss and count summed on the host, apply_gradients' norm read back, the
    compiled update) against the same pieces as one compiled function with the sums in the graph."""

    from ..cluster.transport import make_transport
    from ..cluster.world import init_world
    from ..config import load_config
    from ..data.sampler import GlobalSampler, rank_slice
    from ..engine.mlx_engine import MLXEngine
    from ..sync.grad import GradSync
    from ..tasks.load import resolve_task

    backend = "mpi4py+mlx-mpi" if args.backend == "auto" else args.backend
    world = init_world(backend)
    cfg = load_config(None, ["data.source=synthetic", f"data.seq_len={args.context}", f"model.preset={args.preset}",
                             f"train.batch_size={args.batch}", "train.grad_clip=1.0"])
    task, engine = resolve_task(cfg), MLXEngine(cfg)
    sync = GradSync(make_transport(world, backend))
    graph = _graph_step(engine, sync, cfg.train.grad_clip)
    sampler, shares = GlobalSampler(len(task.dataset), 0), [args.batch // world.size] * world.size
    shares[-1] += args.batch - sum(shares)
    lo, hi = rank_slice(shares, world.rank)
    compiled_grads = _compiled_value_and_grad(engine)

    def run(kind: str, at: int) -> None:
        batch = task.make_batch(task.dataset, sampler.indices(at * args.batch + lo, hi - lo))
        if kind.endswith("in the graph"):
            graph(batch, cfg.train.lr)
            return
        if kind.startswith("today"):
            engine.micro_step(batch)
            local = engine.take_gradients()
            arrays, loss_sum, count = local.arrays, local.loss_sum, local.count
        else:
            arrays, loss_sum, count = compiled_grads(batch)
        grads, _ = sync.all_sum(arrays)
        loss, total = world.allreduce_sum([loss_sum, count])
        engine.apply_gradients(grads, loss, int(total), cfg.train.lr)

    times = _timed(["today: backward, sum after", "backward compiled, sum after",
                    "compiled, sum in the graph"], run, args)
    if world.rank == 0:
        params = sum(a.size for a in engine.params.values())
        Path(args._out).write_text(json.dumps({"n": world.size, "backend": backend, "params": params,
                                               "median_step_s": times}))
    return 0


def _compiled_value_and_grad(engine):
    """The engine's backward under mx.compile, the sum left to the host after it: what a
    compiled step without in-graph collectives can do."""
    import mlx.core as mx

    names = engine.names
    fn = mx.compile(lambda params, data: engine._value_and_grad(dict(zip(names, params, strict=True)), data))

    def grads(batch) -> tuple[list, float, int]:
        (loss, _, _), g = fn([engine.params[n] for n in names], engine._arrays(batch.data))
        arrays = [g[n] for n in names]
        mx.eval(arrays, loss)
        return arrays, loss.item(), batch.count

    return grads


def _graph_step(engine, sync, clip: float):
    """One compiled function: value_and_grad, the in-graph sum of the gradients with the loss
    and the count, the global norm and its clipping, the engine's optimizer update."""
    import mlx.core as mx

    names, opt = engine.names, engine.optimizer
    keys = opt.state_names

    def fn(params, states, data, count, scalars):
        (loss, _, _), grads = engine._value_and_grad(dict(zip(names, params, strict=True)), data)
        *summed, loss_total, total = sync.all_sum_in_graph([*(grads[n] for n in names), loss.reshape(1),
                                                            count.reshape(1)])
        grads = [g / mx.maximum(total, 1) for g in summed]
        norm = mx.sqrt(sum(mx.sum(mx.square(g)) for g in grads))
        coef = mx.minimum(1.0, clip / (norm + 1e-6)) if clip > 0 else mx.array(1.0)
        new, new_states = engine._update_all(params, states, [g * coef for g in grads], scalars)
        return new, new_states, loss_total, norm

    compiled = mx.compile(fn)

    def step(batch, lr: float) -> None:
        t = engine.opt_step + 1
        new, states, _, _ = compiled([engine.params[n] for n in names],
                                     [tuple(engine.opt_state[k][n] for k in keys) for n in names],
                                     engine._arrays(batch.data), mx.array(float(batch.count)),
                                     mx.array(opt.scalars(lr, t, 1.0)))
        engine.params = dict(zip(names, new, strict=True))
        engine.opt_state = {k: {n: st[i] for n, st in zip(names, states, strict=True)} for i, k in enumerate(keys)}
        mx.eval(engine.params, engine.opt_state)
        engine.opt_step = t

    return step


def _model(nn, mx, vocab: int, dim: int, layers: int):
    class LM(nn.Module):
        """mlx-examples' transformer_lm model: embedding, pre-norm encoder, a causal mask."""

        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, dim)
            self.transformer = nn.TransformerEncoder(layers, dim, max(1, dim // 64), norm_first=True)
            self.out_proj = nn.Linear(dim, vocab)

        def __call__(self, x):
            mask = nn.MultiHeadAttention.create_additive_causal_mask(x.shape[1])
            return self.out_proj(self.transformer(self.embedding(x), mask))

    model = LM()
    mx.eval(model.parameters())
    return model


def _launch(args: argparse.Namespace, argv: list[str], cluster, out: Path) -> None:
    from ..cluster.world import default_mpi_library, find_mpirun
    from ..launch.mpirun import mpirun_command

    env = dict(os.environ, MLX_MPI_LIBNAME=default_mpi_library(find_mpirun()))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    os.environ.update(MLX_MPI_LIBNAME=env["MLX_MPI_LIBNAME"], PYTHONPATH=env["PYTHONPATH"])
    forward = ["MLX_MPI_LIBNAME", "PYTHONPATH", *[k for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS") if k in env]]
    base = (mpirun_command([], **cluster.mpirun_options(), env=forward) if cluster is not None
            else [*mpirun_command([], env=forward), "--oversubscribe"])
    cmd = [*base, "-np", str(args.np), sys.executable, "-m", "mlxdist.bench.compiled", *argv, "--_out", str(out)]
    res = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
    if res.returncode != 0 or not out.exists():
        raise SystemExit(f"bench compiled: mpirun exited {res.returncode}\n{res.stdout[-2000:]}{res.stderr[-4000:]}")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args._out:
        return _worker(args)
    from .runs import namespace_hosts

    with tempfile.TemporaryDirectory(prefix="mlxdist-bench-") as tmpdir:
        tmp = Path(tmpdir)
        os.chmod(tmp, 0o755)
        with namespace_hosts(args, tmp, "compiled", "mlxcomp") as cluster:
            args.np = args.simcluster or args.np
            _launch(args, _without(argv, "--json"), cluster, tmp / "out.json")
        result = json.loads((tmp / "out.json").read_text())
    t = result["median_step_s"]
    kinds = list(t)
    where = f"{args.simcluster} namespace hosts at {args.rate or 'full speed'}" if args.simcluster else "one host"
    print(f"{'the trainer' if args.trainer else 'your loop'}'s MLX step; {result['n']} ranks on {where}, backend "
          f"{result['backend']}, {result['params'] / 1e6:.2f}M parameters, global batch {args.batch}; median step "
          f"time per round, and its ratio to '{kinds[0]}'")
    result["ratios"] = {k: [a / b for a, b in zip(t[k], t[kinds[0]], strict=True)] for k in kinds[1:]}
    for r in range(len(t[kinds[0]])):
        cells = [f"{kinds[0]} {t[kinds[0]][r] * 1e3:.1f} ms"]
        cells += [f"{k} {t[k][r] * 1e3:.1f} ms (x{result['ratios'][k][r]:.2f})" for k in kinds[1:]]
        print(f"  round {r + 1}: " + " | ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _without(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
