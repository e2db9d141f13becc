"""An exception in the user's own code (a task's loss) is one line that says where: rank, host,
the user's file:line, the exception, and how to see the traceback (MLXDIST_DEBUG=1)."""

from __future__ import annotations

from pathlib import Path

from helpers import run_train

from mlxdist.errors import error_line

HERE = Path(__file__).parent
ARGS = ["metrics.port=0", "train.progress=false", "train.steps=2", "task.factory=user_tasks:raises_in_loss"]


def test_an_error_in_the_users_loss_names_rank_host_and_line(tmp_path):
    r = run_train([*ARGS, f"train.out_dir={tmp_path}"], cwd=HERE)
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = errors[0]
    assert line.startswith("error: rank 0 (") and " at user_tasks.py:" in line and " in loss: " in line, line
    assert "RuntimeError: shapes do not line up (set MLXDIST_DEBUG=1 for the traceback)" in line
    r = run_train([*ARGS, f"train.out_dir={tmp_path / 'debug'}"], cwd=HERE, extra_env={"MLXDIST_DEBUG": "1"})
    assert "Traceback" in r.stderr and 'user_tasks.py", line' in r.stderr


def test_mlxdist_s_own_errors_stay_sentences():
    assert error_line(ValueError("checkpoint does not fit")) == "error: checkpoint does not fit"
