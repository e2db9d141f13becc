"""`python -m mlxdist.export RUN --out DIR` for a run that trained a Task (tests/export_tasks.py): the
model's whole state loads strictly into the user's own class with the trained values, an EMA copy
beside it, a PEFT model's adapter directory that `PeftModel.from_pretrained` reads, and one-line
errors (exit 2) for what the user must fix. The run's checkpoints are only read."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from helpers import env
from safetensors.numpy import load_file

from mlxdist.state import checkpoint as ckpt

HERE = Path(__file__).parent
COMMON = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
          "train.steps=3", "checkpoint.every=3", "train.batch_size=8", "train.lr=1e-2"]
TORCH = ["--engine", "torch", "--device", "cpu"]
STEP = "step_00000003"
TORCH_BN, MLX_BN, TORCH_LORA = "export_tasks:torch_bn", "export_tasks:mlx_bn", "export_tasks:torch_lora"


def _users_module():
    sys.path.insert(0, str(HERE))
    try:
        import export_tasks
    finally:
        sys.path.remove(str(HERE))
    return export_tasks


def _train(run: Path, *args: str) -> Path:
    cmd = [sys.executable, "-m", "mlxdist.train", *COMMON, *args, f"train.out_dir={run}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE, env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def export(run: Path, out: Path, *args: str, task: str, cwd: Path = HERE, extra_env: dict | None = None,
           cli: bool = False):
    """`python -m mlxdist.export RUN --out OUT --task TASK ARGS` from `cwd`: the real command line
    when `cli`, else its `main` in this process (the same code, without a fresh interpreter's torch
    import per call; the task's module is read from `cwd` either way)."""
    argv = [str(run), "--out", str(out), "--task", task, *args]
    if cli:
        return subprocess.run([sys.executable, "-m", "mlxdist.export", *argv], capture_output=True, text=True,
                              timeout=300, cwd=cwd, env=env() | (extra_env or {}))
    from mlxdist.commands import export as cli_module

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), mock.patch.dict(os.environ, extra_env or {}), \
            contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = cli_module.main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


def _digests(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}


def _one_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and all(w in line for w in words), line
    return line


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("torch") / "run", *TORCH, f"task.factory={TORCH_BN}")


@pytest.fixture(scope="module")
def torch_ema_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("torch-ema") / "run", *TORCH, f"task.factory={TORCH_BN}",
                  "train.ema=0.9")


@pytest.fixture(scope="module")
def mlx_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("mlx") / "run", f"task.factory={MLX_BN}", "train.ema=0.9")


def _ema(run: Path) -> dict[str, np.ndarray]:
    """The checkpoint's EMA (`train.ema`): trained weights and float buffers, by the model file's names."""
    ema = load_file(run / "checkpoints" / STEP / "ema.safetensors")
    raw = load_file(run / "checkpoints" / STEP / "model.safetensors")
    assert ema and set(ema) <= set(raw)
    assert max(float(np.abs(ema[k] - raw[k]).max()) for k in ema) > 1e-3  # else the test proves little
    return ema


def test_torch_whole_state_loads_strictly_into_the_users_class(torch_run, tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch

    before = _digests(torch_run)
    out = tmp_path / "out"
    r = export(torch_run, out, task=TORCH_BN, cli=True)  # the real command line, once
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "README.txt"}
    assert "load_state_dict" in r.stdout and "strict=True" in (out / "README.txt").read_text()
    assert _digests(torch_run) == before  # the checkpoints are only read

    saved = load_torch(out / "model.safetensors")
    model = _users_module().torch_net()  # the user's own class, in the user's own code
    model.load_state_dict(saved, strict=True)
    got = model.state_dict()
    trained = load_file(torch_run / "checkpoints" / STEP / "model.safetensors")
    assert "base.weight" not in trained  # the frozen base: rebuilt, not in the checkpoint
    assert got.keys() == trained.keys() | {"base.weight"}
    for k, v in trained.items():
        np.testing.assert_array_equal(got[k].float().numpy(), v, err_msg=k)
    assert np.abs(trained["body.1.running_mean"]).max() > 1e-3  # statistics moved off their zeros
    assert got["body.1.num_batches_tracked"].dtype == torch.int64 and int(got["body.1.num_batches_tracked"]) == 3
    assert got["base.weight"].dtype == torch.bfloat16  # each tensor in the model's own dtype
    assert torch.equal(got["base.weight"], _users_module().torch_net().base.weight)


def test_mlx_whole_state_loads_strictly_into_the_users_class(mlx_run, tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = tmp_path / "out"
    r = export(mlx_run, out, task=MLX_BN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "model_ema.safetensors", "README.txt"}
    assert "load_weights" in r.stdout

    model = _users_module().mlx_net()
    model.load_weights(str(out / "model.safetensors"), strict=True)
    got = dict(tree_flatten(model.parameters()))
    trained = load_file(mlx_run / "checkpoints" / STEP / "model.safetensors")
    assert "base.weight" not in trained and got.keys() == trained.keys() | {"base.weight"}
    for k, v in trained.items():
        np.testing.assert_array_equal(np.array(got[k]), v, err_msg=k)
    assert np.abs(trained["body.layers.1.running_mean"]).max() > 1e-3
    assert got["base.weight"].dtype == mx.bfloat16
    assert bool(mx.array_equal(got["base.weight"], _users_module().mlx_net().base.weight))


def test_ema_beside_the_weights(torch_ema_run, tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch

    ema = _ema(torch_ema_run)
    out = tmp_path / "out"
    r = export(torch_ema_run, out, task=TORCH_BN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "model_ema.safetensors", "README.txt"}
    model = _users_module().torch_net()
    model.load_state_dict(load_torch(out / "model_ema.safetensors"), strict=True)
    got = model.state_dict()
    for k, v in ema.items():
        np.testing.assert_array_equal(got[k].numpy(), v, err_msg=k)
    assert int(got["body.1.num_batches_tracked"]) == 3  # a counter: the model's own, not averaged
    assert torch.equal(got["base.weight"], _users_module().torch_net().base.weight)
    raw = load_torch(out / "model.safetensors")  # the raw weights stay the raw ones
    trained = load_file(torch_ema_run / "checkpoints" / STEP / "model.safetensors")
    np.testing.assert_array_equal(raw["body.0.weight"].numpy(), trained["body.0.weight"])


def test_mlx_ema(mlx_run, tmp_path):
    from mlx.utils import tree_flatten

    ema = _ema(mlx_run)
    out = tmp_path / "out"
    assert export(mlx_run, out, task=MLX_BN).returncode == 0
    model = _users_module().mlx_net()
    model.load_weights(str(out / "model_ema.safetensors"), strict=True)
    got = dict(tree_flatten(model.parameters()))
    for k, v in ema.items():
        np.testing.assert_array_equal(np.array(got[k]), v, err_msg=k)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    pytest.importorskip("peft")
    from tiny_hf import make_llama

    root = tmp_path_factory.mktemp("lora")
    base = make_llama(root / "base", vocab_size=64, tokenizer=False)
    run = _train(root / "run", *TORCH, "train.batch_size=4", f"task.factory={TORCH_LORA}",
                 f"task.args={{base: {base}}}", "train.ema=0.9")
    return run, base


def test_peft_adapter_loads_with_from_pretrained(lora_run, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file as load_torch
    from transformers import LlamaForCausalLM

    run, base = lora_run
    ema = _ema(run)  # trained with train.ema: adapter_ema/ beside adapter/
    out = tmp_path / "out"
    r = export(run, out, task=TORCH_LORA)
    assert r.returncode == 0, r.stderr[-3000:]
    for adapter in ("adapter", "adapter_ema"):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / adapter).iterdir()}
    assert "PeftModel.from_pretrained" in r.stdout
    trained = load_file(run / "checkpoints" / STEP / "model.safetensors")
    lora = {k: v for k, v in trained.items() if ".lora_" in k}
    assert len(lora) == 8 and all(np.abs(v).max() > 0 for k, v in lora.items() if "lora_B" in k)

    # The user's code: a fresh pretrained base, the adapter on top.
    for adapter, want in (("adapter_ema", ema), ("adapter", lora)):
        adapted = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), str(out / adapter))
        params = dict(adapted.named_parameters())
        for k in lora:
            np.testing.assert_array_equal(params[k].detach().numpy(), want[k], err_msg=f"{adapter}: {k}")

    # The whole state dict, strictly into what build() makes.
    whole = _users_module().lora_model(str(base))
    whole.load_state_dict(load_torch(out / "model.safetensors"), strict=True)
    tokens = torch.arange(12).reshape(1, 12) % 64
    with torch.no_grad():
        a, b = adapted.eval()(input_ids=tokens).logits, whole.eval()(input_ids=tokens).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_find_peft_in_the_model_an_attribute_or_a_child():
    pytest.importorskip("peft")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from mlxdist.commands.export_task import find_peft

    lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1))
    peft_model = get_peft_model(lm, LoraConfig(r=2, target_modules=["q_proj"]))

    class Child(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = peft_model

    held = torch.nn.Linear(2, 2)
    object.__setattr__(held, "peft", peft_model)  # as the built-in LM holds one: not a child
    assert find_peft(peft_model) is peft_model
    assert find_peft(Child()) is peft_model
    assert find_peft(held) is peft_model
    assert find_peft(torch.nn.Linear(2, 2)) is None


# ------------------------------------------------------------------------------------- errors


def test_out_not_empty_needs_force_and_never_inside_the_checkpoints(torch_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _one_error(export(torch_run, out, task=TORCH_BN), "not empty", "--force")
    _one_error(export(torch_run, torch_run / "checkpoints" / STEP, "--force", task=TORCH_BN),
               "inside the run's checkpoints")
    r = export(torch_run, out, "--force", task=TORCH_BN)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "keep.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".export-")]


def test_no_checkpoint(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    _one_error(export(tmp_path / "run", tmp_path / "out", task=TORCH_BN), "no valid checkpoint")


def test_factory_not_importable_says_where_to_run_from(torch_run, tmp_path):
    # A fresh process: this one has imported export_tasks already.
    line = _one_error(export(torch_run, tmp_path / "out", task=TORCH_BN, cwd=tmp_path, cli=True), "export_tasks")
    assert "run from the directory that holds export_tasks.py" in line
    assert not (tmp_path / "out").exists()


def test_dtype_is_the_models_own(torch_run, tmp_path):
    _one_error(export(torch_run, tmp_path / "out", "--dtype", "float16", task=TORCH_BN), "--dtype",
               "model's own dtype")


def test_another_frozen_base_is_refused(torch_run, tmp_path):
    _one_error(export(torch_run, tmp_path / "out", task=TORCH_BN, extra_env={"BASE_SEED": "1"}),
               "frozen weights", "not the ones the run trained on")


def test_a_model_that_does_not_load_strictly_is_named(torch_run, tmp_path):
    out = tmp_path / "out"
    line = _one_error(export(torch_run, out, task=TORCH_BN, extra_env={"EXPORT_BROKEN": "1"}),
                      "does not load strictly",
                      "missing keys body.0.bias, body.0.weight, body.1.bias (+", "unexpected keys trunk.0.bias")
    assert "Broken" in line
    assert not out.exists()  # nothing half-written


def test_a_checkpoint_the_model_does_not_match_is_named(torch_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(torch_run, copy)
    loaded = ckpt.load(copy / "checkpoints" / STEP)
    weights = dict(loaded.weights) | {"body.9.weight": np.zeros(2, np.float32)}
    ckpt.save(copy / "checkpoints", 3, weights, loaded.optimizer, loaded.state, loaded.sync)
    _one_error(export(copy, tmp_path / "out", task=TORCH_BN), "body.9.weight", "lacks")
