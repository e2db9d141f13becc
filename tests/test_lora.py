"""LoRA / DoRA / QLoRA on a tiny real Llama: identity at init, merge == no merge, and our
adapter files give our logits in PEFT on the transformers twin and in mlx-lm."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_hf import make_llama

from mlxdist.config import ConfigError, FinetuneConfig
from mlxdist.models.adapters import (
    BaseInfo,
    base_fingerprint,
    load_peft_into_mlx,
    peft_base_fingerprint,
    read_peft,
    save_mlx_lm_adapter,
    save_peft,
)
from mlxdist.models.lora import apply_lora, fuse, load_lora_state, lora_state

TOKENS = np.random.default_rng(0).integers(0, 320, size=(2, 12)).astype(np.int32)
HIDDEN, FFN, KV, N_LAYERS = 64, 128, 32, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama") / "base")


def mlx_model(path: Path, quantize: bool = False):
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    return model


def logits(model) -> np.ndarray:
    out = model(mx.array(TOKENS))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def torch_logits(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.float().numpy()


def randomize(model, seed: int = 1) -> dict[str, np.ndarray]:
    """Adapters (and norms) away from their identity init, as after some training."""
    rng = np.random.default_rng(seed)
    state = lora_state(model)
    for k, v in state.items():
        if k.endswith(".lora_b"):
            state[k] = rng.normal(0, 0.2, v.shape).astype(np.float32)
        elif k.endswith((".m", "norm.weight")):
            state[k] = (v * rng.uniform(0.7, 1.3, v.shape)).astype(np.float32)
    load_lora_state(model, state)
    return state


def ft(method="lora", **kw) -> FinetuneConfig:
    kw.setdefault("targets", "q_proj,v_proj,down_proj")
    return FinetuneConfig(method=method, rank=4, alpha=8.0, **kw)


@pytest.mark.parametrize("method", ["lora", "dora"])
@pytest.mark.parametrize("quantize", [False, True])
def test_adapters_at_init_give_the_base_logits(base, method, quantize):
    mx.random.seed(0)
    model = mlx_model(base, quantize)
    before = logits(model)
    info = apply_lora(model, ft(method))
    assert info.n_trainable > 0
    np.testing.assert_allclose(logits(model), before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_only_adapters_train_and_the_count_is_exact(base, method):
    model = mlx_model(base)
    info = apply_lora(model, ft(method, layers=1))
    r = 4
    per_layer = r * (HIDDEN + HIDDEN) + r * (HIDDEN + KV) + r * (FFN + HIDDEN)  # q, v, down
    if method == "dora":
        per_layer += HIDDEN + KV + HIDDEN
    assert info.n_trainable == per_layer and info.layers == [1]
    assert all(n.startswith("model.layers.1.") and n.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m")
               for n in info.trainable)
    assert info.n_total == sum(np.prod(p.shape) for p in _hf_params(base).values()) + per_layer
    assert "trainable" in info.banner()

    # Gradients reach the adapters only; the base does not move under an optimizer step.
    def loss(m):
        out = m(mx.array(TOKENS[:, :-1]))
        return nn.losses.cross_entropy(out, mx.array(TOKENS[:, 1:])).mean()

    frozen_before = {k: np.array(v) for k, v in _flat(model.parameters()).items() if k not in info.trainable}
    lval, grads = nn.value_and_grad(model, loss)(model)
    assert set(_flat(grads)) == set(info.trainable)
    import mlx.optimizers as optim

    opt = optim.SGD(learning_rate=0.5)
    for _ in range(3):
        lval, grads = nn.value_and_grad(model, loss)(model)
        opt.update(model, grads)
        mx.eval(model.parameters())
    assert float(loss(model)) < float(lval)
    after = _flat(model.parameters())
    assert all(np.array_equal(np.array(after[k]), v) for k, v in frozen_before.items())


def _flat(tree) -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(tree))


def _hf_params(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


def test_train_norms_and_bad_keys(base):
    model = mlx_model(base)
    info = apply_lora(model, ft(train_norms=True))
    norms = [n for n in info.trainable if "norm" in n]
    assert len(norms) == 2 * N_LAYERS + 1
    with pytest.raises(ConfigError, match=r"finetune.targets: qkv_proj not a linear layer .*,q_proj,"):
        apply_lora(mlx_model(base), ft(targets="q_proj,qkv_proj"))
    with pytest.raises(ConfigError, match="finetune.layers: 5 but the model has 2 layers"):
        apply_lora(mlx_model(base), ft(layers=5))


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_merged_equals_unmerged(base, method):
    mx.random.seed(1)
    model = mlx_model(base)
    apply_lora(model, ft(method, train_norms=True))
    randomize(model)
    unmerged = logits(model)
    report = fuse(model)
    assert report.fused == 3 * N_LAYERS and not report.dequantized
    assert not any(hasattr(m, "lora_a") for _, m in model.named_modules())
    np.testing.assert_allclose(logits(model), unmerged, atol=1e-5, rtol=0)


def test_qlora_trains_adapters_and_fuses_dequantized(base):
    mx.random.seed(2)
    model = mlx_model(base, quantize=True)
    info = apply_lora(model, ft("lora"))
    assert all(n.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for n in info.trainable)
    # Counted as full-size weights, not as packed uint32 words.
    assert info.n_total == sum(np.prod(p.shape) for p in _hf_params(base).values()) + info.n_trainable
    randomize(model)
    unmerged = logits(model)
    report = fuse(model, dequantize=True)
    assert report.dequantized
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    np.testing.assert_allclose(logits(model), unmerged, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method, norms", [("lora", False), ("dora", False), ("lora", True)])
def test_peft_on_the_transformers_twin_gives_our_logits(base, tmp_path, method, norms):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    mx.random.seed(3)
    model = mlx_model(base)
    cfg = ft(method, layers=1, train_norms=norms)
    apply_lora(model, cfg)
    state = randomize(model)
    ours = logits(model)
    out = save_peft(state, BaseInfo(str(base), N_LAYERS, base_fingerprint(base)), cfg, tmp_path / "peft")
    assert peft_base_fingerprint(out) == base_fingerprint(base)
    back, back_cfg = read_peft(out)
    assert (back_cfg.method, back_cfg.rank, back_cfg.alpha, back_cfg.layers, back_cfg.train_norms) == (
        method, 4, 8.0, 1, norms)
    assert all(np.array_equal(back[k], v) for k, v in state.items()) and set(back) == set(state)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    base_logits = torch_logits(hf)
    pm = PeftModel.from_pretrained(hf, str(out))
    pm.eval()
    theirs = torch_logits(pm)
    assert np.abs(theirs - base_logits).max() > 1e-2  # the adapter does something
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_torch_side_uses_the_same_names_and_state(base, method):
    import torch
    from transformers import AutoModelForCausalLM

    from mlxdist.models.lora_torch import apply_lora_torch, load_lora_state_torch, lora_state_torch

    mx.random.seed(4)
    cfg = ft(method, train_norms=True)
    model = mlx_model(base)
    info = apply_lora(model, cfg)
    state = randomize(model)
    torch.manual_seed(0)
    pm, tinfo = apply_lora_torch(AutoModelForCausalLM.from_pretrained(base, dtype="float32"), cfg)
    assert sorted(tinfo.trainable) == sorted(info.trainable)
    assert tinfo.n_trainable == info.n_trainable and tinfo.n_total == info.n_total
    assert tinfo.keys == info.keys
    init = lora_state_torch(pm)
    assert {k: v.shape for k, v in init.items()} == {k: v.shape for k, v in state.items()}
    load_lora_state_torch(pm, state)
    pm.eval()
    np.testing.assert_allclose(torch_logits(pm), logits(model), atol=1e-4, rtol=0)
    back = lora_state_torch(pm)
    assert all(np.array_equal(back[k], state[k]) for k in state)


def test_peft_made_adapter_loads_into_mlx_unmerged(base, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    pm = get_peft_model(hf, LoraConfig(r=4, lora_alpha=16, target_modules=["k_proj", "o_proj", "up_proj"],
                                       layers_to_transform=[1], use_dora=True, init_lora_weights=False))
    pm.eval()
    theirs = torch_logits(pm)
    pm.save_pretrained(tmp_path / "theirs")
    model = mlx_model(base)
    info = load_peft_into_mlx(model, tmp_path / "theirs")
    assert info.method == "dora" and info.layers == [1]
    assert any(type(m).__name__ == "DoRALinear" for _, m in model.named_modules())  # not merged
    np.testing.assert_allclose(logits(model), theirs, atol=1e-4, rtol=0)


def test_mlx_lm_adapter_layout_loads_in_mlx_lm(base, tmp_path):
    from mlx_lm import load

    mx.random.seed(6)
    model = mlx_model(base)
    cfg = ft("dora", layers=1)
    apply_lora(model, cfg)
    state = randomize(model)
    ours = logits(model)
    out = save_mlx_lm_adapter(state, cfg, N_LAYERS, tmp_path / "mlxlm")
    theirs, _ = load(str(base), adapter_path=str(out))
    np.testing.assert_allclose(logits(theirs), ours, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot hold trained norms"):
        save_mlx_lm_adapter({**state, "model.norm.weight": np.ones(HIDDEN, np.float32)}, cfg, N_LAYERS,
                            tmp_path / "x")


def test_read_peft_rejects_what_it_cannot_load(base, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_peft(tmp_path)
    fp = base_fingerprint(base)
    assert fp == base_fingerprint(base) and len(fp) == 64


def test_fused_qlora_model_opens_in_mlx_lm_and_transformers(base, tmp_path):
    from mlx_lm.utils import load_model
    from transformers import AutoModelForCausalLM

    from mlxdist.models.adapters import save_fused

    mx.random.seed(7)
    model, config = load_model(base)
    nn.quantize(model, group_size=32, bits=4)
    config["quantization"] = {"group_size": 32, "bits": 4}
    apply_lora(model, ft("dora", train_norms=True))
    randomize(model)
    with pytest.raises(ValueError, match="unmerged adapters"):
        save_fused(model, config, tmp_path / "early")
    unmerged = logits(model)
    report = fuse(model)
    out = save_fused(model, config, tmp_path / "fused", base_dir=base, dequantized=report.dequantized)
    assert (out / "tokenizer.json").exists()
    again, conf = load_model(out)
    assert "quantization" not in conf
    np.testing.assert_allclose(logits(again), unmerged, atol=1e-4, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype="float32")
    np.testing.assert_allclose(torch_logits(hf), unmerged, atol=1e-4, rtol=0)


def test_export_cli_writes_mlx_lm_and_fused_from_a_peft_adapter(base, tmp_path):
    import subprocess
    import sys

    from helpers import env
    from mlx_lm import load
    from mlx_lm.utils import load_model

    mx.random.seed(8)
    model = mlx_model(base, quantize=True)
    cfg = ft("lora", layers=1)
    apply_lora(model, cfg)
    state = randomize(model)
    ours = logits(model)
    adapter = save_peft(state, BaseInfo(str(base), N_LAYERS), cfg, tmp_path / "peft")

    def export(*args):
        return subprocess.run([sys.executable, "-m", "mlxdist.export", "--base", str(base), "--adapter",
                               str(adapter), *args], env=env(), capture_output=True, text=True, timeout=300)

    r = export("--format", "fused", "--quantize", "4", "--out", str(tmp_path / "fused"))
    assert r.returncode == 0, r.stderr
    assert "4-bit: dequantized, then merged" in r.stdout
    fused, _ = load_model(tmp_path / "fused")
    np.testing.assert_allclose(logits(fused), ours, atol=1e-4, rtol=0)

    r = export("--format", "mlx-lm", "--out", str(tmp_path / "mlxlm"))
    assert r.returncode == 0, r.stderr
    theirs, _ = load(str(base), adapter_path=str(tmp_path / "mlxlm"))  # on the fp32 base
    plain = mlx_model(base)
    apply_lora(plain, cfg)
    load_lora_state(plain, state)
    np.testing.assert_allclose(logits(theirs), logits(plain), atol=1e-5, rtol=0)

    r = subprocess.run([sys.executable, "-m", "mlxdist.export", "--base", str(base), "--adapter",
                        str(tmp_path), "--format", "fused", "--out", str(tmp_path / "x")],
                       env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "no adapter_config.json" in r.stderr
