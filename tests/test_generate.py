"""`mlxdist.generate` on a built-in preset (a byte-level model trained here): the numpy draw in
`engine.common.sample_tokens` gives the same text from the same weights and seed on both engines.
Pretrained models (mlx-lm / transformers generators) are tested in test_generate_lm.py."""

import contextlib
import io
import os
import subprocess
import sys
from unittest import mock

import pytest
from helpers import FAST, env, run_train

pytest.importorskip("torch")


def _generate(*args, cli: bool = False):
    """`python -m mlxdist.generate ARGS`: the real command line when `cli`, else its `main` in
    this process (the same code, without a fresh interpreter's torch import per call; MLX is
    imported first, so `main` never re-execs pytest for the BLAS)."""
    if cli:
        r = subprocess.run([sys.executable, "-m", "mlxdist.generate", *args], capture_output=True, text=True,
                           env=env() | {"DISABLE_COMPILE": "1"}, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout
    import mlx.core  # noqa: F401

    from mlxdist.commands import generate

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"DISABLE_COMPILE": "1"}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = generate.main(list(args))
    assert code == 0, err.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A byte-level preset trained for 20 steps: both temperatures below sample from it."""
    out = tmp_path_factory.mktemp("run")
    assert run_train([*FAST, "train.steps=20", "train.lr=3e-3", f"train.out_dir={out}"]).returncode == 0
    return out


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_same_text_on_both_engines_from_a_checkpoint(run, temperature):
    args = ["--checkpoint", str(run), "--prompt", "ab", "--tokens", "24", "--temperature", temperature,
            "--seed", "3"]
    mlx, torch = _generate(*args, "--engine", "mlx", cli=True), _generate(*args, "--engine", "torch", "--device", "cpu")
    assert mlx == torch and mlx.startswith("ab") and len(mlx) > 10
