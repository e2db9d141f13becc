"""One-line start-up messages: the torch engine's note on slow CPU autocast, and the line a
checkpoint that does not fit the model gives (instead of a list of every parameter)."""

from __future__ import annotations

import numpy as np
import pytest

from mlxdist.models.weights import weights_mismatch


def test_bf16_autocast_on_a_cpu_is_named_with_the_key_that_turns_it_off():
    torch_engine = pytest.importorskip("mlxdist.engine.torch_engine")
    note = torch_engine.slow_autocast_note("cpu", "bfloat16")
    assert note is not None and "\n" not in note
    assert "bfloat16 autocast is slow on a CPU" in note and "model.dtype=float32" in note
    assert "float16 autocast" in torch_engine.slow_autocast_note("cpu", "float16")


@pytest.mark.parametrize("device_type, dtype", [("cpu", "float32"), ("mps", "bfloat16"), ("cuda", "bfloat16"),
                                                ("cuda", "float16"), ("mps", "float32")])
def test_no_note_where_autocast_is_fast_or_off(device_type, dtype):
    torch_engine = pytest.importorskip("mlxdist.engine.torch_engine")
    assert torch_engine.slow_autocast_note(device_type, dtype) is None


def test_a_cpu_engine_with_bf16_carries_the_note_for_the_banner():
    """The loop prints `engine.capabilities.notes` after the banner (training/loop.py)."""
    pytest.importorskip("torch")
    from user_tasks import torch_mlp

    from mlxdist.config import load_config
    from mlxdist.engine.torch_engine import TorchEngine

    for dtype, notes in (("bfloat16", 1), ("float32", 0)):
        engine = TorchEngine(load_config(None, [f"model.dtype={dtype}"]), "cpu", task=torch_mlp(16))
        got = engine.capabilities.notes
        assert len(got) == notes and all("model.dtype=float32" in n for n in got)


def _layers(n: int, dim: int) -> dict[str, tuple[int, ...]]:
    return {f"layers.{i}.{p}": (dim, dim) for i in range(n) for p in ("q", "k", "v", "o", "up", "down")} | {
        "embed.weight": (100, dim)}


def test_a_mismatch_is_one_line_with_counts_a_few_names_and_the_hint():
    model = _layers(8, 64)  # the model the config builds
    saved = {k: np.zeros(s, np.float32) for k, s in _layers(4, 32).items()} | {"extra.bias": np.zeros(3)}
    line = weights_mismatch(model, saved, "init_from runs/pre", "task.args.model must be the pretraining run's")
    assert "\n" not in line
    assert line.startswith("init_from runs/pre does not fit the model's 49 parameters: 24 missing (layers.4.")
    assert "1 unexpected (extra.bias)" in line
    assert "25 of another shape (embed.weight (100, 32) not (100, 64), layers.0.down (32, 32) not (64, 64), " \
           "... 23 more)" in line
    assert line.endswith("; task.args.model must be the pretraining run's")
    assert line.count("layers.") <= 4  # a few examples, not the list


def test_weights_that_fit_give_no_message():
    assert weights_mismatch(_layers(2, 8), {k: np.ones(s) for k, s in _layers(2, 8).items()}) is None


def test_check_weights_of_the_engines_raises_the_same_line():
    from mlxdist.engine.common import check_weights

    with pytest.raises(ValueError, match=r"^checkpoint does not fit the model's 13 parameters: 6 missing "
                                         r"\(layers\.1\.down, layers\.1\.k, \.\.\. 4 more\), 0 unexpected; "
                                         r"a different model\.preset"):
        check_weights(_layers(2, 8), {k: np.ones(s) for k, s in _layers(1, 8).items()})


def test_load_torch_is_strict_in_one_line():
    torch = pytest.importorskip("torch")
    from mlxdist.models.weights import load_torch

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    good = {k: v.numpy() + 1 for k, v in net.state_dict().items()}
    load_torch(net, good)
    assert np.allclose(net[1].bias.detach().numpy(), good["1.bias"])
    with pytest.raises(ValueError) as e:
        load_torch(net, {"0.weight": np.zeros((3, 5), np.float32)}, hint="same width?")
    assert str(e.value) == ("checkpoint does not fit the model's 4 parameters: 3 missing (0.bias, 1.bias, ... 1 more), "
                            "0 unexpected, 1 of another shape (0.weight (3, 5) not (3, 4)); same width?")


def test_load_mlx_is_strict_in_one_line():
    pytest.importorskip("mlx.core")
    import mlx.nn as nn

    from mlxdist.models.weights import load_mlx

    net = nn.Linear(4, 3)
    load_mlx(net, {"weight": np.ones((3, 4), np.float32), "bias": np.zeros(3, np.float32)})
    assert float(net.weight.sum()) == 12.0
    with pytest.raises(ValueError, match=r"^ckpt does not fit the model's 2 parameters: 1 missing \(bias\), "
                                         r"0 unexpected; hint$"):
        load_mlx(net, {"weight": np.ones((3, 4), np.float32)}, "ckpt", "hint")
