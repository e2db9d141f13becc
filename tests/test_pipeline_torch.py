"""The pipeline on the torch engine: the same strategy (`sync/pipeline.py`) with the torch
stage (`engine/torch_pipeline.py`) equals one torch process on the same micro-batches, on 2
and 3 ranks and a given cut, and its checkpoint resumes on one process exactly. A transformers
Llama (`model.path`, a layer list: `models/hf_torch.py`'s stages) trains in a pipeline and under
ZeRO-3 as in one process.

As in tests/test_pipeline.py, the reference deals micro-batches of one sample, so the sums
are added in the same order; what differs is fp32 rounding in the global norm's sum and the
tied embedding's two gradient halves (measured ~4e-7 after 4 AdamW steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, run_train
from test_pipeline import TOL, _events, _same_as

HERE = Path(__file__).parent
TORCH = ["--engine", "torch", "--device", "cpu", *FAST, "train.batch_size=1", "train.global_batch=5",
         "train.grad_clip=0.5", "train.weight_decay=0.1", "dist.sync_weights_every=0", "train.steps=4",
         "checkpoint.every=2", "train.eval_every=2"]


def _ok(args, n=0):
    r = run_train(args, np_=n, cwd=HERE, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def one_torch(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline-torch") / "one"
    _ok([*TORCH, f"train.out_dir={out}"])
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("n, cut", [(2, ""), (3, "1,3,2")])
def test_torch_pipeline_equals_one_process(tmp_path, one_torch, n, cut):
    r = _ok([*TORCH, "dist.mode=pipeline", f"train.out_dir={tmp_path}"] + ([f"dist.pipeline_cut={cut}"] if cut else []),
            n)
    assert "pipeline parallelism: 6 model stages cut" in r.stderr, r.stderr[-2000:]
    # The stage probe runs torch's stage code on the engine's own weights and hands them back:
    # the run still equals one process below.
    assert ("stage costs measured at start" in r.stderr) == (not cut), r.stderr[-2000:]
    weights, moments = _same_as(one_torch, tmp_path)
    evals = [e["eval_loss"] for e in _events(tmp_path, "eval")]
    expected = [e["eval_loss"] for e in _events(one_torch, "eval")]
    print(f"torch pipeline n={n} cut={cut or 'plan'}: max weight diff {weights:.3g}, moments {moments:.3g}")
    assert weights <= TOL and moments <= TOL, (weights, moments)
    assert len(evals) == 2 and np.allclose(evals, expected, rtol=1e-6, atol=0), (evals, expected)
    if n == 2:  # its step-2 checkpoint resumes on one process to the uninterrupted step 4
        out = tmp_path / "resumed"
        r = _ok([*TORCH, f"train.out_dir={out}", "--resume", str(tmp_path / "checkpoints" / "step_00000002")])
        assert "resumed from" in r.stderr
        weights, moments = _same_as(one_torch, out)
        assert weights <= TOL and moments <= TOL, (weights, moments)


@pytest.mark.cluster
def test_torch_pipeline_in_bfloat16_follows_one_process(tmp_path):
    """bf16 under autocast, fp32 masters: boundary activations cross as bf16 bits; the losses
    follow one process's on the same micro-batches (measured within 7e-6 relative over 6 steps;
    bf16 rounding differs where the boundary casts)."""
    args = ["--engine", "torch", "--device", "cpu", *FAST, "train.batch_size=2", "train.global_batch=4",
            "train.steps=6", "model.dtype=bfloat16", "checkpoint.every=0"]
    _ok([*args, f"train.out_dir={tmp_path / 'one'}"])
    _ok([*args, "dist.mode=pipeline", f"train.out_dir={tmp_path / 'pp'}"], 2)
    one, pp = ([e["loss"] for e in _events(tmp_path / d, "step")] for d in ("one", "pp"))
    assert len(pp) == 6 and np.allclose(pp, one, rtol=1e-4, atol=0), (pp, one)


# ---------------------------------------------------------------- a transformers model's layer list
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random HF Llama (2 layers, untied head) and chat data for it."""
    import json

    from tiny_hf import make_llama

    root = tmp_path_factory.mktemp("hf")
    rows = [{"prompt": "What is two plus two?", "completion": " Four."},
            {"text": "You are a helpful assistant. The capital of France is Paris."},
            {"prompt": "Hello, how are you", "completion": " today? I am fine, thanks."}] * 8
    (root / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return make_llama(root / "llama"), root / "chat.jsonl"


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_models_stages_compose_to_its_forward(tmp_path, tied):
    """Embedding, each decoder layer (with the causal mask and rotary embeddings the model
    makes), norm and head: composed, the logits of `forward` exactly; every parameter named
    once (a tied head reads the embedding's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mlxdist.models.hf_torch import HFStagedLM, wrap

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    model = wrap(hf.float())
    assert isinstance(model, HFStagedLM)
    ids = torch.randint(0, 97, (2, 11))
    x = ids
    stages = model.stages()
    with torch.no_grad():
        for _, run in stages:
            x = run(x)
        assert torch.equal(x, model(ids))
    named = [n for names, _ in stages for n in names]
    assert len(stages) == 5 and sorted(set(named)) == sorted(n for n, _ in model.named_parameters())
    assert stages[-1][0][-1] == ("model.embed_tokens.weight" if tied else "lm_head.weight")


@pytest.mark.cluster
def test_a_transformers_llama_in_a_pipeline_and_zero3_equals_one_process(tmp_path, llama):
    base, data = llama
    args = ["--engine", "torch", "--device", "cpu", "metrics.port=0", "train.progress=false", "train.eval_every=0",
            "train.lr=1e-3", "train.grad_clip=0.05", "train.weight_decay=0.1", "checkpoint.every=0",
            "dist.sync_weights_every=0", "train.schedule=constant", "train.warmup_steps=0", "train.steps=3",
            "data.source=jsonl", "data.seq_len=24", f"model.path={base}", f"data.path={data}", "train.batch_size=1",
            "train.global_batch=4"]
    _ok([*args, f"train.out_dir={tmp_path / 'one'}"])
    r = _ok([*args, "dist.mode=pipeline", f"train.out_dir={tmp_path / 'pp'}"], 2)
    assert "pipeline parallelism: 4 model stages cut by memory budget" in r.stderr, r.stderr[-2000:]
    assert "stage costs measured at start" in r.stderr, r.stderr[-2000:]  # a transformers model's stages timed
    _ok([*args, "dist.shard=weights", f"train.out_dir={tmp_path / 'z3'}"], 2)
    for run in ("pp", "z3"):
        weights, moments = _same_as(tmp_path / "one", tmp_path / run)
        print(f"transformers Llama, {run}: max weight diff {weights:.3g}, moments {moments:.3g}")
        assert weights <= TOL and moments <= TOL, (run, weights, moments)
