"""examples/recursive: the tiny recursive Sudoku model, trained through the config route on
torch CPU ranks from its own folder, as its README says. Tiny sizes keep the file fast; the
runs are shared by the tests (module fixtures)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, assert_same_weights, env, final_weights, logged_steps, run_train

pytest.importorskip("torch")
pytestmark = pytest.mark.cluster

HERE = ROOT / "examples" / "recursive"
STEPS = 20
TINY = ("task.args={train: 64, eval: 16, blanks: 40, data_dir: null, dim: 16, layers: 1, n: 1, cycles: 2, "
        "supervision: 2}")
# Exact comparisons: nothing that depends on the number of ranks (clipping, weight re-sync).
EXACT = ["--engine", "torch", "--device", "cpu", "--config", "configs/mac.yaml", TINY, "metrics.port=0",
         "train.progress=false", "train.eval_every=0", "train.grad_clip=0", "checkpoint.every=0",
         "dist.sync_weights_every=0", "train.schedule=constant", "train.warmup_steps=0", "train.lr=1e-2"]
SPLIT = "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"


def _train(out, args, np_=0):
    r = run_train([*EXACT, *args, f"train.out_dir={out}"], np_=np_, cwd=HERE)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    _train(out, [f"train.steps={STEPS}", "train.batch_size=8"])
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    r = _train(out, [f"train.steps={STEPS}", SPLIT], np_=2)
    assert "shares [3, 5]" in r.stderr, r.stderr
    return out


def test_unequal_ranks_learn_sudoku(two):
    steps = logged_steps(two)
    # rank 0 counts the blank cells of its 3 puzzles (up to 40 each), not the puzzles
    assert {e["unit"] for e in steps} == {"cells"} and all(90 <= e["units"] <= 120 for e in steps)
    losses = [e["loss"] for e in steps]
    assert len(losses) == STEPS
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05, losses  # from ln 9 = 2.20: a guess among 9 digits


def test_three_plus_five_on_two_ranks_equals_eight_on_one(one, two):
    assert_same_weights(final_weights(one), final_weights(two), atol=1e-5)


def test_a_checkpoint_resumes_like_no_interruption(one, tmp_path):
    half = STEPS // 2
    _train(tmp_path, [f"train.steps={half}", f"checkpoint.every={half}", "train.batch_size=8"])
    r = _train(tmp_path, [f"train.steps={STEPS}", "train.batch_size=8", "--resume", "auto"])
    assert "resumed from" in r.stderr, r.stderr
    assert logged_steps(tmp_path)[0]["step"] == 1 and logged_steps(tmp_path)[-1]["step"] == STEPS
    assert_same_weights(final_weights(one), final_weights(tmp_path), atol=1e-6)


def test_evaluate_reports_exact_cell_accuracy_of_the_latest_checkpoint(one):
    r = subprocess.run([sys.executable, "task.py", "eval", str(one)], capture_output=True, text=True, cwd=HERE,
                       env=env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"step {STEPS}: exact-cell accuracy 0.") and "of 16 held-out puzzles" in r.stdout
