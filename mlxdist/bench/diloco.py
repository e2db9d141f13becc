"""DiLoCo vs plain data parallel on slow links: does `dist.mode=diloco` get the
throughput a slow link takes from DDP back, at the same quality?

N namespace hosts joined by links capped at `--rate` (default 1 Gbit/s) train the same
model on the same sample stream: every host alone (all at once, before and after: the
no-communication bound is the sum of their rates), then all together with DDP (one
gradient all-reduce per step), then with DiLoCo (one pseudo-gradient exchange per
`--inner-steps`). Both cluster runs train the same number of steps on the same global
batch, so their final eval losses compare at equal tokens. The model is chosen so that
DDP spends most of each step in the all-reduce: that is the case DiLoCo exists for.

    python -m mlxdist.bench diloco
    python -m mlxdist.bench diloco --hosts 3 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .runs import cluster_run, finish, set_env, solo_rates, steady_rate

BASE = ["metrics.port=0", "train.progress=false", "checkpoint.every=0", "dist.sync_weights_every=0",
        "train.warmup_steps=2", "train.log_every=1000"]


def _median(events: list[dict], kind: str, key: str) -> float:
    values = [e[key] for e in events if e["event"] == kind]
    return statistics.median(values) if values else 0.0


def _eval_loss(events: list[dict]) -> float:
    evals = [e["eval_loss"] for e in events if e["event"] == "eval"]
    if not evals:
        raise RuntimeError("the run logged no eval")
    return evals[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench diloco", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="link rate of every host (tc syntax)")
    p.add_argument("--preset", default="small", help="model.preset (small: 31M parameters, 126 MB of fp32 gradients)")
    p.add_argument("--batch", type=int, default=2, help="samples per host per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=100, help="steps of each cluster run (a multiple of --inner-steps)")
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument("--wire", default="int8", help="dist.outer_wire")
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.5,
                   help="0.5 for a run of a few rounds (0.9, the paper's, needs many; see README)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--solo-steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=3, help="warmup steps left out of the solo and DDP rates")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--subnet", default="10.77.51")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args(argv)
    n, h = args.hosts, args.inner_steps
    if n < 2:
        p.error("--hosts must be >= 2")
    if args.steps % h or args.steps < 2 * h:
        p.error(f"--steps must be a multiple of --inner-steps ({h}), at least two rounds")

    from ..rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        print(f"bench diloco: cannot build namespace hosts: {why}", file=sys.stderr)
        return 2
    common = [*BASE, f"model.preset={args.preset}", f"data.seq_len={args.seq_len}", f"train.batch_size={args.batch}",
              f"train.lr={args.lr}", f"train.eval_batches={args.eval_batches}", *args.overrides]
    cluster_args = [*common, f"train.steps={args.steps}", f"train.eval_every={args.steps}"]
    diloco_args = ["dist.mode=diloco", f"dist.inner_steps={h}", f"dist.outer_wire={args.wire}",
                   f"dist.fragments={args.fragments}", f"dist.outer_lr={args.outer_lr}",
                   f"dist.outer_momentum={args.outer_momentum}"]
    set_env()
    t_start = time.perf_counter()
    result: dict = {"hosts": n, "rate": args.rate, "preset": args.preset, "batch_per_host": args.batch,
                    "seq_len": args.seq_len, "steps": args.steps, "inner_steps": h, "wire": args.wire,
                    "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    with tempfile.TemporaryDirectory(prefix="mlxdlc-") as tmp, SimCluster(
        n, name="mlxdlc", subnet=args.subnet, state_dir=Path(tmp) / "cluster", rate=args.rate
    ) as cluster:
        solo_args = [*common, f"train.steps={args.solo_steps}", "train.eval_every=0"]
        before = solo_rates(cluster, solo_args, Path(tmp), "before", args.skip, args.timeout)
        ddp = cluster_run(cluster, cluster_args, Path(tmp) / "ddp", args.timeout)
        dlc = cluster_run(cluster, [*cluster_args, *diloco_args], Path(tmp) / "diloco", args.timeout)
        after = solo_rates(cluster, solo_args, Path(tmp), "after", args.skip, args.timeout)

    bound = sum((a + b) / 2 for a, b in zip(before, after, strict=True))
    ddp_rate, dlc_rate = steady_rate(ddp, args.skip), steady_rate(dlc, h)  # whole rounds, their syncs included
    ddp_loss, dlc_loss = _eval_loss(ddp), _eval_loss(dlc)
    tokens = args.steps * n * args.batch * args.seq_len
    result |= {
        "solo_before": before, "solo_after": after, "bound": bound,
        "ddp": {"samples_per_s": ddp_rate, "fraction_of_bound": ddp_rate / bound, "eval_loss": ddp_loss,
                "compute_s": _median(ddp, "step", "compute_s"), "sync_s": _median(ddp, "step", "sync_s"),
                "sync_bytes_per_step": _median(ddp, "step", "sync_bytes")},
        "diloco": {"samples_per_s": dlc_rate, "fraction_of_bound": dlc_rate / bound, "eval_loss": dlc_loss,
                   "compute_s": _median(dlc, "step", "compute_s"),
                   "outer_sync_s": _median(dlc, "outer_sync", "seconds"),
                   "outer_sync_bytes": _median(dlc, "outer_sync", "bytes")},
        "eval_loss_ratio": dlc_loss / ddp_loss, "tokens": tokens,
    }
    d, q = result["ddp"], result["diloco"]
    print(f"hosts {n} at {args.rate}, model {args.preset}, {args.batch} x {args.seq_len} tokens per host per step, "
          f"{args.steps} steps ({tokens} tokens); no-communication bound {bound:.2f} samples/s "
          f"(solo {', '.join(f'{x:.2f}' for x in before)} before, {', '.join(f'{x:.2f}' for x in after)} after)")
    print("| mode | samples/s | of bound | eval loss | per step |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| DDP | {ddp_rate:.2f} | {d['fraction_of_bound']:.3f} | {ddp_loss:.4f} | compute {d['compute_s']:.3f}s, "
          f"all-reduce {d['sync_s']:.3f}s of {d['sync_bytes_per_step'] / 1e6:.0f} MB |")
    print(f"| DiLoCo H={h} {args.wire} mu={args.outer_momentum:g} | {dlc_rate:.2f} | {q['fraction_of_bound']:.3f} | {dlc_loss:.4f} "
          f"({dlc_loss / ddp_loss - 1:+.1%}) | compute {q['compute_s']:.3f}s; outer sync {q['outer_sync_s']:.3f}s "
          f"of {q['outer_sync_bytes'] / 1e6:.0f} MB every {h} steps |")
    print(f"DiLoCo: {dlc_rate / ddp_rate:.2f}x DDP's throughput (target >= 0.9 of bound); eval loss within "
          f"{abs(dlc_loss / ddp_loss - 1):.1%} of DDP's (target 3%)")
    return finish("diloco", result, t_start, args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
