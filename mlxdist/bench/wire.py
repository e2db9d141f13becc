"""`python -m mlxdist.bench wire`: data parallel's gradients on a quantized wire
(`dist.wire_dtype=int8`, error feedback, all-gathered) against the fp32 wire (the ring
all-reduce), on N namespace hosts joined by links shaped to `--rate` (root), or on N ranks of
this host (`--simcluster 0`), the wires interleaved within each of `--rounds` rounds.

Per wire and round: the median step time and exchange time (the step events' `step_s`,
`sync_s`: for int8 the encode, the all-gather and the decode of every rank's payload), the
bytes a rank sends a step, the mean training loss of the last tenth of the steps and the eval
loss at the end, with the step-time ratio and loss differences against fp32 in the same round.
Also the link's least time for each wire's bytes, and, on this machine, what encoding and
decoding one step's gradients costs alone (numpy, one core), which bounds int8 on a CPU this slow.

    python -m mlxdist.bench wire                          # 2 hosts at 1 Gbit, 300 steps, 3 rounds
    python -m mlxdist.bench wire --engine torch --wires float32,int8,int4
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import registry
from ..cluster.world import find_mpirun
from .runs import REPO, check, finish, namespace_hosts, read_events, set_env


def _launch(n: int, args: list[str], run_dir: Path, timeout: float, cluster=None) -> subprocess.CompletedProcess:
    if cluster is None:
        flags = ["--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS"]
    else:
        flags = cluster.mpirun_args(env=["OPENBLAS_NUM_THREADS"])
    cmd = [find_mpirun(), *flags, "-np", str(n), sys.executable, "-m", "mlxdist.train", *args,
           f"train.out_dir={run_dir}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _read(run_dir: Path, skip: int) -> dict:
    events = read_events(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    evals = [e["eval_loss"] for e in events if e["event"] == "eval"]
    if len(steps) <= skip or not evals:
        raise RuntimeError(f"{run_dir.name}: {len(steps)} steps and {len(evals)} evals logged")
    kept = steps[skip:]
    tail = steps[-max(1, len(steps) // 10):]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"step_s": statistics.median(e["step_s"] for e in kept),
            "sync_s": statistics.median(e.get("sync_s", 0.0) for e in kept),
            "sync_bytes": statistics.median(e.get("sync_bytes", 0) for e in kept),
            "train_loss": statistics.fmean(e["loss"] for e in tail), "eval_loss": evals[-1],
            "losses": [round(e["loss"], 5) for e in steps]}


def link_seconds(wire: str, n_params: int, n: int, rate: str) -> float:
    """The least time a step's exchange takes over full-duplex links of `rate`: the ring
    all-reduce moves 2 (n - 1) / n of the gradients (at 4 or 2 bytes a value), the all-gather
    of quantized payloads n - 1 payloads."""
    from ..cluster.codec import make_codec
    from ..rig.simcluster import parse_rate

    if wire in ("int8", "int4"):
        moved = (n - 1) * make_codec(wire).nbytes(n_params)
    else:
        moved = 2 * (n - 1) / n * n_params * (4 if wire == "float32" else 2)
    return moved * 8 / parse_rate(rate)


def codec_seconds(wire: str, n_params: int, n: int, repeats: int = 5) -> float:
    """One step's encode (with the residual) and n decodes, summed, on numpy here: the CPU
    work the quantized wire adds to a step whatever the link."""
    from ..cluster.codec import make_codec

    codec = make_codec(wire)
    rng = np.random.default_rng(0)
    x = rng.normal(size=n_params).astype(np.float32)
    residual = np.zeros(n_params, np.float32)
    out, times = np.empty(n_params, np.float32), []
    for _ in range(repeats):
        g = x.copy()
        t0 = time.perf_counter()
        payload = codec.encode(g, residual, consume=True)
        total = codec.decode(payload, n_params)
        for _ in range(n - 1):
            total += codec.decode(payload, n_params, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)




def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench wire", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simcluster", type=int, default=2, metavar="N",
                   help="N namespace hosts (one rank each) at --rate (root); 0: --ranks ranks on this host")
    p.add_argument("--ranks", type=int, default=2, help="with --simcluster 0: ranks on this host")
    p.add_argument("--rate", default="1gbit", help="every host's link rate (tc syntax)")
    p.add_argument("--subnet", default="10.79.9", help="the hosts' /24")
    p.add_argument("--engine", default="mlx", choices=("mlx", "torch"))
    p.add_argument("--wires", default="float32,int8", help="comma-separated dist.wire_dtype values, any registered codec "
                   f"({', '.join(registry.codec_names())}); float32 always runs")
    p.add_argument("--model", default="model.preset=tiny,model.dim=256,model.ffn_dim=704",
                   help="comma-separated model overrides (default: 3.0M parameters)")
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=5, help="warmup steps left out of the medians")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the wires interleaved within each")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    args = p.parse_args(argv)
    wires = ["float32", *[w for w in args.wires.split(",") if w and w != "float32"]]
    for w in wires:  # any registered codec, with its parameter (topk:0.125)
        try:
            registry.make(registry.CODECS, "wire format", w, "--wires", registry.CODEC_ALIASES)
        except ValueError as e:
            p.error(str(e))
    if args.steps <= args.skip:
        p.error("--steps must exceed --skip")
    set_env()
    n = args.simcluster or args.ranks
    model = [x for x in args.model.split(",") if x]
    common = [*(["--engine", "torch", "--device", "cpu"] if args.engine == "torch" else []), *model,
              "data.source=synthetic", f"data.seq_len={args.seq_len}", f"train.batch_size={args.batch}",
              f"train.steps={args.steps}", f"train.eval_every={args.steps}", "train.eval_batches=8",
              "train.log_every=1000", "metrics.port=0", "train.progress=false", "checkpoint.every=0",
              "dist.sync_weights_every=0"]
    from ..config import load_config
    from ..models.presets import param_count, resolve

    n_params = param_count(resolve(load_config(None, model).model))
    t_start = time.perf_counter()
    runs: dict[str, list[dict]] = {w: [] for w in wires}
    with tempfile.TemporaryDirectory(prefix="mlxwire-") as tmp, namespace_hosts(args, Path(tmp), "wire", "mlxwire") as cluster:
        for rnd in range(args.rounds):
            for w in wires:
                run_dir = Path(tmp) / f"{w}-{rnd}"
                check(_launch(n, [*common, f"dist.wire_dtype={w}"], run_dir, args.timeout, cluster), f"{n}-rank {w}")
                runs[w].append(_read(run_dir, args.skip))
                r = runs[w][-1]
                print(f"round {rnd + 1}/{args.rounds} {w}: {r['step_s']:.3f} s/step, exchange {r['sync_s']:.3f} s, "
                      f"eval loss {r['eval_loss']:.4f}", flush=True)
    where = f"{n} hosts at {args.rate}" if args.simcluster else f"{n} ranks on one host"
    result: dict = {"where": where, "engine": args.engine, "n_params": n_params, "ranks": n,
                    "batch_per_rank": args.batch, "seq_len": args.seq_len, "steps": args.steps, "skip": args.skip,
                    "rounds": args.rounds, "wires": {}}
    print(f"\n{where}, {args.engine} engine, {n_params / 1e6:.2f}M parameters, {args.batch} x {args.seq_len} tokens "
          f"per rank per step, {args.steps} steps, {args.rounds} round(s) interleaved; medians of steps "
          f"{args.skip + 1}-{args.steps}; ratios against float32 in the same round")
    print(f"{'wire':<9}{'step s':>8}{'/ fp32':>8}{'sync s':>8}{'link s':>8}{'codec s':>8}{'MB/step':>9}"
          f"{'train loss':>11}{'eval loss':>10}{'d eval':>9}  rounds: step ratio, eval loss - fp32's")
    for w in wires:
        rs, base = runs[w], runs["float32"]
        ratios = [r["step_s"] / b["step_s"] for r, b in zip(rs, base, strict=True)]
        d_eval = [r["eval_loss"] - b["eval_loss"] for r, b in zip(rs, base, strict=True)]
        d_train = [r["train_loss"] - b["train_loss"] for r, b in zip(rs, base, strict=True)]
        entry = {"step_s_rounds": [r["step_s"] for r in rs], "sync_s_rounds": [r["sync_s"] for r in rs],
                 "step_ratio_rounds": ratios, "step_ratio": statistics.median(ratios),
                 "sync_bytes": rs[0]["sync_bytes"], "eval_loss_rounds": [r["eval_loss"] for r in rs],
                 "train_loss_rounds": [r["train_loss"] for r in rs], "eval_diff_rounds": d_eval,
                 "train_diff_rounds": d_train, "losses_round1": rs[0]["losses"],
                 "link_s": link_seconds(w, n_params, n, args.rate) if args.simcluster else None,
                 "codec_s": codec_seconds(w, n_params, n) if w in ("int8", "int4") else 0.0}
        result["wires"][w] = entry
        link = f"{entry['link_s']:>8.3f}" if entry["link_s"] is not None else f"{'-':>8}"
        print(f"{w:<9}{statistics.median(entry['step_s_rounds']):>8.3f}{entry['step_ratio']:>8.3f}"
              f"{statistics.median(entry['sync_s_rounds']):>8.3f}{link}{entry['codec_s']:>8.3f}"
              f"{entry['sync_bytes'] / 1e6:>9.2f}{statistics.median(entry['train_loss_rounds']):>11.4f}"
              f"{statistics.median(entry['eval_loss_rounds']):>10.4f}{statistics.median(d_eval):>+9.4f}  "
              f"{', '.join(f'{x:.3f}' for x in ratios)}; {', '.join(f'{x:+.4f}' for x in d_eval)}")
    return finish("wire", result, t_start, args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
