"""Your loop keeps the trainer's promise on non-finite updates: a step whose gradients, summed
over the ranks, hold NaN is skipped on every rank (not applied, counted, said), so the weights
equal a run where that step was never taken; `control.max_nonfinite_steps` of them in a row end
the job in one line on every rank; a checkpoint of weights that went NaN anyway is refused in
one line, not a traceback. PyTorch (`mlxdist.torch`) and MLX (`mlxdist.mlx`), 2 real ranks
(3+5) against one process (8), the script in tests/yourloop/nonfinite_loop.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mpirun_path

HERE = Path(__file__).parent / "yourloop"
SPLIT = "nodes:\n  rank0: {batch_size: 3}\n  rank1: {batch_size: 5}\n"
STOP_AT_3 = SPLIT + "control:\n  max_nonfinite_steps: 3\n"


def _run(args, np_=0, timeout=120):
    cmd = [sys.executable, str(HERE / "nonfinite_loop.py"), *map(str, args)]
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH",
               "-x", "OPENBLAS_NUM_THREADS", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=HERE)


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def _one_line_stop(r: subprocess.CompletedProcess, what: str) -> str:
    """The job ended on every rank, non-zero, with one `error:` line from rank 0 and no traceback."""
    assert r.returncode != 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "rank 0: done" not in r.stderr and "rank 1: done" not in r.stderr, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and what in errors[0], r.stderr[-2000:]
    return errors[0]


@pytest.mark.cluster
@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_a_nan_loss_on_one_rank_skips_that_step_everywhere_and_equals_never_taking_it(tmp_path, framework):
    ref = _run([tmp_path / "ref.npz", "--framework", framework, "--skip-at", "2"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    run = tmp_path / "run"
    two = _run([tmp_path / "two.npz", "--framework", framework, "--config", _config(tmp_path, SPLIT),
                "--nan-at", "2", "--nan-rank", "1", "--run-dir", run], np_=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "rank 0: done" in two.stderr and "rank 1: done" in two.stderr
    skips = [ln for ln in two.stderr.splitlines() if "step skipped" in ln]
    assert len(skips) == 1 and "NaN or infinity" in skips[0] and "(1 so far" in skips[0], two.stderr[-2000:]
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "two.npz")
    assert a.files == b.files
    assert all(np.isfinite(b[k]).all() for k in b.files)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    assert worst < 1e-5, f"3+5 with step 2 skipped vs 8 without step 2: {worst:.3g}"
    assert (run / "checkpoints" / "step_00000005").is_dir()  # the weights stayed finite, so they save


@pytest.mark.cluster
@pytest.mark.parametrize("framework,where", [("torch", "config"), ("torch", "argument"), ("mlx", "config")])
def test_nonfinite_steps_in_a_row_stop_every_rank_in_one_line(tmp_path, framework, where):
    how = ["--config", _config(tmp_path, STOP_AT_3)] if where == "config" else \
        ["--config", _config(tmp_path, SPLIT), "--max-nonfinite", "3"]
    r = _run([tmp_path / "w.npz", "--framework", framework, *how, "--nan-at", "1,2,3,4", "--steps", "6"], np_=2,
             timeout=120)
    line = _one_line_stop(r, "3 updates in a row skipped")
    assert "control.max_nonfinite_steps=3" in line
    skips = [ln for ln in r.stderr.splitlines() if "step skipped" in ln]
    assert ["(1 so far" in skips[0], "(2 so far" in skips[1], len(skips)] == [True, True, 2], r.stderr[-2000:]
    assert not (tmp_path / "w.npz").exists()


@pytest.mark.cluster
@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_save_checkpoint_of_nan_weights_is_one_line_on_every_rank(tmp_path, framework):
    run = tmp_path / "run"
    r = _run([tmp_path / "w.npz", "--framework", framework, "--config", _config(tmp_path, SPLIT),
              "--save-nan", run], np_=2)
    line = _one_line_stop(r, f"mlxdist.{framework}.save_checkpoint: step 5: weight")
    assert "holds NaN or infinity" in line and "lower learning rate" in line
    assert not (run / "checkpoints" / "step_00000005").exists()


@pytest.mark.cluster
def test_a_compiled_mlx_step_keeps_the_weights_finite_when_one_rank_goes_nan(tmp_path):
    """Inside mx.compile the graph cannot skip the update: the sum's gradients come back as
    zeros on every rank (AdamW's moments and decay still move), so the weights stay finite."""
    r = _run([tmp_path / "w.npz", "--framework", "mlx-compiled", "--config", _config(tmp_path, SPLIT),
              "--nan-at", "2", "--run-dir", tmp_path / "run"], np_=2)
    assert r.returncode == 0, r.stderr[-3000:]
    w = np.load(tmp_path / "w.npz")
    assert all(np.isfinite(w[k]).all() for k in w.files)
    assert (tmp_path / "run" / "checkpoints" / "step_00000005").is_dir()
