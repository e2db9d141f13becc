"""LoRA under sharding: only the trainable state (the adapters) is sharded, the frozen base
stays whole on every rank, and the sharded fine-tune equals the unsharded one (DESIGN promise
9) on 2 ranks with unequal batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, assert_same_weights, final_weights, run_train
from tiny_hf import make_llama

pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")

ROWS = [{"prompt": "What is two plus two?", "completion": " Four."},
        {"messages": [{"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris, of course."}]},
        {"prompt": "Hello, how are you", "completion": " today? I am fine, thanks."},
        {"text": "You are a helpful assistant. The capital of France is Paris."}] * 6
COMMON = [x for x in FAST if not x.startswith(("data.", "model.preset"))] + [
    "train.lr=1e-3", "train.grad_clip=0.05", "train.weight_decay=0.1", "checkpoint.every=0",
    "dist.sync_weights_every=0", "train.schedule=constant", "train.warmup_steps=0", "train.steps=3",
    "finetune.method=lora", "finetune.targets=q_proj,v_proj,down_proj", "data.source=jsonl", "data.seq_len=24"]
# 3 + 5 samples a step; rank 0 may use 0.8 of its memory, rank 1 0.2: shards 4 : 1.
UNEQUAL = "nodes={rank0: {batch_size: 3, memory_target: 0.8}, rank1: {batch_size: 5, memory_target: 0.2}}"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama") / "base")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _shard_events(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "shard"]


@pytest.mark.cluster
def test_lora_under_zero2_shards_the_adapters_only_and_equals_the_unsharded_run(tmp_path, base, data):
    """The unsharded reference is one process with the same 8 samples a step (data parallel 3 + 5
    equals it: tests/test_finetune.py); the sharded run is ZeRO-2 on 2 ranks, 3 + 5, clipping on."""
    runs = {}
    for shard, split, ranks in (("none", "train.batch_size=8", 0), ("gradients", UNEQUAL, 2)):
        out = tmp_path / shard
        r = run_train([*COMMON, f"model.path={base}", f"data.path={data}", split, f"dist.shard={shard}",
                       f"train.out_dir={out}"], np_=ranks)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "drift:" not in r.stderr
        runs[shard] = (out, r.stderr)
    dp, zero2 = final_weights(runs["none"][0]), final_weights(runs["gradients"][0])
    assert dp and all(k.endswith(("lora_a", "lora_b")) for k in dp), sorted(dp)  # adapters only
    assert_same_weights(dp, zero2, atol=1e-5)
    assert max(float(np.max(np.abs(v))) for k, v in zero2.items() if k.endswith("lora_b")) > 0  # they trained

    adapters = sum(v.size for v in zero2.values())
    from safetensors.numpy import load_file

    whole = sum(v.size for v in load_file(str(base / "model.safetensors")).values())
    assert adapters < whole // 10, (adapters, whole)  # 6656 of 115008
    for rank in (0, 1):
        event = _shard_events(runs["gradients"][0], rank)[0]
        assert event["mode"] == "gradients" and sum(event["elements"]) == adapters, (event, adapters)
        assert event["elements"][0] > 3 * event["elements"][1]  # by memory budget, 0.8 : 0.2
        assert event["optimizer_bytes_here"] == 8 * event["elements"][rank]
    assert f"AdamW state of {adapters} parameters" in runs["gradients"][1], runs["gradients"][1][-3000:]
