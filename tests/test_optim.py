"""`train.optimizer=lion` (mlxdist.optim): the second built-in optimizer, half of AdamW's state.
Its update on either engine is the paper's formula (a numpy reference written here), a sharded
run (ZeRO-1, ZeRO-3) equals data parallel, a resume is bit-exact, its checkpoints hold `m.` only
and refuse to resume an AdamW run (and the reverse) in one line, and the plan counts 4 bytes a
parameter."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import assert_same_weights, final_weights
from test_sharded import SPLIT, TORCH, _checkpoint, _events, _max_diff, _ok, _train

from mlxdist.config import load_config
from mlxdist.control.memory_plan import MODES, plan
from mlxdist.engine.base import local_step
from mlxdist.optim import OPTIMIZERS
from mlxdist.sync.strategy import memory_lines
from mlxdist.tasks import Batch

LION = "train.optimizer=lion"
STAGED = "task.factory=user_tasks:mlx_staged_mlp"
HP = ["train.weight_decay=0.3", "train.grad_clip=0.5"]


def _reference_lion(w: dict, m: dict, g: dict, lr: float, wd: float, clip: float) -> None:
    """Lion (Chen et al. 2023, Algorithm 2) on float64 copies, betas (0.9, 0.99), decoupled decay
    on >= 2-D weights; `g` of the mean loss, clipped to the global norm `clip` as mlxdist clips."""
    norm = np.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g.values()))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    for k in w:
        gk = g[k] * coef
        c = 0.9 * m[k] + 0.1 * gk
        if w[k].ndim >= 2:
            w[k] = w[k] * (1 - lr * wd)
        w[k] = w[k] - lr * np.sign(c)
        m[k] = 0.99 * m[k] + 0.01 * gk


def _engine(name: str):
    from user_tasks import mlx_mlp, torch_mlp

    cfg = load_config(None, [LION, *HP])
    if name == "torch":
        pytest.importorskip("torch")
        from mlxdist.engine.torch_engine import TorchEngine

        return TorchEngine(cfg, "cpu", task=torch_mlp())
    from mlxdist.engine.mlx_engine import MLXEngine

    return MLXEngine(cfg, mlx_mlp())


@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_lion_is_the_papers_update_on_either_engine_and_trains(engine):
    """Three updates from the engine's own gradients equal the numpy reference (weights and m);
    then the loss on a fixed batch falls; the state is `m.<param>` alone."""
    from user_tasks import Regression

    eng, data = _engine(engine), Regression(64)
    w = {k: v.astype(np.float64) for k, v in eng.get_weights().items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    batch = lambda i: Batch(np.arange(8), {"x": data.x[8 * i:8 * i + 8], "y": data.y[8 * i:8 * i + 8]}, 8)  # noqa: E731
    for t, lr in enumerate((1e-2, 5e-3, 2e-3), start=1):
        eng.micro_step(batch(t))
        got = eng.take_gradients()
        g = {n: np.array(a.tolist(), np.float64).reshape(w[n].shape) / got.count  # either framework
             for n, a in zip(eng.trained_names, got.arrays, strict=True)}
        _reference_lion(w, m, g, lr, 0.3, 0.5)
        eng.apply_gradients(got.arrays, got.loss_sum, got.count, lr)
    weights, (state, step) = eng.get_weights(), eng.get_optimizer_state()
    assert step == 3 and set(state) == {f"m.{n}" for n in w}
    for k in w:
        np.testing.assert_allclose(weights[k], w[k], atol=1e-6, err_msg=k)
        np.testing.assert_allclose(state[f"m.{k}"], m[k], atol=1e-7, err_msg=k)
    losses = []
    for _ in range(15):
        eng.micro_step(batch(0))
        losses.append(local_step(eng, 1e-2).loss)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.cluster
@pytest.mark.parametrize("case", ["mlx-zero1", "mlx-zero3", "torch-zero1"])
def test_lion_sharded_equals_data_parallel(tmp_path, case):
    """3+5 on two ranks, weight decay and clipping: ZeRO-1 (MLX, torch) and ZeRO-3 (MLX, the
    staged model) end where data parallel does, `m.` state included, each rank holding 4 bytes
    of optimizer state a parameter of its shard."""
    engine, level = case.split("-")
    base = [LION, SPLIT, "checkpoint.every=4", *([STAGED] if level == "zero3" else []), *(TORCH if engine == "torch" else [])]
    shard = {"zero1": "optimizer", "zero3": "weights"}[level]
    _ok(_train([*base, "dist.shard=none", f"train.out_dir={tmp_path / 'dp'}"], np_=2))
    r = _ok(_train([*base, f"dist.shard={shard}", f"train.out_dir={tmp_path / shard}"], np_=2))
    assert "Lion state of" in r.stderr, r.stderr[-3000:]
    assert_same_weights(final_weights(tmp_path / "dp"), final_weights(tmp_path / shard), atol=1e-5)
    saved, dp = _checkpoint(tmp_path / shard, 4), _checkpoint(tmp_path / "dp", 4)
    assert saved.optimizer.keys() == dp.optimizer.keys() and {k.split(".")[0] for k in saved.optimizer} == {"m"}
    assert _max_diff(saved.optimizer, dp.optimizer) <= 1e-6
    for rank in (0, 1):
        event = _events(tmp_path / shard, "shard", rank)[0]
        assert event["optimizer_bytes_here"] == 4 * event["elements"][rank]


@pytest.mark.cluster
def test_lion_resumes_exactly_and_refuses_another_optimizers_checkpoint(tmp_path):
    """Stopped at step 2 and resumed, a Lion run ends bit for bit where the uninterrupted one
    does; its checkpoint into an AdamW run, and an AdamW checkpoint into a Lion run, stop in
    one line naming both."""
    whole = tmp_path / "whole"
    _ok(_train([LION, "train.batch_size=8", "checkpoint.every=2", f"train.out_dir={whole}"]))
    step2 = whole / "checkpoints" / "step_00000002"
    r = _ok(_train([LION, "train.batch_size=8", f"train.out_dir={tmp_path / 'resumed'}", "--resume", str(step2)]))
    assert "resumed from" in r.stderr
    assert_same_weights(final_weights(whole), final_weights(tmp_path / "resumed"), atol=0.0)
    assert _max_diff(_checkpoint(whole, 4).optimizer, _checkpoint(tmp_path / "resumed", 4).optimizer) == 0.0

    r = _train(["train.batch_size=8", f"train.out_dir={tmp_path / 'adamw'}", "--resume", str(step2)])
    assert r.returncode != 0
    line = "the checkpoint holds lion's optimizer state (m per parameter) but this run trains with adamw"
    assert line in r.stderr and "train.optimizer=lion" in r.stderr, r.stderr[-3000:]
    _ok(_train(["train.batch_size=8", "train.steps=2", "checkpoint.every=2", f"train.out_dir={tmp_path / 'a'}"]))
    r = _train([LION, "train.batch_size=8", f"train.out_dir={tmp_path / 'lion'}",
                "--resume", str(tmp_path / "a" / "checkpoints" / "step_00000002")])
    assert r.returncode != 0
    assert re.search(r"holds adamw's optimizer state \(m, v per parameter\) but this run trains with lion", r.stderr)


def test_the_plan_counts_half_of_adamws_optimizer_bytes():
    """`python -m mlxdist.plan`'s numbers: every mode's optimizer column halves under Lion, and
    the update's new state with it (AdamW: new p, m, v, 12 bytes a parameter; Lion 8)."""
    hosts, n = [("studio", 64 * 2**30), ("macbook", 16 * 2**30)], 10_000_000
    plans = {o: plan(load_config(None, [f"train.optimizer={o}", "dist.shard=auto"]), hosts, n, None,
                  memory=memory_lines()) for o in ("adamw", "lion")}
    for mode in MODES:
        for a, b in zip(plans["adamw"].needs[mode], plans["lion"].needs[mode], strict=True):
            assert b.optimizer * 2 == a.optimizer > 0, mode
    assert plans["adamw"].needs["none"][0].update == 12 * n and plans["lion"].needs["none"][0].update == 8 * n


def test_an_unknown_optimizer_is_one_line_listing_the_choices():
    from mlxdist.config import ConfigError

    unknown = "not_an_optimizer"
    assert unknown not in OPTIMIZERS
    with pytest.raises(ConfigError, match=rf"^defaults \+ overrides: train.optimizer: '{unknown}' is not one of "
                                          rf"{', '.join(OPTIMIZERS)}$"):
        load_config(None, [f"train.optimizer={unknown}"])


