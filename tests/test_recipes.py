"""What real recipes carry besides the weights: an EMA of them (`train.ema`), state a task
carries between steps (`Task.state_dict`), rank 0's hooks, and config keys a task would ignore.
The tasks are in `user_tasks.py`; the runs use test_tasks' settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_same_weights, final_weights
from test_tasks import SPLIT, _train

from mlxdist.state import checkpoint as ckpt

TORCH = ["--engine", "torch", "--device", "cpu"]
EMA_TASKS = {"mlx": ["task.factory=user_tasks:mlx_mlp", "task.args={batchnorm: true}"],
             "torch": [*TORCH, "task.factory=user_tasks:torch_batchnorm"]}


def _ok(args, np_=0):
    r = _train(args, np_=np_)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _checkpoint(run, step) -> ckpt.Loaded:
    return ckpt.load(run / "checkpoints" / f"step_{step:08d}")


# ---------------------------------------------------------------- EMA
@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_the_ema_is_saved_each_step_s_average_and_resumes_exactly(tmp_path, engine):
    args = [*EMA_TASKS[engine], "train.ema=0.5", "train.batch_size=8"]
    _ok([*args, "train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=10", f"train.out_dir={tmp_path / 'a'}"])
    three, four = _checkpoint(tmp_path / "a", 3), _checkpoint(tmp_path / "a", 4)
    ema3, ema4 = three.extra["ema"], four.extra["ema"]
    stats = [n for n in ema4 if "running_mean" in n or n.endswith("mean")]
    assert stats, f"the average holds no BatchNorm statistics: {sorted(ema4)}"
    assert set(four.weights) >= set(ema4) >= set(four.weights) - {n for n in four.weights if "num_batches" in n}
    for name, avg in ema4.items():  # ema_t = d * ema_{t-1} + (1 - d) * model_t
        np.testing.assert_allclose(avg, 0.5 * ema3[name] + 0.5 * four.weights[name], atol=1e-6, err_msg=name)
    assert max(float(np.abs(ema4[n] - four.weights[n]).max()) for n in ema4) > 1e-4  # an average, not a copy

    _ok([*args, "train.steps=2", "checkpoint.every=2", f"train.out_dir={tmp_path / 'b'}"])
    r = _ok([*args, "train.steps=4", "checkpoint.every=2", f"train.out_dir={tmp_path / 'b'}", "--resume", "auto"])
    assert "resumed from" in r.stderr
    resumed = ckpt.load_latest(tmp_path / "b" / "checkpoints")
    assert_same_weights(resumed.extra["ema"], ema4, atol=1e-6)
    assert_same_weights(resumed.weights, four.weights, atol=1e-6)


@pytest.mark.cluster
def test_evaluation_reads_the_ema_on_every_rank_and_3_plus_5_keep_the_same_average(tmp_path):
    args = ["task.factory=user_tasks:mlx_mlp", "train.ema=0.8", "train.steps=4", "train.eval_every=2",
            "train.eval_batches=0"]
    one = _ok([*args, "train.batch_size=8", f"train.out_dir={tmp_path / 'one'}"])
    _ok([*args, SPLIT, f"train.out_dir={tmp_path / 'two'}"], np_=2)
    assert "eval: step 4: EMA loss" in one.stderr, one.stderr[-2000:]
    a = ckpt.load_latest(tmp_path / "one" / "checkpoints").extra["ema"]
    b = ckpt.load_latest(tmp_path / "two" / "checkpoints").extra["ema"]
    assert_same_weights(a, b, atol=1e-5)
    evals = [json.loads(line) for line in (tmp_path / "two" / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert [e["ema"] for e in evals if e["event"] == "eval"] == [True, True]


# ---------------------------------------------------------------- state a task carries
def test_a_task_s_carried_state_is_checkpointed_and_resume_is_exact(tmp_path):
    def run(name, stateful, steps, *more):
        return _ok([*TORCH, "task.factory=user_tasks:torch_carry", f"task.args={{stateful: {stateful}}}",
                    "train.batch_size=8", f"train.steps={steps}", "checkpoint.every=2",
                    f"train.out_dir={tmp_path / name}", *more])

    run("whole", "true", 4)  # uninterrupted, state_dict changes nothing
    for stateful in ("true", "false"):
        run(f"split-{stateful}", stateful, 2)
        run(f"split-{stateful}", stateful, 4, "--resume", "auto")
    saved = _checkpoint(tmp_path / "split-true", 2).extra["task"]
    assert set(saved) == {"ranks", "rank0/carry/mean", "rank0/carry/batches"} and int(saved["rank0/carry/batches"]) == 2
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "split-true"), atol=1e-6)
    # Without state_dict the carry restarts at zero: the same resume ends elsewhere.
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "split-false")
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) > 1e-5


@pytest.mark.cluster
def test_each_rank_gets_its_own_carried_state_back_and_another_rank_count_starts_afresh(tmp_path):
    args = [*TORCH, "task.factory=user_tasks:torch_carry", SPLIT, "train.steps=2", "checkpoint.every=2",
            f"train.out_dir={tmp_path}"]
    _ok(args, np_=2)
    saved = _checkpoint(tmp_path, 2).extra["task"]
    assert int(saved["ranks"]) == 2 and int(saved["rank0/carry/batches"]) == int(saved["rank1/carry/batches"]) == 2
    assert not np.allclose(saved["rank0/carry/mean"], saved["rank1/carry/mean"])  # each rank's own samples
    r = _ok([*TORCH, "task.factory=user_tasks:torch_carry", "train.batch_size=8", "train.steps=3",
             f"train.out_dir={tmp_path}", "--resume", "auto"])
    assert "its carried state was saved by 2 rank(s), this run has 1: each rank's state starts afresh" in r.stderr


# ---------------------------------------------------------------- hooks
@pytest.mark.cluster
def test_hooks_run_on_rank_0_in_eval_mode_after_evaluations_and_checkpoints(tmp_path):
    out = tmp_path / "hooks"
    out.mkdir()
    _ok(["task.factory=user_tasks:with_hooks", f"task.args={{out: '{out}', engine: torch}}", *TORCH, SPLIT,
         "train.steps=4", "train.eval_every=2", "checkpoint.every=2", f"train.out_dir={tmp_path / 'run'}"], np_=2)
    evals = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4] and {e["rank"] for e in evals} == {"0"}
    assert not any(e["training"] for e in evals) and all("loss" in e["metrics"] for e in evals)
    for step in (2, 4):
        path = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
        assert (path / "sample.txt").read_text() == f"step {step}\n"
        assert ckpt.verify(path) is None  # the hook's files do not spoil the checkpoint


@pytest.mark.parametrize("hook, step, kept", [
    ("on_eval", 2, "a checkpoint of step 2 is written before the run stops"),
    ("on_checkpoint", 4, "the checkpoint of step 4 was written before it"),
])
def test_a_hook_that_raises_is_one_line_and_the_training_state_is_kept(tmp_path, hook, step, kept):
    r = _train(["task.factory=user_tasks:with_hooks", f"task.args={{out: '{tmp_path}', fail: {hook}}}",
                "train.batch_size=8", "train.steps=6", "train.eval_every=2", "checkpoint.every=4",
                f"train.out_dir={tmp_path / 'run'}"])
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: task user_tasks:with_hooks: {hook} raised ValueError: ") and kept in last, last
    assert "user_tasks.py:" in last and "Traceback" not in r.stderr
    assert ckpt.load_latest(tmp_path / "run" / "checkpoints").meta.run.step == step


# ---------------------------------------------------------------- keys that do not apply
@pytest.mark.parametrize("args, message", [
    (["task.factory=user_tasks:mlx_mlp", "model.dim=64", "data.seq_len=64"],
     "task user_tasks:mlx_mlp: data.seq_len, model.dim are set, but a task brings its own model and data"),
    (["task.factory=user_tasks:reads_seq_len", "data.seq_len=64", "model.preset=small"],
     "task user_tasks:reads_seq_len: model.preset is set, but"),
    (["task.factory=user_tasks:mlx_mlp", "finetune.rank=4"], "finetune.rank is set, but"),
])
def test_a_key_a_task_would_ignore_is_an_error_naming_it(tmp_path, args, message):
    r = _train([*args, "train.steps=1", "train.batch_size=8", f"train.out_dir={tmp_path}"])
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert message in last and "Task(config_keys=(...))" in last, last


def test_keys_a_task_declares_and_those_that_apply_to_every_task_are_accepted(tmp_path):
    _ok(["task.factory=user_tasks:reads_seq_len", "data.seq_len=64", "data.prefetch=2", "model.dtype=float32",
         "train.steps=1", "train.batch_size=8", f"train.out_dir={tmp_path}"])
