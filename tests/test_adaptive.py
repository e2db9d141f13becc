"""The loop's adaptive parts in real runs: memory-driven batch size with a fixed global batch,
out-of-memory retry, and the health monitor's skip and rollback."""

import json
import re
import subprocess
import time

import pytest
from helpers import (
    FAST,
    assert_same_weights,
    env,
    final_weights,
    logged_steps,
    run_train,
    train_command,
)

pytestmark = pytest.mark.cluster


def _events(run_dir, kind, rank=0):
    lines = (run_dir / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def test_lower_memory_limit_shrinks_batch_keeps_global_batch(tmp_path):
    limit = tmp_path / "limit"
    limit.write_text(str(50 * 2**30))
    args = [*FAST, "train.steps=40", "train.batch_size=16", "train.accum=1", "control.adapt_batch=true",
            "control.max_batch=16", f"train.out_dir={tmp_path}", "data.seq_len=64"]
    proc = subprocess.Popen(train_command(args, np_=2, extra_env={"MLXDIST_MEMORY_LIMIT_FILE": str(limit)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env() | {"MLXDIST_MEMORY_LIMIT_FILE": str(limit)})
    deadline = time.time() + 120
    while time.time() < deadline and len(logged_steps(tmp_path)) < 5:
        time.sleep(0.05)
    peak = logged_steps(tmp_path)[-1]["memory_peak_bytes"]
    assert peak > 0
    limit.write_text(str(int(peak / 0.85 * 0.6)))  # the batch of 16 no longer fits the target
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    steps = logged_steps(tmp_path)
    assert {sum(e["shares"]) for e in steps} == {32}, "global batch must stay fixed"
    first, last = steps[0], steps[-1]
    assert first["micro"] == [16, 16] and max(last["micro"]) < 16, last["micro"]
    assert "micro-batch 16 -> " in err and "memory" in err
    accum = _events(tmp_path, "accumulation")
    assert accum and max(accum[-1]["accum"]) >= 2, "smaller micro-batches must raise accumulation"


def test_out_of_memory_where_a_rank_cannot_redo_alone_is_one_line_and_the_checkpoint_stays(tmp_path):
    """Under ZeRO-3 (as in a pipeline) the other ranks are inside the step's exchanges, so a
    rank cannot redo its share smaller: the job ends with one line naming the rank, the step and
    what to change, and the checkpoint before it loads."""
    from mlxdist.state import checkpoint as ckpt

    r = run_train([*FAST, "train.steps=6", "train.batch_size=1", "checkpoint.every=2", "dist.shard=weights",
                   f"train.out_dir={tmp_path}"], np_=2, extra_env={"MLXDIST_INJECT_OOM": "1:3"})
    assert r.returncode != 0
    line = ("rank 1 (.+?): out of memory in step 4 \\(injected out-of-memory \\(MLXDIST_INJECT_OOM\\)\\); dist.shard=weights "
            "cannot redo a step smaller on one rank: lower this host's micro-batch \\(train.batch_size or nodes: "
            "batch_size\\) or its control.memory_target, then --resume auto \\(the last checkpoint is kept\\)")
    assert re.search(line, r.stderr), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert ckpt.load_latest(tmp_path / "checkpoints").meta.run.step == 2


def test_out_of_memory_retries_step_with_smaller_batch(tmp_path):
    common = [*FAST, "train.steps=6", "train.batch_size=8", "train.lr=2e-4", "checkpoint.every=0",
              "dist.sync_weights_every=0"]
    ref, oom = tmp_path / "ref", tmp_path / "oom"
    assert run_train([*common, f"train.out_dir={ref}"], np_=2).returncode == 0
    r = run_train([*common, f"train.out_dir={oom}"], np_=2, extra_env={"MLXDIST_INJECT_OOM": "1:2"})
    assert r.returncode == 0, r.stderr
    log1 = (oom / "logs" / "rank1.log").read_text()
    assert "oom: step 2" in log1 and "micro-batch 8 -> 6, retrying the step" in log1
    assert logged_steps(oom)[-1]["micro"] == [8, 6]
    assert "batch: step 3: micro-batches [8, 8] -> [8, 6]" in r.stderr  # every rank re-plans
    # same samples, same update: the retried step changes only the summation order
    assert_same_weights(final_weights(ref), final_weights(oom), atol=1e-5)


def test_nan_steps_are_skipped_counted_and_rolled_back(tmp_path):
    r = run_train([*FAST, "train.steps=12", "checkpoint.every=2", "control.max_bad_steps=3",
                   f"train.out_dir={tmp_path}"], extra_env={"MLXDIST_INJECT_NAN": "4,5,6"})
    assert r.returncode == 0, r.stderr
    assert "non-finite loss/gradients; update skipped (3 so far)" in r.stderr
    assert "rollback: 3 bad steps in a row; back to step 6, learning rate x0.5" in r.stderr
    assert [e["step"] for e in _events(tmp_path, "skipped")] == [4, 5, 6]
    assert _events(tmp_path, "rollback")[0]["lr_scale"] == 0.5
    steps = logged_steps(tmp_path)
    assert steps[-1]["step"] == 12 and steps[-1]["loss"] < 10
    saved = json.loads((tmp_path / "checkpoints" / "step_00000012" / "state.json").read_text())
    assert saved["lr_scale"] == 0.5  # the lower learning rate survives a resume


def test_reduce_on_plateau_lowers_learning_rate(tmp_path):
    r = run_train([*FAST, "train.steps=8", "train.lr=0", "train.eval_every=2", "control.plateau_patience=1",
                   "control.plateau_factor=0.5", f"train.out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr
    assert "plateau: eval loss flat for 1 evals; learning rate x0.5" in r.stderr


def test_early_stopping_ends_the_run_and_saves(tmp_path):
    r = run_train([*FAST, "train.steps=50", "train.lr=0", "train.eval_every=2", "train.early_stop_patience=2",
                   f"train.out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr
    assert "stopped after step 6: early stopping" in r.stderr
    assert (tmp_path / "checkpoints" / "step_00000006").is_dir()
