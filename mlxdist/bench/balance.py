"""Load-balancing benchmark: does `control.balance` recover the throughput a slow rank wastes?

N namespace hosts (default 2), the last one slowed 2x, train the same fixed global batch
in one invocation: every host alone (all at once, before, between and after the rest: its
solo rate), all together with the equal split, all together with the balancer on, and
all together at the best fixed split the solo runs point to (the balancer's oracle). The
ideal is the sum of the solo rates taken just before and after a cluster run (no rank ever
waits); balancing is worth having if it gets close to that while the equal split is held to
N times the slow host's rate. The oracle run separates the balancer's own loss (balanced
against oracle) from what lockstep steps cost on this machine (oracle against ideal: a step
lasts as long as its slowest rank's compute that step, and this VM's compute jitters).
Everything runs side by side in one process run, because only ratios measured together
mean anything on a shared machine.

Two ways to slow a host (`--mode`):
  compute (default)  the host's forward/backward takes X times as long, its CPU stays free
                     (`simcluster slow --compute X`): a Mac with a slower GPU. Every host is
                     stretched by a base factor too, so all ranks together need about one
                     of this machine's cores and neighbours' load disturbs them less.
  cpu                CFS quotas (`simcluster slow --cpu P`): communication and Open MPI's
                     busy-wait are throttled too, so a fast host waiting for a slow one
                     burns its own quota; harsher than any real Mac, kept as a stress case.

    python -m mlxdist.bench balance
    python -m mlxdist.bench balance --hosts 3
    python -m mlxdist.bench balance --mode cpu --steps 60 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .runs import (
    bracketing_bounds,
    cluster_run,
    finish,
    read_events,
    set_env,
    solo_rates,
    steady_rate,
)

# Compute must dominate the gradient all-reduce, or no split can reach the ideal.
BASE = ["data.source=synthetic", "data.seq_len=128", "model.preset=tiny", "metrics.port=0",
        "train.progress=false", "train.eval_every=0", "checkpoint.every=0",
        "dist.sync_weights_every=0", "train.warmup_steps=2"]


def compute_times(run_dir: Path, rank: int) -> list[float]:
    """Forward/backward seconds of one rank, step by step, from its own event log: what
    the balancer reads (kept in the JSON, so its decisions can be replayed offline)."""
    return [e["compute_s"] for e in read_events(run_dir, rank) if e["event"] == "step"]


def median_compute(run_dir: Path, rank: int, skip: int) -> float:
    """Median forward/backward seconds of one rank over its steps after `skip`."""
    return statistics.median(compute_times(run_dir, rank)[skip:])


def whole_split(total: int, weights: list[float]) -> list[int]:
    """`total` in whole samples as near `weights` as rounding allows (largest remainder)."""
    exact = [total * w / sum(weights) for w in weights]
    split = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: split[i] - exact[i])[:total - sum(split)]:
        split[i] += 1
    return split


def lockstep_cost(computes: list[list[float]]) -> float:
    """How much longer a lockstep step is than the slowest rank's mean compute, from
    compute jitter alone: mean over steps of the slowest rank that step, against the
    slowest rank's mean (0 with no jitter)."""
    slowest_each = [max(c) for c in zip(*computes, strict=True)]
    return statistics.fmean(slowest_each) / max(statistics.fmean(c) for c in computes) - 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench balance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="namespace hosts; the last one is slowed")
    p.add_argument("--mode", choices=("compute", "cpu"), default="compute",
                   help="slow the last host by stretching its compute, or by a CPU quota")
    p.add_argument("--slow-factor", type=float, default=2.0,
                   help="compute mode: how many times slower the last host computes")
    p.add_argument("--base-scale", type=float, default=None,
                   help="compute mode: stretch of every host's compute (default (hosts+1)/2, "
                        "so the cluster needs about one core whatever its size)")
    p.add_argument("--global-batch", type=int, default=None, help="default 24 x hosts")
    p.add_argument("--steps", type=int, default=45, help="steps of the cluster runs")
    p.add_argument("--solo-steps", type=int, default=14, help="steps of each host alone (its solo rate)")
    p.add_argument("--skip", type=int, default=4, help="warmup steps left out of solo/equal rates")
    p.add_argument("--balance-skip", type=int, default=20,
                   help="steps left out of the balanced rate: warmup plus the balancer settling")
    # Quotas well under a core: on a small shared machine an uncapped or 100% host gets
    # whatever its neighbours leave, so the 2x speed gap would not be what we set.
    p.add_argument("--fast-cpu", type=float, default=60.0, help="cpu mode: quota of the other hosts, %% of a core")
    p.add_argument("--slow-cpu", type=float, default=30.0, help="cpu mode: quota of the last host, %% of a core")
    p.add_argument("--subnet", default="10.77.41", help="namespace cluster subnet (first three octets)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args(argv)
    n = args.hosts
    if n < 2:
        p.error("--hosts must be >= 2")
    if args.slow_factor < 1 or (args.base_scale is not None and args.base_scale < 1):
        p.error("--slow-factor and --base-scale must be >= 1")

    from ..rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        print(f"bench balance: cannot build namespace hosts: {why}", file=sys.stderr)
        return 2
    g = args.global_batch or 24 * n
    base = args.base_scale if args.base_scale is not None else (n + 1) / 2
    # One micro-batch per rank whatever the split: accumulation would add per-micro-batch
    # overhead that depends on the share and blur the speed the balancer measures.
    common = [*BASE, f"train.batch_size={g}", f"train.global_batch={g}", *args.overrides]
    set_env()
    t_start = time.perf_counter()
    result: dict = {"hosts": n, "mode": args.mode, "global_batch": g, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="mlxbal-") as tmp, SimCluster(
        n, name="mlxbal", subnet=args.subnet, state_dir=Path(tmp) / "cluster"
    ) as cluster:
        if args.mode == "compute":
            speeds = {h: base for h in range(1, n)} | {n: base * args.slow_factor}
            for h, x in speeds.items():
                cluster.slow_compute(h, x)
            how = {h: f"compute x{x:g}" for h, x in speeds.items()}
        else:
            quotas = {h: args.fast_cpu for h in range(1, n)} | {n: args.slow_cpu}
            for h, q in quotas.items():
                cluster.slow(h, q)
            how = {h: f"{q:g}% cpu" for h, q in quotas.items()}
        result["hosts_setup"] = {cluster.hostname(h): v for h, v in how.items()}

        def solos(tag: str) -> list[float]:
            return solo_rates(cluster, [*common, f"train.steps={args.solo_steps}"], Path(tmp), tag, args.skip,
                              args.timeout)

        def solo_compute(tag: str) -> list[float]:
            return [median_compute(Path(tmp) / f"solo-{tag}-{h}", 0, args.skip) for h in range(1, n + 1)]

        def together(name: str, balance: bool, split: list[int] | None = None) -> list[dict]:
            entries = ", ".join(f"rank{r}: {{batch_size: {b}}}" for r, b in enumerate(split or []))
            fixed = [f"nodes={{{entries}}}"] if split else []
            return cluster_run(cluster, [*common, *fixed, f"train.steps={args.steps}",
                                         f"control.balance={'true' if balance else 'false'}"], Path(tmp) / name,
                               args.timeout)

        before = solos("before")
        compute_before = solo_compute("before")
        equal_events = together("equal", balance=False)
        equal = steady_rate(equal_events, args.skip)
        equal_shares = [e for e in equal_events if e["event"] == "step"][-1]["shares"]
        between = solos("between")
        compute_between = solo_compute("between")
        bal_events = together("balanced", balance=True)
        after = solos("after")
        compute_after = solo_compute("after")
        # The oracle: no balancer, each rank's share fixed where the solo runs say every
        # rank's compute ends together.
        solo_per_sample = [statistics.fmean(c) / g for c in zip(compute_before, compute_between, compute_after,
                                                                 strict=True)]
        best_split = whole_split(g, [1 / c for c in solo_per_sample])
        fixed_events = together("fixed", balance=False, split=best_split)
        last = solos("last")
        # Load from other jobs drifts over minutes: each cluster run is held to the solo
        # rates taken just before and just after it, and all of them are printed.
        ideal_equal, ideal, ideal_fixed = bracketing_bounds([before, between, after, last])
        solo_mean = [(a + b) / 2 for a, b in zip(between, after, strict=True)]
        print("solo: " + ", ".join(f"host {h} ({how[h]}) {b:.1f}, {m:.1f}, {a:.1f}, {z:.1f}"
                                   for h, b, m, a, z in zip(range(1, n + 1), before, between, after, last, strict=True))
              + f" samples/s (before, between, after, last); ideal around the equal run {ideal_equal:.1f}, "
              f"the balanced run {ideal:.1f}, the fixed run {ideal_fixed:.1f} samples/s", flush=True)
        print(f"equal split: {equal:.1f} samples/s = {equal / ideal_equal:.3f} of ideal "
              f"(shares {equal_shares})", flush=True)
        balanced = steady_rate(bal_events, args.balance_skip)
        steps = [e for e in bal_events if e["event"] == "step"]
        changes = [e for e in bal_events if e["event"] == "balance"]
        history = ", ".join(f"step {e['step']}: {e['old']} -> {e['new']}" for e in changes)
        print(f"balanced: {balanced:.1f} samples/s = {balanced / ideal:.3f} of ideal "
              f"(target >= 0.95); {balanced / equal:.2f}x the equal split's rate", flush=True)
        # A step event carries the split decided after it, so step k ran on event k-1's; the
        # final split is the one the last step ran on (a decision after it never ran).
        ran_on = [None, *[e["shares"] for e in steps[:-1]]]
        final, unrun = ran_on[-1] or steps[-1]["shares"], steps[-1]["shares"]
        want = [round(g * r / ideal, 1) for r in solo_mean]
        # The split that would finish every host's forward/backward at once if its time
        # were proportional to its share: the solo step rates also hold the optimizer
        # step, which the rig does not slow, so the two references differ.
        per_sample = [(b + a) / 2 / g for b, a in zip(compute_between, compute_after, strict=True)]
        equal_finish = [round(g * (1 / c) / sum(1 / c for c in per_sample), 1) for c in per_sample]
        at_final = [k for k, sh in enumerate(ran_on) if sh == final and k >= args.balance_skip]
        final_compute = [statistics.median(compute_times(Path(tmp) / "balanced", r)[k] for k in at_final)
                         if at_final else float("nan") for r in range(n)]
        kept = steps[args.balance_skip:]
        sync = statistics.median(e["sync_s"] / e["step_s"] for e in kept) if kept else 0.0
        off = max(abs(f - w) / w for f, w in zip(final, want, strict=True))
        print(f"final shares {final} of {g} (proportional to solo speed: {want}, largest gap {off:.0%}; "
              f"equal finish by solo compute: {equal_finish}); {len(changes)} change(s): {history or 'none'}"
              + (f" (the last, {unrun}, decided after the final step, never ran)" if unrun != final else "")
              + f"; sync {sync:.1%} of a step")
        # What separates the balanced rate from the ideal: time per sample at the smaller
        # shares (versus the whole batch alone), and the step beyond its slowest rank's compute.
        final_per_sample = [c / sh for c, sh in zip(final_compute, final, strict=True)]
        final_step = (statistics.median(steps[k]["step_s"] for k in at_final) if at_final else float("nan"))
        print("compute at the final split: " + ", ".join(
            f"rank {r} {c:.3f} s, {1000 * ps:.1f} ms/sample ({ps / solo - 1:+.0%} on its solo {1000 * solo:.1f})"
            for r, (c, ps, solo) in enumerate(zip(final_compute, final_per_sample, per_sample, strict=True)))
            + f"; step {final_step:.3f} s, the slowest rank's compute {max(final_compute) / final_step:.1%} of it",
            flush=True)
        fixed = steady_rate(fixed_events, args.skip)
        bal_computes = [compute_times(Path(tmp) / "balanced", r) for r in range(n)]
        fixed_computes = [compute_times(Path(tmp) / "fixed", r) for r in range(n)]
        jitter = [lockstep_cost([c[k:] for c in cs]) for cs, k in ((bal_computes, args.balance_skip),
                                                                   (fixed_computes, args.skip))]
        print(f"best fixed split {best_split} (every rank's solo compute ending together), no balancer: "
              f"{fixed:.1f} samples/s = {fixed / ideal_fixed:.3f} of ideal; the balancer reached "
              f"{balanced / ideal / (fixed / ideal_fixed):.3f} of that; compute jitter makes a lockstep step "
              f"{jitter[0]:+.1%} (balanced), {jitter[1]:+.1%} (fixed) longer than its slowest rank's mean compute",
              flush=True)
        result |= {"solo_before": before, "solo_between": between, "solo_after": after, "ideal": ideal,
                   "ideal_equal": ideal_equal, "equal": equal, "equal_ratio": equal / ideal_equal,
                   "balanced": balanced, "balanced_ratio": balanced / ideal,
                   "final_shares": final, "decided_after_last_step": unrun, "proportional": want, "proportional_gap": off,
                   "equal_finish_solo_compute": equal_finish, "final_compute_s": final_compute,
                   "final_per_sample_s": final_per_sample, "final_step_s": final_step,
                   "solo_last": last, "ideal_fixed": ideal_fixed, "best_fixed_split": best_split, "fixed": fixed,
                   "fixed_ratio": fixed / ideal_fixed, "balanced_vs_fixed": balanced / ideal / (fixed / ideal_fixed),
                   "lockstep_cost": {"balanced": jitter[0], "fixed": jitter[1]},
                   "solo_compute_s": [compute_before, compute_between, compute_after],
                   "balanced_compute_s": bal_computes, "fixed_compute_s": fixed_computes,
                   "balanced_shares": [e["shares"] for e in steps],
                   "changes": [{"step": e["step"], "old": e["old"], "new": e["new"]} for e in changes],
                   "sync_fraction": sync}
    return finish("balance", result, t_start, args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
