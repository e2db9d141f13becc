"""The MLX model and engine: presets, activation checkpointing, mixed precision."""

import dataclasses

import numpy as np
import pytest

from mlxdist.config import Config, ModelConfig
from mlxdist.engine.base import local_step
from mlxdist.models.presets import PRESETS, param_count, resolve

mx = pytest.importorskip("mlx.core")


def test_preset_sizes_are_what_their_names_say():
    sizes = {p: param_count(resolve(ModelConfig(preset=p))) for p in PRESETS}
    assert 25e6 < sizes["small"] < 35e6 and 110e6 < sizes["base"] < 140e6
    assert 300e6 < sizes["350m"] < 400e6 and 0.9e9 < sizes["1b"] < 1.2e9


def _engine(**model):
    from mlxdist.engine.mlx_engine import MLXEngine

    return MLXEngine(dataclasses.replace(Config(), model=dataclasses.replace(Config().model, **model)))


def _grads(engine, tokens):
    engine.micro_step(tokens)
    return {k: np.array(v) for k, v in engine._grads.items()}


def test_activation_checkpointing_gives_the_same_gradients():
    tokens = np.random.default_rng(0).integers(0, 250, (2, 17)).astype(np.int32)
    plain = _grads(_engine(grad_checkpoint_every=0), tokens)
    every_other = _grads(_engine(grad_checkpoint_every=2), tokens)
    for k in plain:
        np.testing.assert_allclose(plain[k], every_other[k], rtol=1e-4, atol=1e-6)


def test_bf16_compute_keeps_fp32_master_weights_and_learns():
    e = _engine(dtype="bfloat16")
    tokens = np.tile(np.arange(97, 114, dtype=np.int32), (4, 1))
    losses = []
    for _ in range(15):
        e.micro_step(tokens)
        losses.append(local_step(e, 3e-3).loss)
    assert all(v.dtype == mx.float32 for v in e.params.values())
    assert all(v.dtype == mx.float32 for state in e.opt_state.values() for v in state.values())
    assert losses[-1] < 0.5 * losses[0]
