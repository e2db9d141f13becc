"""Fine-tuning a pretrained base through the real CLI: full and LoRA, on one rank and under
mpirun with unequal batches, masked instruction data, resume, the base fingerprint."""

import json
import shutil

import pytest
from helpers import FAST, assert_same_weights, final_weights, run_train
from tiny_hf import make_llama

pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")

COMMON = [x for x in FAST if not x.startswith(("data.", "model.preset"))] + [
    "train.lr=1e-3", "train.grad_clip=0", "checkpoint.every=0", "dist.sync_weights_every=1",
    "train.schedule=constant", "train.warmup_steps=0"]
ROWS = [{"prompt": "What is two plus two?", "completion": " Four."},
        {"messages": [{"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris, of course."}]},
        {"prompt": "Hello, how are you", "completion": " today? I am fine, thanks."},
        {"text": "You are a helpful assistant. The capital of France is Paris."}] * 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("llama") / "base")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _args(base, data, out, *extra):
    return [*COMMON, f"model.path={base}", "data.source=jsonl", f"data.path={data}", "data.seq_len=24",
            f"train.out_dir={out}", *extra]


@pytest.mark.cluster
@pytest.mark.parametrize("method, engine", [("full", "mlx"), ("lora", "mlx"), ("lora", "torch")])
def test_unequal_batches_with_masked_prompts_equal_one_process(tmp_path, base, data, method, engine):
    one, two = tmp_path / "one", tmp_path / "two"
    ft = [f"finetune.method={method}", "finetune.targets=q_proj,v_proj,down_proj",
          *(["--engine", "torch", "--device", "cpu"] if engine == "torch" else [])]
    r = run_train(_args(base, data, one, *ft, "train.steps=4", "train.batch_size=8"))
    assert r.returncode == 0, r.stderr
    assert "trainable" in r.stderr if method == "lora" else "all trained" in r.stderr
    r = run_train(_args(base, data, two, *ft, "train.steps=4",
                        "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"), np_=2)
    assert r.returncode == 0, r.stderr
    assert "drift:" not in r.stderr
    a, b = final_weights(one), final_weights(two)
    if method == "lora":
        assert a and all(k.endswith(("lora_a", "lora_b")) for k in a), "a LoRA checkpoint holds adapters only"
    assert_same_weights(a, b, atol=1e-5)


LORA = ["finetune.method=lora", "train.batch_size=4"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base, data):
    """A LoRA run of 6 steps: the uninterrupted run of the resume test, and the run the test
    after it tries to resume on another base."""
    run = tmp_path_factory.mktemp("lora") / "whole"
    r = run_train(_args(base, data, run, *LORA, "train.steps=6"))
    assert r.returncode == 0, r.stderr
    return run


def test_lora_resume_equals_no_interruption_and_writes_a_peft_adapter(tmp_path, base, data, lora_run):
    whole, parts = lora_run, tmp_path / "parts"
    assert run_train(_args(base, data, parts, *LORA, "train.steps=3")).returncode == 0
    r = run_train(_args(base, data, parts, *LORA, "train.steps=6", "--resume", "auto"))
    assert r.returncode == 0, r.stderr
    assert_same_weights(final_weights(whole), final_weights(parts), atol=1e-6)
    adapter = parts / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()


def test_resume_on_another_base_names_the_file(tmp_path, data, lora_run):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)  # a LoRA run's checkpoint, in a directory of this test's own
    other = make_llama(tmp_path / "other", seed=1)
    r = run_train(_args(other, data, run, *LORA, "train.steps=8", "--resume", "auto"))
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint ") and "model.safetensors" in last and "Traceback" not in r.stderr


@pytest.mark.cluster
def test_ranks_with_different_bases_are_named_before_any_step(tmp_path, base, data):
    other = make_llama(tmp_path / "other", seed=1)
    link = tmp_path / "per-rank"
    # Each rank reads model.path from its own environment-chosen config file.
    for rank, path in ((0, base), (1, other)):
        (tmp_path / f"rank{rank}.yaml").write_text(f"model:\n  path: {path}\n")
    script = (f'exec python -m mlxdist.train --config {tmp_path}/rank$OMPI_COMM_WORLD_RANK.yaml '
              + " ".join(_args("IGNORED", data, link, "train.steps=2")).replace("model.path=IGNORED", ""))
    import subprocess
    import sys

    from helpers import env, mpirun_path
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH",
           "-x", "PATH", "sh", "-c", script.replace("python", sys.executable, 1)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode != 0
    assert "the base weights on rank 1" in r.stderr and "differ from rank 0" in r.stderr
    assert not (link / "logs" / "rank0.jsonl").exists() or "step" not in (link / "logs" / "rank0.jsonl").read_text()
