"""A task's whole model state, not just what gradients train (DESIGN promise 7): BatchNorm's
running statistics and other buffers are saved, restored on resume, equal on every rank
(running statistics combined by units, so 3+5 keeps what one process with 8 computes), and
the checkpoint loads strictly into the user's own class."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_train
from safetensors.numpy import load_file

HERE = Path(__file__).parent
SPLIT = "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"
COMMON = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
          "train.schedule=constant", "train.grad_clip=0", "dist.sync_weights_every=0"]
TASKS = {"torch": ["--engine", "torch", "--device", "cpu", "task.factory=user_tasks:torch_batchnorm"],
         "mlx": ["task.factory=user_tasks:mlx_mlp", "task.args={batchnorm: true}"]}


def _train(args, np_=0):
    r = run_train([*COMMON, *args], np_=np_, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _model(run: Path, step: int) -> dict[str, np.ndarray]:
    return load_file(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors")


def _stats(model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in model.items() if k.endswith(("running_mean", "running_var"))}


@pytest.fixture(scope="module", params=["torch", "mlx"])
def frozen_weights_runs(request, tmp_path_factory):
    """lr 0: the weights stay put, so the running statistics after 4 steps depend only on the
    samples each step saw: 1 rank with 8 against 2 ranks with 3+5."""
    engine, root = request.param, tmp_path_factory.mktemp(f"bn-{request.param}")
    args = [*TASKS[engine], "train.lr=0", "train.steps=4", "checkpoint.every=4"]
    _train([*args, "train.batch_size=8", f"train.out_dir={root / 'one'}"])
    _train([*args, SPLIT, f"train.out_dir={root / 'two'}"], np_=2)
    return engine, root


@pytest.mark.cluster
def test_running_statistics_of_3_plus_5_equal_one_process_with_8(frozen_weights_runs):
    _, root = frozen_weights_runs
    one, two = _stats(_model(root / "one", 4)), _stats(_model(root / "two", 4))
    assert one.keys() == two.keys() and len(one) == 2, one.keys()
    mean = next(k for k in one if k.endswith("running_mean"))
    assert np.abs(one[mean]).max() > 1e-3  # they moved off their initial zeros
    np.testing.assert_allclose(two[mean], one[mean], atol=1e-5)
    # The variance is each rank's unbiased batch variance, averaged: close, not exact.
    var = next(k for k in one if k.endswith("running_var"))
    np.testing.assert_allclose(two[var], one[var], rtol=0.1)


@pytest.mark.cluster
def test_checkpoint_loads_strictly_into_the_users_class(frozen_weights_runs):
    engine, root = frozen_weights_runs
    path = root / "two" / "checkpoints" / "step_00000004" / "model.safetensors"
    sys.path.insert(0, str(HERE))
    try:
        import user_tasks
    finally:
        sys.path.remove(str(HERE))
    saved = load_file(path)
    if engine == "torch":
        import torch

        model = user_tasks.torch_batchnorm().build(None)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in saved.items()}, strict=True)
        got = {k: v.numpy() for k, v in model.state_dict().items()}
        assert int(got["1.num_batches_tracked"]) == 4
    else:
        from mlx.utils import tree_flatten

        model = user_tasks.mlx_mlp(batchnorm=True).build(None)
        model.load_weights(str(path), strict=True)
        got = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    assert got.keys() == saved.keys()
    for k, v in _stats(saved).items():
        np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_resume_keeps_the_buffers(tmp_path, engine):
    args = [*TASKS[engine], "train.lr=1e-2", "train.batch_size=8", "checkpoint.every=3"]
    _train([*args, "train.steps=6", f"train.out_dir={tmp_path / 'whole'}"])
    _train([*args, "train.steps=3", f"train.out_dir={tmp_path / 'parts'}"])
    r = _train([*args, "train.steps=6", f"train.out_dir={tmp_path / 'parts'}", "--resume", "auto"])
    assert "holds no" not in r.stderr
    whole, parts = _model(tmp_path / "whole", 6), _model(tmp_path / "parts", 6)
    assert whole.keys() == parts.keys() and _stats(whole)
    for k in whole:
        np.testing.assert_allclose(parts[k], whole[k], atol=1e-6, err_msg=k)
