"""`python -m mlxdist.bench shard`: sharded data parallel (`dist.shard=optimizer`, ZeRO-1;
`dist.shard=gradients`, ZeRO-2; `dist.shard=weights`, ZeRO-3) against data parallel
(`dist.shard=none`), the built-in LM on N ranks of this host or N namespace hosts (MLX
engine), the modes interleaved within each of `--rounds` rounds.

Per mode and rank: MLX's peak and end-of-step active memory (the step events'
`memory_peak_bytes`, `memory_active_bytes`), AdamW state held (the `shard` event's
`optimizer_bytes_here`; data parallel: 8 bytes a parameter), its ratio to data parallel's
(target <= 1/N + 0.05), and the median step time over data parallel's in the same round.
ZeRO-3 also: what a rank holds between steps (end-of-step active memory) against its
shard's weights and moments (12 bytes a parameter it owns), and, between hosts, its exchange
against the link's limit for the bytes it moves (each stage's weights twice, its gradients
once, per micro-batch).

Then "doesn't fit": `MLXDIST_MEMORY_LIMIT_BYTES` set so that data parallel's memory plan does
not fit a rank's budget but ZeRO-1's does; `dist.shard=auto` must pick a sharded mode, train,
and match data parallel's losses (the round-1 run, unlimited). `dist.shard=none` under the
same limit is run too and what happens is reported (the planner warns in one line; the run
goes on, as the plan is an estimate).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cluster.world import find_mpirun
from .runs import REPO, check, finish, namespace_hosts, read_events, set_env

MODES = ("none", "optimizer", "gradients", "weights")
NAMES = {"none": "data parallel", "optimizer": "ZeRO-1", "gradients": "ZeRO-2", "weights": "ZeRO-3"}
MB = 1e6
PHASES = ("flatten", "reduce_scatter", "scalars", "norm", "update", "all_gather", "unpack")  # sharded.py's


def _launch(n: int, args: list[str], run_dir: Path, timeout: float, env: dict[str, str] | None = None,
            cluster=None):
    """The trainer on `n` ranks of this host, or of `cluster`'s namespace hosts (one rank each)."""
    extra = env or {}
    if cluster is None:
        flags = ["--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS",
                 *[x for k in extra for x in ("-x", k)]]
    else:
        flags = cluster.mpirun_args(env=["OPENBLAS_NUM_THREADS", *extra])
    cmd = [find_mpirun(), *flags, "-np", str(n), sys.executable, "-m", "mlxdist.train", *args,
           f"train.out_dir={run_dir}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=os.environ | extra)


def _read(run_dir: Path, n: int, skip: int) -> dict:
    """Per rank: step times, losses, memory; the shard event's bytes (None: data parallel)."""
    ranks = []
    for r in range(n):
        events = read_events(run_dir, r)
        steps = [e for e in events if e["event"] == "step"]
        if len(steps) <= skip:
            raise RuntimeError(f"{run_dir.name}: rank {r} logged {len(steps)} steps; need more than {skip}")
        kept = steps[skip:]
        shard = next((e for e in events if e["event"] == "shard"), None)
        ranks.append({"step_s": [e["step_s"] for e in kept], "loss": [e["loss"] for e in steps],
                      "sync_s": statistics.median(e.get("sync_s", 0.0) for e in kept),
                      "phases": _phases(events, kept),
                      "sync_bytes": statistics.median(e.get("sync_bytes", 0) for e in kept),
                      "active": statistics.median(e["memory_active_bytes"] for e in kept),
                      "peak": max(e["memory_peak_bytes"] for e in kept),
                      "optimizer_bytes": shard["optimizer_bytes_here"] if shard else None,
                      "mode": shard["mode"] if shard else "none"})
    shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint: GBs for a 100M model
    return {"ranks": ranks, "step_s": statistics.median(ranks[0]["step_s"])}


def _phases(events: list[dict], kept: list[dict]) -> dict[str, float]:
    """Median seconds a step by phase over the `kept` steps: compute (forward and backward),
    the sharded strategy's own phases (its `shard_phases` events: flatten, reduce_scatter,
    scalars, norm, update, all_gather, unpack) or data parallel's all-reduce (sync_s), and
    the rest of the step (the update in data parallel, the loop's own work)."""
    steps = {e["step"] for e in kept}
    by_step = {e["step"]: e for e in events if e["event"] == "shard_phases" and e["step"] in steps}
    out: dict[str, list[float]] = {}
    for e in kept:
        got = by_step.get(e["step"], {})
        parts = {k: got[k] for k in PHASES if k in got}
        parts = parts or {"all_reduce": e.get("sync_s", 0.0)}
        parts = {"compute": e.get("compute_s", 0.0), **parts}
        parts["rest"] = e["step_s"] - sum(parts.values())
        for k, v in parts.items():
            out.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in out.items()}


def link_seconds(owned: list[float], rate: str) -> float:
    """The least time a step's exchange can take over full-duplex links of `rate`, ring
    order: in the reduce-scatter the link out of rank r carries every element but rank r's
    own range, in the all-gather every element but rank r + 1's, and the all-gather starts
    after the update, so the two halves add up: 2 (total - smallest range) x 4 bytes (equal
    ranges: 2 (n - 1) / n of the gradients, an all-reduce's)."""
    from ..rig.simcluster import parse_rate

    if len(owned) < 2:
        return 0.0
    return 2 * (sum(owned) - min(owned)) * 4 * 8 / parse_rate(rate)


def zero3_link_seconds(owned: list[float], moved_bytes: float, rate: str) -> float:
    """ZeRO-3's least exchange time: a step moves `moved_bytes` (its `sync_bytes`: every
    stage's weights twice and gradients once), each ring collective's busiest link carrying
    all but the smallest range of it; the collectives run one after another."""
    from ..rig.simcluster import parse_rate

    if len(owned) < 2:
        return 0.0
    return moved_bytes * (1 - min(owned) / sum(owned)) * 8 / parse_rate(rate)




def _limit(common: list[str], n: int) -> tuple[int, dict]:
    """A memory limit under which data parallel's plan does not fit but ZeRO-1's does, from
    the trainer's own planner: midway between the two needs, over memory_target."""
    import socket

    from ..config import load_config
    from ..control.memory_plan import lm_facts, plan
    from ..sync.strategy import memory_lines

    cfg = load_config(None, [*common, "dist.shard=auto"])
    facts = lm_facts(cfg)
    host = socket.gethostname().split(".")[0]

    def at(limit: int):
        return plan(cfg, [(host, limit)] * n, facts.n_params, facts.activation_bytes_per_sample,
                    memory=memory_lines(), gather_params=facts.gather_params,
                    staged_act_per_sample=facts.staged_activation_bytes_per_sample)

    probe = at(2**40)
    need_none = max(b.total for b in probe.needs["none"])
    need_opt = max(b.total for b in probe.needs["optimizer"])
    target = probe.ranks[0].target
    limit = int((need_none + need_opt) / 2 / target)
    mp = at(limit)
    if mp.choice != "optimizer":
        raise RuntimeError(f"no limit separates data parallel from ZeRO-1 here (choice {mp.choice})")
    return limit, {"n_params": facts.n_params, "need_none_bytes": need_none, "need_optimizer_bytes": need_opt,
                   "budget_bytes": mp.ranks[0].budget}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench shard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="ranks on this host")
    p.add_argument("--simcluster", type=int, default=0, metavar="N",
                   help="run on N namespace hosts (one rank each) joined by links shaped to --rate (root)")
    p.add_argument("--rate", default="1gbit", help="with --simcluster: every host's link rate (tc syntax)")
    p.add_argument("--subnet", default="10.79.7", help="with --simcluster: the hosts' /24")
    p.add_argument("--preset", default="base", help="model.preset (base: 125M parameters)")
    p.add_argument("--batch", type=int, default=1, help="samples per rank per step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample")
    p.add_argument("--steps", type=int, default=6, help="steps per run")
    p.add_argument("--skip", type=int, default=2, help="warmup steps left out of the medians")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the modes interleaved within each")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated; none (data parallel) always runs")
    p.add_argument("--no-fit-demo", dest="demo", action="store_false", help="skip the memory-limit demo")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    args = p.parse_args(argv)
    modes = ["none", *[m for m in args.modes.split(",") if m and m != "none"]]
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: {m} is not one of {', '.join(MODES)}")
    if args.steps <= args.skip:
        p.error("--steps must exceed --skip")
    set_env()
    n = args.simcluster or args.ranks
    common = ["data.source=synthetic", f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
              f"train.batch_size={args.batch}", f"train.steps={args.steps}", "metrics.port=0",
              "train.progress=false", "train.eval_every=0", "checkpoint.every=0", "dist.sync_weights_every=0"]
    t_start = time.perf_counter()
    result: dict = {"preset": args.preset, "ranks": n, "batch_per_rank": args.batch, "seq_len": args.seq_len,
                    "steps": args.steps, "skip": args.skip, "rounds": args.rounds}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="mlxshard-") as tmp, namespace_hosts(args, Path(tmp), "shard", "mlxshb") as cluster:
        for rnd in range(args.rounds):
            for mode in modes:
                run_dir = Path(tmp) / f"{mode}-{rnd}"
                check(_launch(n, [*common, f"dist.shard={mode}"], run_dir, args.timeout, cluster=cluster),
                      f"{n}-rank {mode}")
                runs[mode].append(_read(run_dir, n, args.skip))
                print(f"round {rnd + 1}/{args.rounds} {mode}: {runs[mode][-1]['step_s']:.3f} s/step", flush=True)
        demo = _demo(args, common, n, Path(tmp), runs["none"][0]) if args.demo and cluster is None else None
    from ..config import load_config
    from ..models.presets import param_count, resolve

    n_params = param_count(resolve(load_config(None, common).model))
    ddp_bytes = 8 * n_params
    result |= {"n_params": n_params, "ddp_optimizer_bytes": ddp_bytes, "target_ratio": 1 / n + 0.05, "modes": {}}
    where = f"{n} hosts at {args.rate}" if args.simcluster else f"{n} ranks on one host"
    if args.simcluster:
        result |= {"hosts": n, "rate": args.rate}
    print(f"\n{where}, model {args.preset} ({n_params / 1e6:.1f}M parameters), {args.batch} x "
          f"{args.seq_len} tokens per rank per step, {args.rounds} round(s) interleaved, medians of steps "
          f"{args.skip + 1}-{args.steps}; MB = 1e6 bytes")
    print(f"{'mode':<24}{'rank':>5}{'peak MB':>10}{'end MB':>10}{'adamw MB':>10}{'/ DDP':>8}{'step s':>9}"
          f"{'/ DDP':>8}")
    for mode in modes:
        per_round = [r["step_s"] for r in runs[mode]]
        ratios = [r["step_s"] / d["step_s"] for r, d in zip(runs[mode], runs["none"], strict=True)]
        ranks = []
        for r in range(n):
            opt = [x["ranks"][r]["optimizer_bytes"] for x in runs[mode]]
            opt_b = ddp_bytes if opt[0] is None else opt[0]
            ranks.append({"peak_bytes": statistics.median(x["ranks"][r]["peak"] for x in runs[mode]),
                          "active_bytes": statistics.median(x["ranks"][r]["active"] for x in runs[mode]),
                          "optimizer_bytes": opt_b, "optimizer_ratio": opt_b / ddp_bytes})
        entry = {"step_s": statistics.median(per_round), "step_s_rounds": per_round,
                 "step_ratio": statistics.median(ratios), "step_ratio_rounds": ratios, "ranks": ranks,
                 "optimizer_ratio_ok": all(x["optimizer_ratio"] <= 1 / n + 0.05 for x in ranks),
                 "sync_s": statistics.median(x["ranks"][0]["sync_s"] for x in runs[mode])}
        if mode == "weights":
            entry["held_bytes"] = [x["active_bytes"] for x in ranks]
            entry["shard_bytes"] = [12 * x["optimizer_bytes"] / 8 for x in ranks]  # weights + m + v
        if args.simcluster:
            owned = [x["optimizer_bytes"] / 8 for x in ranks] if mode != "none" else [n_params / n] * n
            moved = statistics.median(x["ranks"][0]["sync_bytes"] for x in runs[mode])
            entry["link_limit_s"] = (zero3_link_seconds(owned, moved, args.rate) if mode == "weights"
                                     else link_seconds(owned, args.rate))
            entry["link_fraction"] = entry["link_limit_s"] / max(entry["sync_s"], 1e-9)
        result["modes"][mode] = entry
        for r, x in enumerate(ranks):
            head = f"{mode} ({NAMES[mode]})" if r == 0 else ""
            tail = f"{entry['step_s']:>9.3f}{entry['step_ratio']:>8.3f}" if r == 0 else ""
            print(f"{head:<24}{r:>5}{x['peak_bytes'] / MB:>10.0f}{x['active_bytes'] / MB:>10.0f}"
                  f"{x['optimizer_bytes'] / MB:>10.0f}{x['optimizer_ratio']:>8.3f}{tail}")
    for mode in modes[1:]:
        e = result["modes"][mode]
        print(f"{NAMES[mode]}: AdamW state per rank {max(x['optimizer_ratio'] for x in e['ranks']):.3f} of data "
              f"parallel's (target <= {1 / n + 0.05:.3f}: {'ok' if e['optimizer_ratio_ok'] else 'MISSED'}); "
              f"step time {e['step_ratio']:.3f} x data parallel's (rounds: "
              f"{', '.join(f'{x:.3f}' for x in e['step_ratio_rounds'])})")
        if mode == "weights":
            print(f"ZeRO-3: held between steps {', '.join(f'{b / MB:.0f}' for b in e['held_bytes'])} MB per rank; "
                  f"its shard's weights and moments {', '.join(f'{b / MB:.0f}' for b in e['shard_bytes'])} MB "
                  f"(data parallel holds {12 * n_params / MB:.0f} MB of them on every rank)")
    if args.simcluster:
        for mode in modes:
            e = result["modes"][mode]
            print(f"{NAMES[mode]}: exchange {e['sync_s']:.3f} s a step, the link's limit {e['link_limit_s']:.3f} s: "
                  f"{e['link_fraction']:.2f} of the link")
    _print_phases(modes, runs, result, n)
    if demo:
        result["no_fit"] = demo
        print(f"doesn't fit: MLXDIST_MEMORY_LIMIT_BYTES={demo['limit_bytes']} (budget {demo['budget_bytes'] / MB:.0f} "
              f"MB; planned data parallel {demo['need_none_bytes'] / MB:.0f} MB, ZeRO-1 "
              f"{demo['need_optimizer_bytes'] / MB:.0f} MB a rank)")
        print(f"  dist.shard=auto -> {demo['auto_mode']}: exit {demo['auto_exit']}, {demo['auto_steps']} steps, "
              f"losses within {demo['auto_max_loss_diff']:.1e} of data parallel's (unlimited); "
              f"'{demo['auto_choice_line']}'")
        print(f"  dist.shard=none, same limit: exit {demo['none_exit']}, {demo['none_steps']} steps (the planner "
              f"warns and the run goes on); its memory lines: {demo['none_memory_lines'] or 'none'}")
    return finish("shard", result, t_start, args.json)


def _print_phases(modes: list[str], runs: dict[str, list[dict]], result: dict, n: int) -> None:
    """Seconds a step by phase, each the median over rounds of a run's median, per rank."""
    print("seconds a step by phase (medians; data parallel's update is in 'rest'):")
    for mode in modes:
        for r in range(n):
            names = list(runs[mode][0]["ranks"][r]["phases"])
            med = {k: statistics.median(x["ranks"][r]["phases"].get(k, 0.0) for x in runs[mode]) for k in names}
            result["modes"][mode].setdefault("phases", []).append(med)
            print(f"  {NAMES[mode]:<14} rank {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))


def _demo(args, common: list[str], n: int, tmp: Path, ddp: dict) -> dict:
    limit, plan_numbers = _limit(common, n)
    env = {"MLXDIST_MEMORY_LIMIT_BYTES": str(limit)}
    out: dict = {"limit_bytes": limit, **plan_numbers}
    for mode in ("auto", "none"):
        run_dir = tmp / f"limit-{mode}"
        res = _launch(n, [*common, f"dist.shard={mode}"], run_dir, args.timeout, env)
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        events = read_events(run_dir, 0)
        steps = [e for e in events if e["event"] == "step"]
        shard = next((e for e in events if e["event"] == "shard"), None)
        out |= {f"{mode}_exit": res.returncode, f"{mode}_steps": len(steps),
                f"{mode}_last_line": lines[-1] if lines else "",
                f"{mode}_mode": shard["mode"] if shard else "none",
                f"{mode}_memory_lines": [x for x in lines if "memory" in x.lower() or "warning" in x.lower()][:6]}
        if mode == "auto":
            out["auto_choice_line"] = next((x for x in lines if x.startswith("dist.shard=auto")), "")
            losses = [e["loss"] for e in steps]
            ref = ddp["ranks"][0]["loss"]
            out["auto_max_loss_diff"] = (max(abs(a - b) for a, b in zip(losses, ref, strict=True))
                                         if len(losses) == len(ref) else float("nan"))
        print(f"doesn't fit, dist.shard={mode}: exit {res.returncode}, {len(steps)} steps", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
