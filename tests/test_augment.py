"""Randomness that keeps exactness (DESIGN promise 7): `Task.augment(sample, rng)` with an rng
seeded by (train.seed, stream position), per-sample seeds for the model's own randomness
(`mlxdist.tasks.sample_seeds()`), and check_task naming each way randomness breaks 3+5 == 8.

The tasks are `user_tasks.mlx_random` / `torch_random`; the runs reuse test_tasks' settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import user_tasks
from helpers import assert_same_weights, final_weights
from test_tasks import SPLIT, _train

import mlxdist
from mlxdist.data.batch import BatchMaker
from mlxdist.data.sampler import GlobalSampler, StreamIndices
from mlxdist.tasks import TaskError, sample_seeds, sample_seeds_of
from mlxdist.tasks.fingerprint import check_same, fingerprint


def _rows(batch) -> list[tuple]:
    return [(x.tobytes(), y.tobytes()) for x, y in zip(batch.data["x"], batch.data["y"], strict=True)]


# ---------------------------------------------------------------- plain logic
def test_each_sample_is_augmented_by_its_stream_position_whatever_the_split():
    task = user_tasks.mlx_random(n=10, augment=True)
    stream = GlobalSampler(10, seed=7).indices(6, 8)  # positions 6..13: crosses into epoch 1
    assert stream.positions.tolist() == list(range(6, 14))
    whole = task.make_batch(task.dataset, stream)
    maker = BatchMaker(lambda idx: task.make_batch(task.dataset, idx), GlobalSampler(10, 7), rank=0)
    parts = maker.split(stream, 3)  # micro-batches 3+3+2, as on a rank with micro 3
    assert [len(p) for p in parts] == [3, 3, 2]
    assert sum((_rows(p) for p in parts), []) == _rows(whole)
    assert np.concatenate([p.seeds for p in parts]).tolist() == whole.seeds.tolist()
    again = maker.split(np.concatenate([p.indices for p in parts]), 5)  # the out-of-memory re-split
    assert sum((_rows(p) for p in again), []) == _rows(whole)
    # the rng is default_rng([seed, position]); augmentation really changes the sample
    i, p = int(stream[0]), int(stream.positions[0])
    want = user_tasks.flip_and_jitter(task.dataset[i], np.random.default_rng([7, p]))
    assert whole.data["x"][0].tobytes() == want["x"].tobytes()
    assert not np.array_equal(whole.data["x"][0], task.dataset[i]["x"])
    # the same dataset index at another position (another epoch) is augmented and seeded anew
    later = task.make_batch(task.dataset, StreamIndices([i], [p + 10], 7))
    assert later.data["x"][0].tobytes() != want["x"].tobytes() and later.seeds[0] != whole.seeds[0]
    # plain indices still make a batch: positions equal to the indices, seed 0
    plain = task.make_batch(task.dataset, [i])
    assert plain.seeds.tolist() == task.make_batch(task.dataset, StreamIndices([i], [i], 0)).seeds.tolist()


def test_sample_seeds_are_the_batch_s_inside_its_loss_only():
    task = user_tasks.mlx_random(n=10)
    batch = task.make_batch(task.dataset, GlobalSampler(10, 0).indices(0, 4))
    assert batch.seeds.dtype == np.uint64 and len(set(batch.seeds.tolist())) == 4
    with pytest.raises(RuntimeError, match="only known inside the task's loss"):
        sample_seeds()
    with sample_seeds_of(batch):
        assert sample_seeds() is batch.seeds
    with pytest.raises(RuntimeError):
        sample_seeds()


def test_the_fingerprint_reads_samples_before_augment_and_names_a_dataset_random_when_read():
    plain, augmented = fingerprint(user_tasks.mlx_random()), fingerprint(user_tasks.mlx_random(augment=True))
    assert plain == augmented and not augmented.random_reads
    a, b = fingerprint(user_tasks.mlx_random(random_reads=True)), fingerprint(user_tasks.mlx_random(random_reads=True))
    assert a.random_reads and a.samples != b.samples
    with pytest.raises(TaskError) as e:
        check_same([a, b], ["studio", "macbook"], "t")
    assert "rank 1 (macbook) returns different samples for the same index" in str(e.value)
    assert "Task.augment(sample, rng)" in str(e.value) and "BatchNorm" not in str(e.value)


# ---------------------------------------------------------------- check_task, in process
@pytest.mark.parametrize("kw, expect", [
    ({"augment": True, "dropout": True}, "ok:"),
    ({"random_reads": True}, "the dataset returns different samples for the same index"),
    ({"unseeded_augment": True}, "the same samples at the same stream positions made different batches"),
    ({"random_forward": True}, "the forward pass is random"),
    ({"stateful": True}, "state is carried between batches"),
    ({"batchnorm": True}, "samples are coupled"),
])
def test_check_task_names_each_way_randomness_or_state_breaks_the_sum_rule(kw, expect):
    task = user_tasks.mlx_mlp(**kw) if "batchnorm" in kw else user_tasks.mlx_random(**kw)
    got = mlxdist.check_task(task)
    assert got.message.startswith(expect) and got.ok == (expect == "ok:"), got.message
    fixes = {"random_reads": "Task.augment(sample, rng)", "random_forward": "sample_seeds()",
             "stateful": "depend only on the weights and the batch", "batchnorm": "LayerNorm"}
    assert all(fix in got.message for k, fix in fixes.items() if k in kw), got.message


@pytest.mark.parametrize("kw, expect", [({}, "ok:"), ({"dropout": False, "random_forward": True},
                                                      "the forward pass is random")])
def test_check_task_on_the_torch_engine_keeps_per_sample_dropout_exact(kw, expect):
    got = mlxdist.check_task(user_tasks.torch_random(**kw), engine="torch", device="cpu")
    assert got.message.startswith(expect), got.message


# ---------------------------------------------------------------- real ranks
def _eval_losses(run_dir) -> list[float]:
    events = [json.loads(x) for x in (run_dir / "logs" / "rank0.jsonl").read_text().splitlines()]
    return [e["eval_loss"] for e in events if e["event"] == "eval"]


@pytest.mark.cluster
def test_augmentation_and_per_sample_dropout_keep_3_plus_5_equal_to_8(tmp_path):
    """Each on its own: 2 ranks with 3+5 train to the weights of 1 rank with 8 (and score the
    same augmented eval set), while the randomness really changes what is trained."""
    common = ["task.factory=user_tasks:mlx_random", "train.steps=6", "train.eval_every=3", "train.eval_batches=0"]
    r = _train([*common, "task.args={n: 36}", "train.batch_size=8", f"train.out_dir={tmp_path / 'plain'}"])
    assert r.returncode == 0, r.stderr
    plain = final_weights(tmp_path / "plain")
    for flag in ("augment", "dropout"):
        task = [*common, f"task.args={{{flag}: true, n: 36}}"]  # 48 samples: into epoch 1 within step 4
        r = _train([*task, "train.batch_size=8", f"train.out_dir={tmp_path / flag / 'one'}"])
        assert r.returncode == 0, r.stderr
        r = _train([*task, SPLIT, f"train.out_dir={tmp_path / flag / 'two'}"], np_=2)
        assert r.returncode == 0 and "shares [3, 5]" in r.stderr, r.stderr
        one, two = final_weights(tmp_path / flag / "one"), final_weights(tmp_path / flag / "two")
        assert_same_weights(one, two, atol=1e-5)
        print(f"{flag}: 3+5 vs 8 max weight difference "
              f"{max(float(np.abs(one[k] - two[k]).max()) for k in one):.3g}")
        assert max(float(np.abs(one[k] - plain[k]).max()) for k in one) > 1e-3, f"{flag} changed nothing"
        assert np.allclose(_eval_losses(tmp_path / flag / "one"), _eval_losses(tmp_path / flag / "two"), rtol=1e-5)


@pytest.mark.cluster
def test_an_augmented_dropped_out_run_resumed_at_step_3_equals_one_never_stopped(tmp_path):
    task = ["task.factory=user_tasks:mlx_random", "task.args={augment: true, dropout: true, n: 36}", SPLIT]
    r = _train([*task, "train.steps=6", f"train.out_dir={tmp_path / 'whole'}"], np_=2)
    assert r.returncode == 0, r.stderr
    r = _train([*task, "train.steps=3", "checkpoint.every=3", f"train.out_dir={tmp_path / 'split'}"], np_=2)
    assert r.returncode == 0, r.stderr
    r = _train([*task, "train.steps=6", f"train.out_dir={tmp_path / 'split'}", "--resume", "auto"], np_=2)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr
    whole, split = final_weights(tmp_path / "whole"), final_weights(tmp_path / "split")
    print(f"resume: max weight difference {max(float(np.abs(whole[k] - split[k]).max()) for k in whole):.3g}")
    assert_same_weights(whole, split, atol=1e-6)


def test_an_out_of_memory_retry_recollates_the_same_augmented_samples(tmp_path):
    """The retry re-splits the step's indices (loop: np.concatenate of the batches' indices):
    their positions travel with them, so the samples are augmented as before."""
    task = ["task.factory=user_tasks:mlx_random", "task.args={augment: true, dropout: true}", "train.batch_size=8",
            "train.steps=4"]
    assert _train([*task, f"train.out_dir={tmp_path / 'plain'}"]).returncode == 0
    r = _train([*task, f"train.out_dir={tmp_path / 'oom'}"], extra_env={"MLXDIST_INJECT_OOM": "0:2"})
    assert r.returncode == 0 and "micro-batch 8 -> 6, retrying the step" in r.stderr, r.stderr
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "oom"), atol=1e-6)


@pytest.mark.cluster
def test_ranks_whose_dataset_is_random_when_read_stop_naming_the_cause(tmp_path):
    r = _train(["task.factory=user_tasks:mlx_random", "task.args={random_reads: true}", "train.steps=2",
                f"train.out_dir={tmp_path}"], np_=2)
    assert r.returncode == 2, r.stderr
    assert "the dataset on rank 1 (" in r.stderr and "returns different samples for the same index" in r.stderr
    assert "Task.augment(sample, rng)" in r.stderr and "BatchNorm" not in r.stderr, r.stderr
