"""`mlxdist.generate` on a built-in preset (a byte-level model trained here): the numpy draw in
`engine.common.sample_tokens` gives the same text from the same weights and seed on both engines.
Pretrained models (mlx-lm / transformers generators) are tested in test_generate_lm.py."""

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
