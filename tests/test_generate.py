"""`mlxdist.generate` gives the same text from the same weights and seed on both engines."""

import subprocess
import sys

import pytest
from helpers import FAST, env, run_train

pytest.importorskip("torch")


def _generate(*args):
    r = subprocess.run([sys.executable, "-m", "mlxdist.generate", *args], capture_output=True, text=True,
                       env=env() | {"DISABLE_COMPILE": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_same_text_on_both_engines_from_a_checkpoint(tmp_path, temperature):
    assert run_train([*FAST, "train.steps=20", "train.lr=3e-3", f"train.out_dir={tmp_path}"]).returncode == 0
    args = ["--checkpoint", str(tmp_path), "--prompt", "ab", "--tokens", "24", "--temperature", temperature,
            "--seed", "3"]
    mlx, torch = _generate(*args, "--engine", "mlx"), _generate(*args, "--engine", "torch", "--device", "cpu")
    assert mlx == torch and mlx.startswith("ab") and len(mlx) > 10


def test_chat_with_a_pretrained_model_and_its_adapter_on_both_engines(tmp_path):
    pytest.importorskip("mlx_lm")
    from tiny_hf import make_llama

    base = make_llama(tmp_path / "base")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "What is two plus two?", "completion": " Four."}\n' * 12)
    run = tmp_path / "run"
    r = run_train([*[x for x in FAST if not x.startswith(("data.", "model."))], f"model.path={base}",
                   "finetune.method=lora", "data.source=jsonl", f"data.path={data}", "data.seq_len=16",
                   "train.steps=3", "train.batch_size=4", f"train.out_dir={run}"])
    assert r.returncode == 0, r.stderr
    args = ["--checkpoint", str(base), "--adapter", str(run / "adapter"), "--chat", "--prompt",
            "What is two plus two?", "--tokens", "8", "--temperature", "0"]
    mlx, torch = _generate(*args, "--engine", "mlx"), _generate(*args, "--engine", "torch", "--device", "cpu")
    assert mlx == torch and mlx.strip()
    assert _generate("--checkpoint", str(run), "--prompt", "What", "--tokens", "6", "--temperature", "0") \
        == _generate("--checkpoint", str(run), "--prompt", "What", "--tokens", "6", "--temperature", "0",
                     "--engine", "torch", "--device", "cpu")
