"""examples/audio (WAV -> log-mel -> CNN) trained through the real CLI, the way its README runs
it: from examples/audio, `task.factory: task:make_task`, the torch engine on the CPU.

Tiny data (24 half-second clips, 32 mels) keeps the module to a few tens of seconds."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from helpers import ROOT, assert_same_weights, final_weights, logged_steps, run_train

pytestmark = pytest.mark.cluster

AUDIO = ROOT / "examples" / "audio"
BASE = ["--engine", "torch", "--device", "cpu", "task.factory=task:make_task", "metrics.port=0",
        "train.progress=false", "train.eval_every=0", "checkpoint.every=0", "dist.sync_weights_every=0"]


@pytest.fixture(scope="module")
def data_args(tmp_path_factory) -> str:
    """The synthetic set made once, and its mels cached, before any rank starts."""
    spec = importlib.util.spec_from_file_location("audio_task", AUDIO / "task.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    args = {"root": str(tmp_path_factory.mktemp("audio") / "chords"), "seconds": 0.5, "per_label": 6,
            "n_mels": 32, "hop": 256}
    made = task.make_task(**args)
    assert (len(made.dataset), len(made.eval_dataset)) == (20, 4)  # every 5th clip of each label held out
    assert made.dataset[0]["mel"].shape == (1, 32, 28) and made.dataset[0]["mel"].dtype == np.float32
    return "task.args={" + ", ".join(f"{k}: {v}" for k, v in args.items()) + "}"


def _train(args: list[str], np_: int = 0):
    r = run_train([*BASE, *args], np_=np_, cwd=AUDIO, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def test_unequal_ranks_train_and_the_loss_falls(tmp_path, data_args):
    r = _train([data_args, "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}", "train.steps=30",
                "train.lr=3e-3", "train.warmup_steps=0", f"train.out_dir={tmp_path}"], np_=2)
    assert "shares [3, 5]" in r.stderr, r.stderr
    losses = [e["loss"] for e in logged_steps(tmp_path)]
    assert len(losses) == 30 and {e["unit"] for e in logged_steps(tmp_path)} == {"clips"}
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses


def test_resume_equals_an_uninterrupted_run(tmp_path, data_args):
    same = [data_args, "train.batch_size=6", "train.schedule=constant", "train.warmup_steps=0",
            "train.grad_clip=0", "train.lr=1e-2"]
    _train([*same, "train.steps=6", f"train.out_dir={tmp_path / 'whole'}"])
    _train([*same, "train.steps=3", "checkpoint.every=3", f"train.out_dir={tmp_path / 'split'}"])
    r = _train([*same, "train.steps=6", f"train.out_dir={tmp_path / 'split'}", "--resume", "auto"])
    assert "resumed from" in r.stderr, r.stderr
    whole, split = final_weights(tmp_path / "whole"), final_weights(tmp_path / "split")
    assert "0.weight" in whole  # torch parameter names: the first conv
    assert_same_weights(whole, split, atol=1e-5)
