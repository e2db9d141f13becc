"""DiLoCo vs plain data parallel on slow links: does `dist.mode=diloco` get the
throughput a slow link takes from DDP back, at the same quality?

N namespace hosts joined by links capped at `--rate` (default 1 Gbit/s) train the same
model on the same sample stream: every host alone (all at once, before and after: the
no-communication bound is the sum of their rates), then all together with DDP (one
gradient all-reduce per step), then with DiLoCo (one pseudo-gradient exchange per
`--inner-steps`). Both cluster runs train the same number of steps on the same global
batch, so their final eval losses compare at equal tokens. The model is chosen so that
DDP spends most of each step in the all-reduce: that is the case DiLoCo exists for.

Unequal hosts (`--slow X`: the last host computes X times slower, the rig's compute
scale) with `--wall SECONDS`: every cluster run trains for the same wall time (stopped by
a signal, which lands where the ranks meet: a round's end), and `--box SECONDS` adds
time-boxed DiLoCo (`dist.sync_every_s`), where the fast host does more inner steps per
round instead of waiting; the eval losses then compare at equal wall time, and each run's
bound comes from solo rates taken just before and just after it.

`--outer-cost` measures item by item what one outer sync costs on a bigger model (the
SmolLM2-135M shape by default) against its link time: the encode, the exchange, the outer
step, the weight copies, blocking and overlapped (`dist.overlap_steps`).

    python -m mlxdist.bench diloco
    python -m mlxdist.bench diloco --hosts 3 --json out.json
    python -m mlxdist.bench diloco --slow 2 --wall 120 --box 8
    python -m mlxdist.bench diloco --outer-cost
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cluster.world import find_mpirun
from .runs import (
    REPO,
    bracketing_bounds,
    check,
    cluster_run,
    finish,
    read_events,
    set_env,
    solo_rates,
    steady_rate,
)

BASE = ["metrics.port=0", "train.progress=false", "checkpoint.every=0", "dist.sync_weights_every=0",
        "train.warmup_steps=2", "train.log_every=1000"]
# SmolLM2-135M's shape (30 layers, dim 576, 9/3 heads, vocab 49152, tied): 134.5M parameters.
SHAPE_135M = ["model.dim=576", "model.n_layers=30", "model.n_heads=9", "model.n_kv_heads=3", "model.ffn_dim=1536",
              "model.vocab_size=49152"]


def _median(events: list[dict], kind: str, key: str) -> float:
    values = [e[key] for e in events if e["event"] == kind]
    return statistics.median(values) if values else 0.0


def _eval_loss(events: list[dict]) -> float:
    evals = [e["eval_loss"] for e in events if e["event"] == "eval"]
    if not evals:
        raise RuntimeError("the run logged no eval")
    return evals[-1]


def _rank_events(run_dir: Path, n: int) -> list[list[dict]]:
    return [read_events(run_dir, r) for r in range(n)]


def cluster_rate(run_dir: Path, n: int, skip: int) -> tuple[float, float, dict[str, list[int]]]:
    """(samples/s of the whole cluster, seconds, inner steps per rank) from every rank's step
    events after the first `skip` steps (or, for DiLoCo, after its first round: the time box
    times the hosts in it). Every rank counts the samples it trained on itself: under a time
    box the ranks train on different numbers of steps."""
    ranks = _rank_events(run_dir, n)
    rounds = [e for e in ranks[0] if e["event"] == "diloco_round"]
    steps0 = [e for e in ranks[0] if e["event"] == "step"]
    start = rounds[0]["time"] if rounds else steps0[min(skip, len(steps0) - 1)]["time"]
    end = max(e["time"] for ev in ranks for e in ev if e["event"] == "step")
    samples = sum(e["samples"] for ev in ranks for e in ev if e["event"] == "step" and start < e["time"] <= end)
    inner = {"per_rank": [sum(1 for e in ev if e["event"] == "step") for ev in ranks]}
    return samples / max(end - start, 1e-9), end - start, inner


def timed_cluster_run(cluster, args: list[str], run_dir: Path, wall: float, timeout: float) -> list[dict]:
    """One mpirun job stopped `wall` seconds after its first step (SIGUSR1, which mpirun
    forwards: every rank stops where they next meet, evaluates and saves); rank 0's events."""
    n = len(cluster.hosts)
    cmd = [find_mpirun(), *cluster.mpirun_args(env=["OPENBLAS_NUM_THREADS"]), "-np", str(n),
           sys.executable, "-m", "mlxdist.train", *args, "train.steps=1000000", "train.eval_every=1000000",
           f"train.out_dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline, first = time.monotonic() + timeout, None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if first is None and any(e["event"] == "step" for e in read_events(run_dir)):
                first = time.monotonic()
            if first is not None and time.monotonic() - first >= wall:
                proc.send_signal(signal.SIGUSR1)
                break
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 60))
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    check(subprocess.CompletedProcess(cmd, proc.returncode, out, ""), f"{n}-rank run ({run_dir.name})")
    return read_events(run_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench diloco", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="namespace hosts, one rank each (needs root)")
    p.add_argument("--rate", default="1gbit", help="link rate of every host (tc syntax)")
    p.add_argument("--preset", default="small", help="model.preset (small: 31M parameters, 126 MB of fp32 gradients), "
                   "or 135m: the SmolLM2-135M shape")
    p.add_argument("--batch", type=int, default=2, help="samples per host per step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample")
    p.add_argument("--steps", type=int, default=100, help="steps of each cluster run (a multiple of --inner-steps)")
    p.add_argument("--inner-steps", type=int, default=25, help="dist.inner_steps (H) of the step-counted run")
    p.add_argument("--wire", default="int8", help="dist.outer_wire")
    p.add_argument("--fragments", type=int, default=1, help="dist.fragments (streaming DiLoCo)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="dist.outer_lr")
    p.add_argument("--outer-momentum", type=float, default=0.5,
                   help="0.5 for a run of a few rounds (0.9, the paper's, needs many; see docs/tuning.md)")
    p.add_argument("--lr", type=float, default=1e-3, help="train.lr (inner AdamW)")
    p.add_argument("--solo-steps", type=int, default=12, help="steps of each host alone (the bound)")
    p.add_argument("--skip", type=int, default=3, help="warmup steps left out of the solo and DDP rates")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches of the final eval")
    p.add_argument("--slow", type=float, default=1.0, help="the last host computes this many times slower")
    p.add_argument("--wall", type=float, default=None,
                   help="seconds of training per cluster run (equal wall time) instead of --steps")
    p.add_argument("--box", type=float, default=None, help="with --wall: add time-boxed DiLoCo, dist.sync_every_s")
    p.add_argument("--box-first", type=int, default=5,
                   help="dist.inner_steps of the time-boxed run: its first round, which times the hosts")
    p.add_argument("--outer-cost", action="store_true", help="measure one outer sync's parts on --cost-model")
    p.add_argument("--cost-rounds", type=int, default=3, help="--outer-cost: rounds of --inner-steps per run")
    p.add_argument("--overlap", type=int, default=None,
                   help="dist.overlap_steps of every DiLoCo run (--outer-cost: of its overlapped run, default 2)")
    p.add_argument("--modes", default="ddp,h,box", help="with --wall: which of ddp, h (H steps), box (--box) to run")
    p.add_argument("--reference", action="store_true",
                   help="with --wall: DDP's eval loss at the DiLoCo runs' tokens, from a DDP run on unshaped links")
    p.add_argument("--subnet", default="10.77.51", help="namespace cluster subnet (first three octets)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args(argv)
    n, h = args.hosts, args.inner_steps
    if n < 2:
        p.error("--hosts must be >= 2")
    if args.box is not None and args.wall is None:
        p.error("--box needs --wall: a time-boxed run compares with the others at equal wall time")
    if args.wall is None and not args.outer_cost and (args.steps % h or args.steps < 2 * h):
        p.error(f"--steps must be a multiple of --inner-steps ({h}), at least two rounds")

    from ..rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        print(f"bench diloco: cannot build namespace hosts: {why}", file=sys.stderr)
        return 2
    set_env()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mlxdlc-") as tmp, SimCluster(
        n, name="mlxdlc", subnet=args.subnet, state_dir=Path(tmp) / "cluster", rate=args.rate
    ) as cluster:
        if args.slow != 1.0:
            cluster.slow_compute(n, args.slow)
        if args.outer_cost:
            result = outer_cost(cluster, args, Path(tmp))
        elif args.wall is not None:
            result = equal_wall_time(cluster, args, Path(tmp))
        else:
            result = equal_steps(cluster, args, Path(tmp))
    return finish("diloco", result, t_start, args.json)


def _model(args) -> list[str]:
    return ["model.preset=small", *SHAPE_135M] if args.preset == "135m" else [f"model.preset={args.preset}"]


def _common(args) -> list[str]:
    return [*BASE, *_model(args), f"data.seq_len={args.seq_len}", f"train.batch_size={args.batch}",
            f"train.lr={args.lr}", f"train.eval_batches={args.eval_batches}", *args.overrides]


def _diloco(args) -> list[str]:
    return ["dist.mode=diloco", f"dist.inner_steps={args.inner_steps}", f"dist.outer_wire={args.wire}",
            f"dist.fragments={args.fragments}", f"dist.outer_lr={args.outer_lr}",
            f"dist.outer_momentum={args.outer_momentum}", *([f"dist.overlap_steps={args.overlap}"] * bool(args.overlap))]


def _settings(args) -> dict:
    return {"hosts": args.hosts, "rate": args.rate, "preset": args.preset, "batch_per_host": args.batch,
            "seq_len": args.seq_len, "inner_steps": args.inner_steps, "wire": args.wire, "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum, "slow": args.slow, "overlap_steps": args.overlap or 0}


def equal_steps(cluster, args, tmp: Path) -> dict:
    n, h = args.hosts, args.inner_steps
    common = _common(args)
    cluster_args = [*common, f"train.steps={args.steps}", f"train.eval_every={args.steps}"]
    solo_args = [*common, f"train.steps={args.solo_steps}", "train.eval_every=0"]
    before = solo_rates(cluster, solo_args, tmp, "before", args.skip, args.timeout)
    ddp = cluster_run(cluster, cluster_args, tmp / "ddp", args.timeout)
    dlc = cluster_run(cluster, [*cluster_args, *_diloco(args)], tmp / "diloco", args.timeout)
    after = solo_rates(cluster, solo_args, tmp, "after", args.skip, args.timeout)

    bound = sum((a + b) / 2 for a, b in zip(before, after, strict=True))
    ddp_rate, dlc_rate = steady_rate(ddp, args.skip), steady_rate(dlc, h)  # whole rounds, their syncs included
    ddp_loss, dlc_loss = _eval_loss(ddp), _eval_loss(dlc)
    tokens = args.steps * n * args.batch * args.seq_len
    result = _settings(args) | {
        "steps": args.steps, "solo_before": before, "solo_after": after, "bound": bound,
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
    print(f"| DiLoCo H={h} {args.wire} mu={args.outer_momentum:g} | {dlc_rate:.2f} | {q['fraction_of_bound']:.3f} | "
          f"{dlc_loss:.4f} ({dlc_loss / ddp_loss - 1:+.1%}) | compute {q['compute_s']:.3f}s; outer sync "
          f"{q['outer_sync_s']:.3f}s of {q['outer_sync_bytes'] / 1e6:.0f} MB every {h} steps |")
    print(f"DiLoCo: {dlc_rate / ddp_rate:.2f}x DDP's throughput (target >= 0.9 of bound); eval loss within "
          f"{abs(dlc_loss / ddp_loss - 1):.1%} of DDP's (target 3%)")
    return result


def equal_wall_time(cluster, args, tmp: Path) -> dict:
    """DDP, step-counted DiLoCo and (with --box) time-boxed DiLoCo, each trained for --wall
    seconds; rates over their steady part (after DDP's warmup, after DiLoCo's first round),
    counted from every rank's own steps."""
    n, h = args.hosts, args.inner_steps
    common = _common(args)
    solo_args = [*common, f"train.steps={args.solo_steps}", "train.eval_every=0"]
    # Ranks meet (and a stop lands) where rounds end, so every run stops on the agreed model.
    wanted = set(args.modes.split(","))
    modes = {}
    if "ddp" in wanted:
        modes["ddp"] = []
    if "h" in wanted:
        modes[f"diloco H={h}"] = [*_diloco(args), f"control.balance_interval={h}"]
    if "box" in wanted and args.box is not None:
        modes[f"diloco box {args.box:g}s"] = [*_diloco(args), f"dist.sync_every_s={args.box}",
                                              f"dist.inner_steps={args.box_first}"]
    solos = [solo_rates(cluster, solo_args, tmp, "before", args.skip, args.timeout)]
    runs = {}
    for i, (name, extra) in enumerate(modes.items()):
        events = timed_cluster_run(cluster, [*common, *extra], tmp / f"run{i}", args.wall, args.timeout)
        rate, seconds, inner = cluster_rate(tmp / f"run{i}", n, args.skip)
        rounds = [e for e in events if e["event"] == "diloco_round"]
        runs[name] = {"samples_per_s": rate, "steady_seconds": seconds, "eval_loss": _eval_loss(events),
                      "samples": sum(e["samples"] for r in range(n) for e in read_events(tmp / f"run{i}", r)
                                     if e["event"] == "step"),
                      "steps": max(e["step"] for e in events if e["event"] == "step"), "inner_steps": inner["per_rank"],
                      "compute_s": _median(events, "step", "compute_s"),
                      "outer_sync_s": _median(events, "outer_sync", "seconds"),
                      "outer_sync_main_s": _median(events, "outer_sync", "main_s"),
                      "round_inner_steps": [e["inner_steps"] for e in rounds],
                      "round_waited_s": [max(e["waited_s"]) for e in rounds if "waited_s" in e]}
        solos.append(solo_rates(cluster, solo_args, tmp, f"after{i}", args.skip, args.timeout))
    bound = sum(statistics.mean(rates) for rates in zip(*solos, strict=True))
    for r, own in zip(runs.values(), bracketing_bounds(solos), strict=True):
        r["bound"], r["fraction_of_bound"], r["fraction_of_run_bound"] = own, r["samples_per_s"] / own, r["samples_per_s"] / bound
    print(f"hosts {n} at {args.rate}, host {n} computes x{args.slow:g} slower, model {args.preset}, {args.batch} x "
          f"{args.seq_len} tokens per host per step, {args.wall:g}s of training per run; no-communication bound "
          f"{bound:.2f} samples/s over the run (solo rates before each mode and after the last: "
          f"{'; '.join(', '.join(f'{x:.2f}' for x in s) for s in solos)})")
    print("| mode | samples/s | of bound (solo just before and after it) | of the run's bound | "
          "eval loss at equal wall time | steps | inner steps per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        print(f"| {name} | {r['samples_per_s']:.2f} | {r['fraction_of_bound']:.3f} ({r['bound']:.2f}/s) | "
              f"{r['fraction_of_run_bound']:.3f} | {r['eval_loss']:.4f} | {r['steps']} | {r['inner_steps']} |")
    reference = _reference(cluster, args, common, runs, tmp) if args.reference else None
    for name, r in runs.items():
        if r["round_waited_s"]:
            print(f"{name}: inner steps per round {r['round_inner_steps']}; longest wait at each sync "
                  f"{', '.join(f'{w:.2f}' for w in r['round_waited_s'])} s")
    return _settings(args) | {"wall": args.wall, "box": args.box, "solo": solos, "bound": bound, "runs": runs,
                              "reference": reference}


def _reference(cluster, args, common: list[str], runs: dict, tmp: Path) -> dict:
    """DDP's eval loss at the tokens each run trained: the loss does not depend on the link, so
    it comes from a DDP run with the links unshaped (evaluated every eighth of the way to the most
    tokens any run trained), where the shaped DDP run trains too few steps to compare."""
    n = args.hosts
    per_step = n * args.batch
    steps = max(1, round(max(r["samples"] for r in runs.values()) / per_step))
    every = max(1, steps // 8)
    steps = -(-steps // every) * every
    for h in range(1, n + 1):
        cluster.shape(h, None)
    try:
        events = cluster_run(cluster, [*common, f"train.steps={steps}", f"train.eval_every={every}"],
                             tmp / "reference", args.timeout)
    finally:
        for h in range(1, n + 1):
            cluster.shape(h, args.rate)
    evals = {e["step"]: e["eval_loss"] for e in events if e["event"] == "eval"}
    print(f"DDP reference (links unshaped, {per_step} samples a step, eval every {every} steps): "
          + ", ".join(f"step {s}: {v:.4f}" for s, v in sorted(evals.items())))
    out = {"samples_per_step": per_step, "evals": evals, "at_tokens": {}}
    for name, r in runs.items():
        step = min(evals, key=lambda s: abs(s * per_step - r["samples"]))
        out["at_tokens"][name] = {"samples": r["samples"], "ddp_samples": step * per_step, "ddp_eval_loss": evals[step],
                                  "eval_loss": r["eval_loss"], "ratio": r["eval_loss"] / evals[step]}
        print(f"{name}: {r['samples']} samples trained, eval loss {r['eval_loss']:.4f}; DDP at {step * per_step} "
              f"samples {evals[step]:.4f} ({r['eval_loss'] / evals[step] - 1:+.1%})")
    return out


def outer_cost(cluster, args, tmp: Path) -> dict:
    """The same DiLoCo run of the 135M shape, blocking and overlapped: what each outer sync
    costs the training thread, against its link time and the round it ends."""
    n, h = args.hosts, args.inner_steps
    steps = h * args.cost_rounds
    common = [*BASE, "model.preset=small", *SHAPE_135M, f"data.seq_len={args.seq_len}", "train.batch_size=1",
              f"train.lr={args.lr}", "train.eval_every=0", f"train.steps={steps}", *_diloco(args),
              f"control.balance_interval={h}", *args.overrides]
    rate_bps = _bits_per_s(args.rate)
    result = _settings(args) | {"model": "SmolLM2-135M shape", "steps": steps, "runs": {}}
    lag = args.overlap or 2
    for name, extra in (("blocking", []), (f"overlapped {lag} steps", [f"dist.overlap_steps={lag}"])):
        events = cluster_run(cluster, [*common, *extra], tmp / name.split()[0], args.timeout)
        syncs = [e for e in events if e["event"] == "outer_sync"][1:] or [e for e in events if e["event"] == "outer_sync"]
        steps_ev = [e for e in events if e["event"] == "step"]
        sync_steps = {e["step"] for e in events if e["event"] == "outer_sync"}
        plain = [e["step_s"] for e in steps_ev if e["step"] not in sync_steps and e["step"] > 1]
        t_step = statistics.median(plain)
        main = statistics.median(e["main_s"] for e in syncs)
        payload = statistics.median(e["bytes"] for e in syncs)
        wire = (n - 1) * payload * 8 / rate_bps
        r = {"inner_step_s": t_step, "main_s": main, "exchange_s": statistics.median(e["seconds"] for e in syncs),
             "prepare_s": statistics.median(e["prepare_s"] for e in syncs),
             "outer_step_s": statistics.median(e["outer_s"] for e in syncs), "payload_bytes": payload,
             "waited_s": statistics.median(e["wait_s"] for e in syncs),
             "link_s": wire, "round_s": h * t_step + main}
        r["fraction_of_round"] = main / r["round_s"]
        result["runs"][name] = r
    params = 134_515_008
    print(f"outer sync of a {params / 1e6:.1f}M-parameter model ({args.wire} wire, {n} hosts at {args.rate}), "
          f"H={h} inner steps per round, medians of {args.cost_rounds} rounds:")
    print("| mode | training thread per sync | waiting for the sync thread | encode | exchange (wire + decode + "
          "waiting for the peer) | outer step | link time (payload / rate) | inner step | round | sync / round |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in result["runs"].items():
        print(f"| {name} | {r['main_s']:.2f}s | {r['waited_s']:.2f}s | {r['prepare_s']:.2f}s | {r['exchange_s']:.2f}s "
              f"| {r['outer_step_s']:.2f}s | {r['link_s']:.2f}s ({r['payload_bytes'] / 1e6:.0f} MB) "
              f"| {r['inner_step_s']:.2f}s | {r['round_s']:.1f}s | {r['fraction_of_round']:.1%} |")
    print("(blocking: the training thread does all of it; overlapped: encode, exchange and outer step run on the "
          "sync thread, and the training thread hands the weights over and mixes the new anchors in)")
    return result


def _bits_per_s(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return float(rate)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
