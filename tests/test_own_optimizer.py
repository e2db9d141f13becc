"""A task's own optimizer (`Task.optimizer`): parameter groups with their own learning rate and
weight decay, scaled by the schedule, its state checkpointed and resumed exactly, and 3+5 == 8
(the gradients are summed over ranks and divided by the units before it steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import run_train
from safetensors.numpy import load_file

HERE = Path(__file__).parent
SPLIT = "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"
COMMON = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=2",
          "train.schedule=cosine", "train.lr=1e-2", "dist.sync_weights_every=0"]
TASKS = {"torch": ["--engine", "torch", "--device", "cpu", "task.factory=user_tasks:torch_own_optimizer"],
         "mlx": ["task.factory=user_tasks:mlx_own_optimizer"]}


def _train(args, np_=0, ok=True):
    r = run_train([*COMMON, *args], np_=np_, cwd=HERE)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _files(run: Path, step: int) -> tuple[dict, dict]:
    d = run / "checkpoints" / f"step_{step:08d}"
    return load_file(d / "model.safetensors"), load_file(d / "optimizer.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Per engine, one process with the global batch of 8 for 6 steps and a checkpoint every 3:
    the 3+5 test's one process and the resume test's uninterrupted run (a checkpoint changes
    nothing about the training), launched once for both."""
    runs: dict[str, tuple[Path, str]] = {}

    def run(engine: str) -> tuple[Path, str]:
        if engine not in runs:
            out = tmp_path_factory.mktemp(f"one-{engine}")
            r = _train([*TASKS[engine], "train.batch_size=8", "checkpoint.every=3", "train.steps=6",
                        f"train.out_dir={out}"])
            runs[engine] = out, r.stderr
        return runs[engine]

    return run


@pytest.mark.cluster
@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_own_optimizer_3_plus_5_equals_8(tmp_path, one_process, engine):
    one, stderr = one_process(engine)
    _train([*TASKS[engine], "train.steps=6", "checkpoint.every=6", SPLIT, f"train.out_dir={tmp_path / 'two'}"], np_=2)
    assert "(the task's)" in stderr, stderr[-2000:]
    (w1, o1), (w2, o2) = _files(one, 6), _files(tmp_path / "two", 6)
    assert o1.keys() == o2.keys() and any(k.endswith(("momentum_buffer", ".v")) for k in o1), o1.keys()
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], atol=1e-5, err_msg=k)
    for k in o1:
        np.testing.assert_allclose(o2[k], o1[k], atol=1e-5, err_msg=k)


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_own_optimizer_resumes_exactly(tmp_path, one_process, engine):
    args = [*TASKS[engine], "train.batch_size=8", "checkpoint.every=3"]
    whole, _ = one_process(engine)
    _train([*args, "train.steps=3", f"train.out_dir={tmp_path / 'parts'}"])
    _train([*args, "train.steps=6", f"train.out_dir={tmp_path / 'parts'}", "--resume", "auto"])
    (w1, o1), (w2, o2) = _files(whole, 6), _files(tmp_path / "parts", 6)
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], atol=1e-6, err_msg=k)
    assert o1.keys() == o2.keys()


@pytest.mark.parametrize("args, expect", [
    ({"raises": True}, "optimizer(model) raised KeyError: 'lr_head'"),
    ({"not_one": True}, "optimizer(model) returned dict, not a torch.optim.Optimizer"),
])
def test_a_bad_optimizer_is_one_line(tmp_path, args, expect):
    flags = ", ".join(f"{k}: true" for k in args)
    r = _train([*TASKS["torch"], f"task.args={{{flags}}}", "train.steps=1", f"train.out_dir={tmp_path}"], ok=False)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if expect in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
