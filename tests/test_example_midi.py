"""examples/midi: real scores from music21's corpus, tokenized by miditok, trained as a task.

Tiny everything (three Bach chorales, 32-token windows, a 2-layer model) so the module runs
in well under a minute on two cores; the cache is built once for the module."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import ROOT, assert_same_weights, env, final_weights, logged_steps, run_train

pytestmark = pytest.mark.cluster

MIDI = ROOT / "examples" / "midi"
# train.eps=1e-6: a few key-projection gradients start near zero, where AdamW's division by
# sqrt(v) + eps magnifies the fp32 rounding of summing 3+5 rather than 8 (~5e-6 at eps=1e-8,
# ~6e-7 here); the sums themselves are what the 1e-5 comparison checks.
EXACT = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
         "train.schedule=constant", "train.lr=1e-2", "train.eps=1e-6", "train.grad_clip=0", "checkpoint.every=0",
         "dist.sync_weights_every=0", "train.log_every=1", "task.factory=task:make_task"]
STEPS = 6


@pytest.fixture(scope="module")
def task_args(tmp_path_factory) -> dict:
    """The tiny task's args, its token cache already built (`task.py prepare`, as the README says)."""
    cache = tmp_path_factory.mktemp("midi-cache")
    args = {"composers": ["bach"], "pieces": 3, "window": 32, "overlap": 8, "eval_every": 3, "cache": str(cache),
            "model": {"dim": 32, "layers": 2, "heads": 4, "ffn": 64}}
    config = cache / "tiny.yaml"
    config.write_text(json.dumps({"task": {"factory": "task:make_task", "args": args}}))  # JSON is YAML
    r = subprocess.run([sys.executable, "task.py", "prepare", str(config)], cwd=MIDI, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "training windows" in r.stdout, r.stdout + r.stderr
    # converting is minutes on the real subsets: it says how far it is, on stderr
    assert "prepare: 3 scores of bach to parse" in r.stderr, r.stderr
    assert re.search(r"^prepare: 3/3 scores parsed \(bach\), \d+k tokens so far, \dm\d\ds elapsed$", r.stderr, re.M), \
        r.stderr
    return args


def with_args(args: dict) -> str:
    return f"task.args={json.dumps(args)}"


@pytest.fixture(scope="module")
def one_rank(task_args, tmp_path_factory):
    """The reference: batch 8 on one process, never interrupted."""
    out = tmp_path_factory.mktemp("midi-one")
    r = run_train([*EXACT, with_args(task_args), "train.batch_size=8", f"train.steps={STEPS}",
                   f"train.eval_every={STEPS}", "train.eval_batches=0", f"train.out_dir={out}"], cwd=MIDI)
    assert r.returncode == 0, r.stderr
    return out


def task_py(*args: str) -> str:
    r = subprocess.run([sys.executable, "task.py", *map(str, args)], cwd=MIDI, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def held_out_loss(stdout: str) -> float:
    return float(re.search(r"held-out loss ([0-9.]+) per token over all (\d+) held-out windows", stdout)[1])


def test_task_py_eval_is_mlxdists_own_evaluation_over_every_held_out_window(one_rank):
    logged = [json.loads(line) for line in (one_rank / "logs" / "rank0.jsonl").read_text().splitlines()]
    evals = [e["eval_loss"] for e in logged if e["event"] == "eval"]
    out = task_py("eval", one_rank)
    assert out.startswith(f"{one_rank} step {STEPS}: held-out loss ") and len(evals) == 1, out
    assert abs(held_out_loss(out) - evals[0]) < 1e-3, (out, evals)


def test_a_finetune_that_forgets_the_model_says_so_in_one_line(task_args, one_rank, tmp_path):
    """init_from a checkpoint of another model size: one line with the counts, a few names and
    the override to add, not a line per missing parameter."""
    args = {k: v for k, v in task_args.items() if k != "model"} | {"init_from": str(one_rank)}
    r = run_train([*EXACT, with_args(args), "train.batch_size=8", "train.steps=1", f"train.out_dir={tmp_path}"],
                  cwd=MIDI)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "init_from" in line]
    assert len(lines) == 1 and "does not fit the model's" in lines[0], r.stderr
    assert re.search(r"\d+ missing \(layers\.2\.\S+, layers\.2\.\S+, \.\.\. \d+ more\), 0 unexpected, "
                     r"\d+ of another shape \(embed\.weight \(\d+, 32\) not \(\d+, 256\)", lines[0]), lines[0]
    assert lines[0].endswith("task.args.model must be the pretraining run's: "
                             "'task.args.model={dim: 32, layers: 2, heads: 4, ffn: 64}'"), lines[0]
    assert not any(line.startswith("layers.") for line in r.stderr.splitlines()), r.stderr


def test_unequal_ranks_learn_music_like_one_process(task_args, one_rank, tmp_path):
    r = run_train([*EXACT, with_args(task_args), "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}",
                   f"train.steps={STEPS}", f"train.out_dir={tmp_path}"], np_=2, cwd=MIDI)
    assert r.returncode == 0 and "shares [3, 5]" in r.stderr, r.stderr
    steps = logged_steps(tmp_path)
    assert [e["unit"] for e in steps] == ["tokens"] * STEPS
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"], [e["loss"] for e in steps]
    assert_same_weights(final_weights(one_rank), final_weights(tmp_path), atol=1e-5)


def test_a_lora_finetune_of_the_pretrained_run_resumes_exactly_and_writes_midi(task_args, one_rank, tmp_path):
    """The second phase: adapters on the frozen pretrained model (init_from), bf16 compute.
    On resume `build` loads the base again and the checkpoint brings the adapters."""
    lora = {"rank": 4, "targets": ["self_attn.q_proj", "mlp.down_proj"]}
    run = [*EXACT, with_args(task_args | {"init_from": str(one_rank), "lora": lora}), "model.dtype=bfloat16",
           "train.batch_size=8"]
    r = run_train([*run, "train.steps=4", f"train.out_dir={tmp_path / 'whole'}"], cwd=MIDI)
    assert r.returncode == 0, r.stderr
    # lora_b starts at zero, so step 0 is the pretrained model: far below the untrained loss
    assert logged_steps(tmp_path / "whole")[0]["loss"] < 0.7 * logged_steps(one_rank)[0]["loss"]
    r = run_train([*run, "train.steps=2", "checkpoint.every=2", f"train.out_dir={tmp_path / 'split'}"], cwd=MIDI)
    assert r.returncode == 0, r.stderr
    r = run_train([*run, "train.steps=4", f"train.out_dir={tmp_path / 'split'}", "--resume", "auto"], cwd=MIDI)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr
    whole = final_weights(tmp_path / "whole")
    assert {k.rsplit(".", 1)[1] for k in whole} == {"lora_a", "lora_b"}, sorted(whole)  # adapters only
    assert sum(w.size for w in whole.values()) == 2 * (32 * 4 + 4 * 32 + 64 * 4 + 4 * 32)  # 2 blocks: q, down
    assert_same_weights(whole, final_weights(tmp_path / "split"), atol=1e-6)

    # --base: the model the fine-tune started from (adapters at zero), scored like the pretrained run
    # (bf16 compute here, fp32 there)
    base = held_out_loss(task_py("eval", tmp_path / "whole", "--base"))
    assert abs(base - held_out_loss(task_py("eval", one_rank))) < 0.02 * base

    out = tmp_path / "sample.mid"
    r = subprocess.run([sys.executable, "task.py", "generate", str(tmp_path / "split"), str(out), "--tokens", "48"],
                       cwd=MIDI, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    import symusic

    notes = sum(len(t.notes) for t in symusic.Score(out).tracks)  # the file parses back
    assert notes >= 1 and f"{out}: {notes} notes" in r.stdout, r.stdout
