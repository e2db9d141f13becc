"""Pretrained mlx-lm models in a pipeline (`dist.mode=pipeline`): the stages derived from an
mlx-lm model's layer list (`mlxdist/models/stages.py`) compose to `model(tokens)` exactly; a
pipeline of 2 ranks fine-tuning a tiny pretrained Llama (in full, and ZeRO-3 on the same stages)
equals one process on the same micro-batches; LoRA and QLoRA over a pipelined frozen base equal
one process on the adapters, each rank holding only its run's part of the base and sending only
boundary activations and their gradients; the checkpoint and adapter are data parallel's.

As in tests/test_pipeline.py, the reference is one process with micro-batches of one sample, and
the pipeline deals the same samples in micro-batches of one, so what differs is fp32 rounding of
the global norm's sum (per rank, then over ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_shard_lora
from helpers import FAST, env, run_train

from mlxdist.state import checkpoint as ckpt

pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")

HERE = Path(__file__).parent
base, data = test_shard_lora.base, test_shard_lora.data  # its fixtures: the tiny Llama's dir, the chat rows' jsonl
TOL = 1e-6
# 5 samples a step in micro-batches of one: one process runs 5, a pipeline of two deals 3 + 2.
COMMON = [x for x in FAST if not x.startswith(("data.", "model.preset"))] + [
    "data.source=jsonl", "data.seq_len=24", "train.batch_size=1", "train.global_batch=5", "train.lr=1e-3",
    "train.grad_clip=0.5", "train.weight_decay=0.1", "train.schedule=constant", "train.warmup_steps=0",
    "train.steps=4", "checkpoint.every=2", "dist.sync_weights_every=0"]


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _train(args, np_=0):
    return run_train(args, np_=np_, cwd=HERE, timeout=300)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def _same_as(reference: Path, run: Path) -> tuple[float, float]:
    """Max weight and optimizer-state differences of the two runs' last checkpoints."""
    a, b = ckpt.load_latest(reference / "checkpoints"), ckpt.load_latest(run / "checkpoints")
    assert a.meta.run.step == b.meta.run.step and a.meta.optimizer_step == b.meta.optimizer_step
    return _max_diff(a.weights, b.weights), _max_diff(a.optimizer, b.optimizer)


def _composed(model, tokens):
    from mlxdist.models.stages import model_stages

    h = tokens
    for _, call in model_stages(model):
        h = call(h)
    return h


# ---------------------------------------------------------------- the stages (one process)
def test_stages_of_an_mlx_lm_llama_compose_to_its_call(base):
    """The tiny HF Llama as mlx-lm loads it (untied head), fp32: stages named as the model's
    trainable parameters, embedding / each layer / norm and head, composed exactly its call."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxdist.models.pretrained import load_mlx
    from mlxdist.models.stages import model_stages

    model, _ = load_mlx(str(base))
    stages = model_stages(model)
    names = [n for n, _ in stages]
    assert len(stages) == 4 and names[0] == ["model.embed_tokens.weight"]
    assert names[-1] == ["model.norm.weight", "lm_head.weight"]
    assert all(n.startswith(f"model.layers.{i}.") for i in range(2) for n in names[1 + i])
    assert sorted(n for stage in names for n in stage) == sorted(n for n, _ in tree_flatten(model.parameters()))
    tokens = mx.array(np.random.default_rng(0).integers(0, 320, (3, 17)), mx.int32)
    diff = float(mx.abs(_composed(model, tokens) - model(tokens)).max())
    print(f"llama stages composed vs model(tokens): max abs diff {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tied_embeddings_and_qwen_compose_too(arch):
    """A tied head (the embedding's as_linear, named in the first and last stages) and Qwen2/3's
    layer list; one token (mlx-lm builds no mask then) and many."""
    import importlib

    import mlx.core as mx

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    args = module.ModelArgs(model_type=arch, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
                            rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=64, **extra)
    mx.random.seed(3)
    model = module.Model(args)
    from mlxdist.models.stages import model_stages

    stages = model_stages(model)
    assert len(stages) == 5 and stages[-1][0] == ["model.norm.weight", "model.embed_tokens.weight"]
    for t in (1, 9):
        tokens = mx.array(np.random.default_rng(t).integers(0, 50, (2, t)), mx.int32)
        assert float(mx.abs(_composed(model, tokens) - model(tokens)).max()) == 0.0, (arch, t)


def test_gpt2_stages_add_the_positions_and_compose_to_its_call():
    """mlx-lm's GPT-2: token and position embeddings in the first stage, its blocks, the final
    LayerNorm and the tied embedding as head; composed, `model(tokens)` exactly."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gpt2

    from mlxdist.models.stages import model_stages

    mx.random.seed(5)
    model = gpt2.Model(gpt2.ModelArgs(model_type="gpt2", n_ctx=64, n_embd=64, n_head=4, n_layer=3, n_positions=64,
                                      layer_norm_epsilon=1e-5, vocab_size=50))
    stages = model_stages(model)
    names = [n for n, _ in stages]
    assert len(stages) == 5 and names[0] == ["model.wte.weight", "model.wpe.weight"]
    assert names[-1] == ["model.ln_f.weight", "model.ln_f.bias", "model.wte.weight"]
    assert sorted(dict.fromkeys(n for stage in names for n in stage)) == sorted(n for n, _ in
                                                                              tree_flatten(model.parameters()))
    for t in (1, 9):
        tokens = mx.array(np.random.default_rng(t).integers(0, 50, (2, t)), mx.int32)
        assert float(mx.abs(_composed(model, tokens) - model(tokens)).max()) == 0.0, t


def test_a_model_with_neither_has_no_stages():
    import mlx.nn as nn

    from mlxdist.models.stages import has_stages, model_stages

    mlp = nn.Sequential(nn.Linear(2, 2))
    assert model_stages(mlp) is None and not has_stages(mlp)


# ---------------------------------------------------------------- a pipeline of 2 ranks
@pytest.fixture(scope="module")
def full_one(tmp_path_factory, base, data) -> Path:
    out = tmp_path_factory.mktemp("full") / "one"
    _ok(_train([*COMMON, f"model.path={base}", f"data.path={data}", f"train.out_dir={out}"]))
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("mode, banner", [("dist.mode=pipeline", "pipeline parallelism: 4 model stages cut"),
                                          ("dist.shard=weights", "4 stages, gathered one at a time")],
                         ids=["pipeline", "zero3"])
def test_a_pretrained_llama_fine_tuned_in_full_on_2_ranks_equals_one_process(tmp_path, base, data, full_one, mode,
                                                                              banner):
    """finetune.method=full of the tiny Llama, 4 steps with clipping on: a pipeline (embedding and
    layer 0 | layer 1 and head) and ZeRO-3 (the same stages, one gathered at a time) on 2 ranks;
    weights and moments equal one process's."""
    r = _ok(_train([*COMMON, f"model.path={base}", f"data.path={data}", mode, f"train.out_dir={tmp_path}"], np_=2))
    assert banner in r.stderr, r.stderr[-2000:]
    weights, moments = _same_as(full_one, tmp_path)
    print(f"pretrained llama, full fine-tune, {mode} on 2: max weight diff {weights:.3g}, moments {moments:.3g}")
    assert weights <= TOL and moments <= TOL, (weights, moments)


@pytest.mark.cluster
def test_a_pretrained_gpt2_in_a_pipeline_equals_one_process(tmp_path, data):
    """A tiny GPT-2 saved by transformers (learned positions, the head tied to the embedding),
    fine-tuned in full: the derived stages cut 2 + 2, the tied weight on both ranks, and ZeRO-3 on
    the same stages; weights and moments equal one process's after 4 steps with clipping on. The key projection's bias gets a
    gradient of rounding noise only (softmax ignores a shift all keys share), which AdamW with eps
    1e-8 turns into steps of the learning rate's size, different in every summation order: eps 1e-6
    keeps it noise."""
    from tiny_hf import make_gpt2

    gpt2 = make_gpt2(tmp_path / "gpt2")
    args = [*COMMON, "train.eps=1e-6", f"model.path={gpt2}", f"data.path={data}"]
    _ok(_train([*args, f"train.out_dir={tmp_path / 'one'}"]))
    r = _ok(_train([*args, "dist.mode=pipeline", f"train.out_dir={tmp_path / 'pp'}"], np_=2))
    assert "pipeline parallelism: 4 model stages cut" in r.stderr and "model.wte.weight shared" in r.stderr, \
        r.stderr[-2000:]
    z3 = _ok(_train([*args, "dist.shard=weights", f"train.out_dir={tmp_path / 'z3'}"], np_=2))
    assert "4 stages, gathered one at a time" in z3.stderr, z3.stderr[-2000:]
    for run in ("pp", "z3"):
        weights, moments = _same_as(tmp_path / "one", tmp_path / run)
        print(f"pretrained gpt2, full fine-tune, {run} on 2: max weight diff {weights:.3g}, moments {moments:.3g}")
        assert weights <= TOL and moments <= TOL, (run, weights, moments)
    # Adapters on GPT-2 are refused before the run (PEFT's GPT-2 layout is not written; it once
    # failed at the run's end, after training).
    lora = _train([*args, "finetune.method=lora", "finetune.targets=c_attn", f"train.out_dir={tmp_path / 'lora'}"])
    assert lora.returncode == 2 and "a GPT-2 base's adapter" in lora.stderr, lora.stderr[-2000:]
    assert not (tmp_path / "lora" / "checkpoints").exists()


# ---------------------------------------------------------------- adapters over a pipelined base
LORA = ["finetune.method=lora", "finetune.targets=q_proj,v_proj,down_proj", "train.grad_clip=0.05"]
KINDS = {"lora": [], "qlora": ["model.quantize=4"],
         # only layer 1 adapted: rank 0 (embedding, layer 0) trains nothing and owns no state
         "lora-last-layer": ["finetune.layers=1"]}


def _events(run: Path, kind: str, rank: int = 0) -> list[dict]:
    lines = (run / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture(scope="module")
def adapter_runs(tmp_path_factory, base, data) -> dict[str, tuple[Path, Path]]:
    """Each kind on one process and on a pipeline of 2 ranks, 4 steps, checkpoints at 2 and 4."""
    runs = {}
    for kind, extra in KINDS.items():
        root = tmp_path_factory.mktemp(kind)
        args = [*COMMON, *LORA, *extra, f"model.path={base}", f"data.path={data}"]
        _ok(_train([*args, f"train.out_dir={root / 'one'}"]))
        r = _ok(_train([*args, "dist.mode=pipeline", f"train.out_dir={root / 'pp'}"], np_=2))
        assert "pipeline parallelism: 4 model stages cut" in r.stderr, r.stderr[-2000:]
        runs[kind] = (root / "one", root / "pp")
    return runs


@pytest.mark.cluster
@pytest.mark.parametrize("kind", list(KINDS))
def test_adapters_on_a_pipeline_equal_one_process(adapter_runs, kind):
    """The checkpoints hold the adapters only (data parallel's LoRA format) and equal one
    process's, moments too; the adapter written at the end (PEFT) is the same."""
    from safetensors.numpy import load_file

    one, pp = adapter_runs[kind]
    saved = ckpt.load_latest(pp / "checkpoints")
    assert saved.weights and all(k.endswith(("lora_a", "lora_b")) for k in saved.weights), sorted(saved.weights)
    assert max(float(np.max(np.abs(v))) for k, v in saved.weights.items() if k.endswith("lora_b")) > 0
    weights, moments = _same_as(one, pp)
    a, b = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (one, pp))
    adapter = _max_diff(a, b)
    print(f"{kind} on a pipeline of 2: max adapter diff {weights:.3g}, moments {moments:.3g}, saved adapter "
          f"{adapter:.3g}")
    assert weights <= TOL and moments <= TOL and adapter <= TOL, (weights, moments, adapter)


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_each_rank_holds_its_part_of_the_base_and_sends_only_activations(adapter_runs, base, kind):
    """Rank 0 holds the embedding and layer 0 of the frozen base, rank 1 layer 1, the norm and
    the head: together the base once (the fp32 file's bytes; QLoRA's 4-bit base much less). A
    step sends the 5 micro-batches' boundary activations (1 x 24 x 64 fp32) forward and their
    gradients back, nothing else."""
    from safetensors.numpy import load_file

    _, pp = adapter_runs[kind]
    whole = sum(v.nbytes for v in load_file(str(base / "model.safetensors")).values())
    held = [_events(pp, "pipeline", r)[0]["frozen_bytes_here"] for r in (0, 1)]
    print(f"{kind}: frozen base held per rank {held} of {whole} bytes (fp32 file)")
    assert all(0 < h < whole for h in held)
    if kind == "lora":
        assert sum(held) == whole, (held, whole)
    else:
        assert sum(held) < whole / 4, (held, whole)
    activation = 1 * 24 * 64 * 4
    sent = [[e["sync_bytes"] for e in _events(pp, "step", r)] for r in (0, 1)]
    assert all(len(s) == 4 for s in sent), sent
    for step in range(4):
        assert sent[0][step] + sent[1][step] == activation * 5 * 2, (step, sent)


@pytest.mark.cluster
def test_an_adapter_pipelines_checkpoint_resumes_on_one_process_and_generates(tmp_path, adapter_runs, base, data):
    """The pipeline's step-2 LoRA checkpoint resumes on one process to the uninterrupted run's
    step 4; `generate` loads the pipeline's checkpoint (base and adapters) and, greedy, says
    what it says from one process's."""
    one, pp = adapter_runs["lora"]
    r = _ok(_train([*COMMON, *LORA, f"model.path={base}", f"data.path={data}", f"train.out_dir={tmp_path}",
                    "--resume", str(pp / "checkpoints" / "step_00000002")]))
    assert "resumed from" in r.stderr, r.stderr[-2000:]
    weights, moments = _same_as(one, tmp_path)
    print(f"lora pipeline checkpoint resumed on one process: max adapter diff {weights:.3g}, moments {moments:.3g}")
    assert weights <= TOL and moments <= TOL, (weights, moments)
    said = []
    for run in (pp, one):
        g = subprocess.run([sys.executable, "-m", "mlxdist.generate", "--checkpoint", str(run), "--prompt", "Hello",
                            "--max-tokens", "6", "--temp", "0"], capture_output=True, text=True, timeout=120,
                           env=env(), cwd=HERE)
        assert g.returncode == 0, g.stderr[-2000:]
        said.append(g.stdout)
    assert said[0] == said[1], said


@pytest.mark.cluster
def test_adapters_on_the_torch_engines_pipeline_are_refused_in_one_line(tmp_path, base, data):
    r = _train([*COMMON, *LORA, f"model.path={base}", f"data.path={data}", "dist.mode=pipeline", "train.steps=1",
                f"train.out_dir={tmp_path}", "--engine", "torch", "--device", "cpu"], np_=2)
    assert r.returncode != 0
    assert ("dist.mode=pipeline with finetune.method=lora: adapters over a pipelined frozen base run on the MLX "
            "engine only for now") in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
