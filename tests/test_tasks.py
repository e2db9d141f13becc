"""Your own model: the Task API on both engines, through the config route and `mlxdist.fit`.

The tasks live in `user_tasks.py`, imported the way a user's are: `task.factory:
user_tasks:...` from the working directory of the run (this folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_weights, env, final_weights, mpirun_path, run_train

import mlxdist
from mlxdist.commands.check_task import diagnose
from mlxdist.tasks import default_collate, leading_size
from mlxdist.tasks.fingerprint import Fingerprint, check_same

HERE = Path(__file__).parent
# No model.preset / data.source here: a task brings its own.
TASK_FAST = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
             "train.schedule=constant", "train.lr=1e-2", "train.grad_clip=0", "checkpoint.every=0",
             "dist.sync_weights_every=0"]
SPLIT = "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"


def _train(args, np_=0, **kw):
    return run_train([*TASK_FAST, *args], np_=np_, cwd=HERE, **kw)


# ---------------------------------------------------------------- plain logic
def test_default_collate_stacks_each_leaf_and_counts_the_leading_size():
    samples = [{"x": np.full(3, i, np.float32), "pair": (i, np.array([i, i]))} for i in range(4)]
    batch = default_collate(samples)
    assert batch["x"].shape == (4, 3) and batch["pair"][0].tolist() == [0, 1, 2, 3]
    assert batch["pair"][1].shape == (4, 2) and leading_size(batch) == 4


@pytest.mark.parametrize("losses, counts, expect", [
    ((8.0, [3.0, 5.0]), ([3, 5], 8), "ok:"),
    ((1.0, [1.2, 0.88]), ([3, 5], 8), "loss is a mean"),  # 3/8*1.2 + 5/8*0.88 == 1.0
    ((9.0, [3.0, 5.0]), ([3, 5], 8), "samples are coupled"),
    ((8.0, [3.0, 5.0]), ([3, 4], 8), "count is not additive"),
])
def test_diagnose_names_what_breaks_the_sum_rule(losses, counts, expect):
    got = diagnose([3, 5], counts[0], counts[1], losses[0], losses[1], grad_rel_diff=0.0, repeat_rel_diff=0.0)
    assert got.message.startswith(expect) and got.ok == (expect == "ok:"), got.message
    random = diagnose([3, 5], [3, 5], 8, 8.0, [3.0, 5.0], grad_rel_diff=0.0, repeat_rel_diff=0.1)
    assert not random.ok and "random" in random.message


def test_fingerprint_mismatch_names_the_rank_and_host():
    ok = Fingerprint("code", 100, "abc")
    check_same([ok, ok], ["studio", "macbook"], "t")
    for other, what in ((Fingerprint("other", 100, "abc"), "code or task.args"),
                        (Fingerprint("code", 101, "abc"), "has 101 samples"),
                        (Fingerprint("code", 100, "xyz"), "samples on rank 1")):
        with pytest.raises(mlxdist.tasks.TaskError, match=rf"rank 1 \(macbook\).*|{what}") as e:
            check_same([ok, other], ["studio", "macbook"], "t")
        assert what in str(e.value) and "rank 1 (macbook)" in str(e.value) and e.value.all_ranks


# ---------------------------------------------------------------- check_task in process
def _user_task(name: str, **kw):
    sys.path.insert(0, str(HERE))
    try:
        import user_tasks
    finally:
        sys.path.remove(str(HERE))
    return getattr(user_tasks, name)(**kw)


@pytest.mark.parametrize("kw, expect", [({}, "ok:"), ({"mean": True}, "loss is a mean"),
                                        ({"batchnorm": True}, "samples are coupled")])
def test_check_task_flags_a_mean_loss_and_batchnorm(kw, expect):
    got = mlxdist.check_task(_user_task("mlx_mlp", **kw))
    assert got.message.startswith(expect), got.message
    assert got.ok == (expect == "ok:")


def test_check_task_cli_passes_a_torch_task(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("task:\n  factory: user_tasks:torch_mlp\n  args: {n: 64}\n")
    r = subprocess.run([sys.executable, "-m", "mlxdist.check_task", str(cfg), "--engine", "torch", "--device", "cpu"],
                       capture_output=True, text=True, env=env(), cwd=HERE, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok: 8 samples"), r.stdout + r.stderr


# ---------------------------------------------------------------- runs
def test_a_torch_task_trains_and_its_loss_falls(tmp_path):
    r = _train(["--engine", "torch", "--device", "cpu", "task.factory=user_tasks:torch_mlp", "train.steps=40",
                "train.batch_size=16", f"train.out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr
    steps = [json.loads(x) for x in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in steps if e["event"] == "step"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert steps[-1]["event"] == "end" and {e.get("unit") for e in steps if e["event"] == "step"} == {"samples"}


def test_resume_of_a_task_run_equals_no_interruption(tmp_path):
    task = ["task.factory=user_tasks:mlx_masked", "train.batch_size=6"]
    r = _train([*task, "train.steps=6", f"train.out_dir={tmp_path / 'whole'}"])
    assert r.returncode == 0, r.stderr
    r = _train([*task, "train.steps=3", "checkpoint.every=3", f"train.out_dir={tmp_path / 'split'}"])
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step_00000003" / "state.json").read_text())
    assert saved["config"]["task"]["factory"] == "user_tasks:mlx_masked"
    r = _train([*task, "train.steps=6", f"train.out_dir={tmp_path / 'split'}", "--resume", "auto"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "split"), atol=1e-6)
    r = subprocess.run([sys.executable, "-m", "mlxdist.generate", "--checkpoint", str(tmp_path / "whole"),
                        "--prompt", "hi"], capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode != 0 and "trained task.factory=user_tasks:mlx_masked, not the built-in" in r.stderr, r.stderr
    r = _train(["task.factory=user_tasks:mlx_mlp", "train.steps=7", f"train.out_dir={tmp_path / 'split'}",
                "--resume", "auto"])
    assert r.returncode == 2 and "resume with the same task" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize("args, message", [
    (["task.factory=no_such_module:make"], "task.factory 'no_such_module:make': no module 'no_such_module'"),
    (["task.factory=user_tasks:no_such_name"], "module user_tasks (" ),
    (["task.factory=user_tasks:not_a_task"], "returned dict, not an mlxdist.Task"),
    (["task.factory=user_tasks:mlx_mlp", "task.args={vector: true}"], "returned shape (8,), not a scalar"),
    (["task.factory=user_tasks:mlx_mlp", "model.preset=small"], "model.preset is set, but a task brings its own"),
])
def test_bad_tasks_get_one_line_and_exit_2(tmp_path, args, message):
    r = _train([*args, "train.steps=2", "train.batch_size=8", f"train.out_dir={tmp_path}"])
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, r.stderr


def test_a_step_with_nothing_to_count_is_skipped_and_counted(tmp_path):
    r = _train(["task.factory=user_tasks:zero_count", "train.steps=2", "train.batch_size=4",
                f"train.out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("the task's count was 0 on every rank; update skipped") == 2, r.stderr
    events = [json.loads(x) for x in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "empty_step"] == [0, 1]


# ---------------------------------------------------------------- real ranks
@pytest.mark.cluster
def test_unequal_ranks_train_a_task_like_one_process(tmp_path):
    """Ranks draw different initial weights (rank_init); 3+5 on two ranks must equal 8 on one,
    through the config route and through mlxdist.fit under mpirun."""
    task = ["task.factory=user_tasks:mlx_mlp", "task.args={rank_init: true}", "train.steps=6"]
    r = _train([*task, "train.batch_size=8", f"train.out_dir={tmp_path / 'one'}"])
    assert r.returncode == 0, r.stderr
    r = _train([*task, SPLIT, f"train.out_dir={tmp_path / 'two'}"], np_=2)
    assert r.returncode == 0 and "shares [3, 5]" in r.stderr, r.stderr
    script = tmp_path / "my_train.py"
    script.write_text(
        "import sys\nimport mlxdist\nfrom user_tasks import mlx_mlp\n"
        f"sys.exit(mlxdist.fit(mlx_mlp(rank_init=True), overrides={[*TASK_FAST, 'train.steps=6', SPLIT]!r} + "
        f"['train.out_dir={tmp_path / 'fit'}']))\n")
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH",
           sys.executable, str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE,
                       env=env() | {"PYTHONPATH": f"{env()['PYTHONPATH']}:{HERE}"})
    assert r.returncode == 0, r.stderr
    one = final_weights(tmp_path / "one")
    assert_same_weights(one, final_weights(tmp_path / "two"), atol=1e-5)
    assert_same_weights(one, final_weights(tmp_path / "fit"), atol=1e-5)


@pytest.mark.cluster
def test_masked_sum_with_variable_counts_is_exact_across_ranks(tmp_path):
    task = ["task.factory=user_tasks:mlx_masked", "train.steps=5"]
    assert _train([*task, "train.batch_size=8", f"train.out_dir={tmp_path / 'one'}"]).returncode == 0
    r = _train([*task, SPLIT, f"train.out_dir={tmp_path / 'two'}"], np_=2)
    assert r.returncode == 0, r.stderr
    assert_same_weights(final_weights(tmp_path / "one"), final_weights(tmp_path / "two"), atol=1e-5)


@pytest.mark.cluster
def test_ranks_with_different_datasets_stop_naming_the_rank(tmp_path):
    r = _train(["task.factory=user_tasks:rank_dependent_length", "train.steps=2", f"train.out_dir={tmp_path}"], np_=2)
    assert r.returncode == 2, r.stderr
    assert "the dataset on rank 1 (" in r.stderr and "has 257 samples, rank 0's" in r.stderr, r.stderr
    assert not (tmp_path / "checkpoints").exists()



def test_an_mlx_lm_model_trains_as_a_task(tmp_path):
    """Code nobody here wrote: mlx-lm's Llama (tiny config) as the user's model, as it is."""
    r = _train(["task.factory=user_tasks:mlx_lm_llama", "train.steps=60", "train.batch_size=16",
                "train.eval_every=60", f"train.out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr
    assert "model: Model from task user_tasks:mlx_lm_llama" in r.stderr and "tok/s" not in r.stderr
    events = [json.loads(x) for x in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    final = [e["eval_loss"] for e in events if e["event"] == "eval"][-1]
    assert final < 0.9 * np.log(32), final  # uniform guessing over the 32-token vocabulary


@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_the_readme_examples_run_as_printed(tmp_path, engine):
    """The complete examples printed in docs/your-model.md (the README links there) are the files, and they train."""
    example = HERE.parent / "examples" / f"your_model_{engine}.py"
    page = (HERE.parent / "docs" / "your-model.md").read_text()
    indented = "\n".join(("    " + line) if line else "" for line in example.read_text().rstrip("\n").split("\n"))
    assert indented in page, f"docs/your-model.md's copy of {example.name} is out of date"
    r = subprocess.run([sys.executable, str(example), "train.steps=150", "train.eval_every=150", "metrics.port=0",
                        "train.progress=false", f"train.out_dir={tmp_path}"],
                       capture_output=True, text=True, env=env(), timeout=300)
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert [e["eval_loss"] for e in events if e["event"] == "eval"][-1] < 0.7 * np.log(2)  # from ln 2 (a coin) at the start


def test_out_of_memory_recollates_the_same_samples_smaller(tmp_path):
    """An OOM at step 2 shrinks the micro-batch (8 -> 6: micro-batches of 6 and 2) and redoes the step from the same dataset
    indices (re-collated): the weights equal a run without the OOM."""
    task = ["task.factory=user_tasks:mlx_masked", "train.batch_size=8", "train.steps=4"]
    assert _train([*task, f"train.out_dir={tmp_path / 'plain'}"]).returncode == 0
    r = _train([*task, f"train.out_dir={tmp_path / 'oom'}"], extra_env={"MLXDIST_INJECT_OOM": "0:2"})
    assert r.returncode == 0 and "micro-batch 8 -> 6, retrying the step" in r.stderr, r.stderr
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "oom"), atol=1e-5)


@pytest.mark.cluster
def test_ranks_reading_different_built_in_data_stop_naming_the_rank(tmp_path):
    """The same check covers the built-in data: two ranks started with different data (mpirun's
    `:` syntax, here a different synthetic seed) stop before training, naming rank 1."""
    def rank(seed: int) -> list[str]:
        return ["-np", "1", sys.executable, "-m", "mlxdist.train", "data.source=synthetic", "data.seq_len=16",
                f"train.seed={seed}", "train.steps=2", "metrics.port=0", f"train.out_dir={tmp_path}"]

    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", *rank(1), ":", *rank(2)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 2, r.stderr
    assert "task built-in LM: the dataset's samples on rank 1 (" in r.stderr and "differ from rank 0's" in r.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_eval_batches_0_scores_the_whole_eval_set_once_and_a_raising_factory_exits_2(tmp_path):
    r = _train(["task.factory=user_tasks:mlx_mlp", "train.steps=1", "train.batch_size=24", "train.eval_every=1",
                "train.eval_batches=0", f"train.out_dir={tmp_path / 'ev'}"])
    assert r.returncode == 0, r.stderr
    import mlx.core as mx

    task = _user_task("mlx_mlp")
    from mlxdist.config import load_config
    from mlxdist.engine.mlx_engine import MLXEngine
    from mlxdist.state import checkpoint as ckpt

    engine = MLXEngine(load_config(None, []), task)  # the same model, the saved weights
    engine.set_weights(ckpt.load_latest(tmp_path / "ev" / "checkpoints").weights)
    whole = task.make_batch(task.eval_dataset, range(len(task.eval_dataset)))  # 64 samples: 24 + 24 + 16
    loss, count = engine.eval_loss(whole)
    logged = [json.loads(x) for x in (tmp_path / "ev" / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert count == 64 and mx.isclose(mx.array([e["eval_loss"] for e in logged if e["event"] == "eval"][-1]),
                                      mx.array(loss / count), rtol=1e-5).item()
    r = _train(["task.factory=user_tasks:mlx_mlp", "task.args={n: -1}", "train.steps=1", f"train.out_dir={tmp_path}"])
    assert r.returncode == 2 and "task.factory 'user_tasks:mlx_mlp' raised ValueError" in r.stderr, r.stderr


@pytest.mark.cluster
def test_a_task_whose_frozen_base_differs_between_ranks_or_from_the_checkpoint_stops(tmp_path):
    r = _train(["task.factory=user_tasks:mlx_frozen_base", "task.args={by_rank: true}", "train.steps=2",
                f"train.out_dir={tmp_path / 'ranks'}"], np_=2)
    assert r.returncode == 2, r.stderr
    assert "the frozen weights on rank 1 (" in r.stderr and "copy the same files the task loads" in r.stderr
    r = _train(["task.factory=user_tasks:mlx_frozen_base", "train.steps=2", "checkpoint.every=2",
                f"train.out_dir={tmp_path / 'run'}"])
    assert r.returncode == 0 and "136 trained" not in r.stderr, r.stderr
    r = _train(["task.factory=user_tasks:mlx_frozen_base", "train.steps=4", f"train.out_dir={tmp_path / 'run'}",
                "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    r = _train(["task.factory=user_tasks:mlx_frozen_base", "train.steps=6", f"train.out_dir={tmp_path / 'run'}",
                "--resume", "auto"], extra_env={"BASE_SEED": "7"})
    assert r.returncode == 2 and "resume with the base it was trained on" in r.stderr, r.stderr
