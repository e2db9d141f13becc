"""`dist.mode=diloco` through the real CLI on real mpirun ranks, against a reference written
here: N workers run one after another in this process, each a plain single-rank AdamW
engine on its own share of the global sample stream, and the outer step is numpy
(sample-weighted mean pseudo-gradient, Nesterov momentum, fragments on their schedule).
Unequal per-rank batches throughout."""

import json
import shutil

import numpy as np
import pytest
from helpers import FAST, final_weights, run_train

pytestmark = pytest.mark.cluster

H, OUTER_LR, MU = 4, 0.7, 0.9
COMMON = [*FAST, "dist.mode=diloco", f"dist.inner_steps={H}", "dist.outer_wire=float32",
          f"dist.outer_lr={OUTER_LR}", f"dist.outer_momentum={MU}", "train.schedule=constant",
          "train.warmup_steps=0", "train.lr=2e-3", "checkpoint.keep_last=10"]


def _nodes(sizes: list[int]) -> str:
    return "nodes={" + ", ".join(f"rank{r}: {{batch_size: {b}}}" for r, b in enumerate(sizes)) + "}"


def reference(overrides: list[str], sizes: list[int], fragments: int, steps: int, snapshot: int):
    """(anchors after `steps` inner steps, each worker's local weights after `snapshot`).
    Runs in a subprocess started like a rank (same BLAS, same threads), so the only
    differences left are the algorithm's."""
    import subprocess
    import sys
    import tempfile

    from helpers import env

    with tempfile.TemporaryDirectory() as out:
        job = json.dumps([overrides, sizes, fragments, steps, snapshot, out])
        r = subprocess.run([sys.executable, __file__, job], capture_output=True, text=True, env=env(), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        saved = [dict(np.load(f"{out}/{i}.npz")) for i in range(1 + len(sizes))]
    return saved[0], saved[1:]


def _reference(overrides: list[str], sizes: list[int], fragments: int, steps: int, snapshot: int):
    from mlxdist.config import load_config
    from mlxdist.control import StepPlan
    from mlxdist.data import GlobalSampler
    from mlxdist.data.batch import BatchMaker
    from mlxdist.engine.base import local_step
    from mlxdist.engine.mlx_engine import MLXEngine
    from mlxdist.sync.fragments import partition
    from mlxdist.tasks.lm import lm_task

    cfg = load_config(None, [*overrides, "dist.mode=ddp"])  # one worker = plain local AdamW
    task = lm_task(cfg)
    plan = StepPlan.initial(sizes, cfg.train.accum, None)
    workers = [MLXEngine(cfg) for _ in sizes]
    makers = [BatchMaker(lambda idx: task.make_batch(task.dataset, idx), GlobalSampler(len(task.dataset), cfg.train.seed), r)
              for r in range(len(sizes))]
    anchor = workers[0].get_weights()
    names = sorted(anchor)
    groups = partition([anchor[n].size for n in names], fragments)
    momentum = {n: np.zeros_like(w) for n, w in anchor.items()}
    since = [[0] * fragments for _ in sizes]
    position = 0
    for t in range(1, steps + 1):
        for r, engine in enumerate(workers):
            for batch in makers[r](position, plan):
                engine.micro_step(batch)
            local_step(engine, cfg.train.lr)
            since[r] = [s + plan.shares[r] for s in since[r]]
        position += plan.global_batch
        into_round = (t - 1) % H + 1
        for k in range(fragments):
            if into_round != (k + 1) * H // fragments:
                continue
            local = [e.get_weights() for e in workers]
            total = sum(s[k] for s in since)
            for i in groups[k]:
                n = names[i]
                g = sum(np.float32(s[k]) * (anchor[n] - w[n]) for s, w in zip(since, local, strict=True)) / np.float32(total)
                momentum[n] = np.float32(MU) * momentum[n] + g
                anchor[n] = anchor[n] - np.float32(OUTER_LR) * (g + np.float32(MU) * momentum[n])
                for w in local:
                    w[n] = anchor[n]
            for r, engine in enumerate(workers):
                engine.set_weights(local[r])
                since[r][k] = 0
        if t == snapshot:
            locals_then = [e.get_weights() for e in workers]
    return anchor, locals_then


def _rank_weights(run_dir, step: int, rank: int) -> dict[str, np.ndarray]:
    from mlxdist.state import rank_state

    hosts = json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())["hosts"]
    arrays, _ = rank_state.load(run_dir / "rank_state", step, rank, len(hosts), hosts)
    return {k[len("weights."):]: v for k, v in arrays.items() if k.startswith("weights.")}


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert worst <= atol, f"max difference {worst:.3g} > {atol}"


def _events(run_dir, kind, rank=0):
    lines = (run_dir / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.mark.parametrize("sizes,fragments", [([3, 5], 1), ([2, 3, 4], 2)])
def test_diloco_run_equals_numpy_reference(tmp_path, sizes, fragments):
    steps, mid = 2 * H, 3 * H // 2  # the step-6 checkpoint holds each rank's mid-round weights
    args = [*COMMON, _nodes(sizes), f"dist.fragments={fragments}", f"train.steps={steps}",
            f"checkpoint.every={mid}", f"train.out_dir={tmp_path}"]
    r = run_train(args, np_=len(sizes))
    assert r.returncode == 0, r.stderr
    anchor, local = reference(args, sizes, fragments, steps, snapshot=mid)
    _close(final_weights(tmp_path), anchor, 1e-5)
    for rank in range(len(sizes)):
        _close(_rank_weights(tmp_path, mid, rank), local[rank], 1e-5)
        _close(_rank_weights(tmp_path, steps, rank), anchor, 1e-5)  # the run ends on the agreed model
    syncs = _events(tmp_path, "outer_sync")
    assert [e["fragment"] for e in syncs] == list(range(fragments)) * 2
    first_round = [(k + 1) * H // fragments for k in range(fragments)]
    assert [e["total_samples"] for e in syncs] == [n * sum(sizes) for n in [*first_round, *[H] * fragments]]
    assert sum(e["sync_bytes"] for e in _events(tmp_path, "step")) == 0, "DiLoCo must not all-reduce gradients"
    assert "DiLoCo: 4 inner steps" in r.stderr


def test_resume_mid_round_equals_no_interruption(tmp_path):
    """Checkpoint at step 6 (mid-round), copy the run as a crash at step 7 would leave it,
    resume: weights and every rank's own state equal the uninterrupted run."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    common = [*COMMON, _nodes([3, 5]), "dist.fragments=2", "train.steps=10", "checkpoint.every=3"]
    r = run_train([*common, f"train.out_dir={whole}"], np_=2)
    assert r.returncode == 0, r.stderr
    shutil.copytree(whole, parts)
    for later in ("checkpoints/step_00000009", "checkpoints/step_00000010", "rank_state/step_00000009",
                  "rank_state/step_00000010"):
        shutil.rmtree(parts / later)
    r = run_train([*common, f"train.out_dir={parts}", "--resume", "auto"], np_=2)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr and "step 6" in r.stderr
    assert "shared outer state only" not in r.stderr
    _close(final_weights(parts), final_weights(whole), 1e-6)
    for rank in range(2):
        _close(_rank_weights(parts, 10, rank), _rank_weights(whole, 10, rank), 1e-6)


def test_corrupt_rank_file_falls_back_to_the_shared_state(tmp_path):
    """One rank's own file damaged on disk: no rank uses its own state (they must agree on
    the round), the run says why and goes on from the agreed weights; nothing is deleted."""
    common = [*COMMON, _nodes([3, 5]), f"train.out_dir={tmp_path}"]
    r = run_train([*common, "train.steps=6", "checkpoint.every=6"], np_=2)
    assert r.returncode == 0, r.stderr
    damaged = tmp_path / "rank_state" / "step_00000006" / "rank1.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    r = run_train([*common, "train.steps=8", "checkpoint.every=0", "--resume", "auto"], np_=2)
    assert r.returncode == 0, r.stderr
    assert "shared outer state only" in r.stderr and "rank1.safetensors fails its sha256 check" in r.stderr
    assert damaged.exists()


def test_resume_on_fewer_ranks_continues_from_the_shared_state(tmp_path):
    common = [*COMMON, "dist.outer_wire=int8", "train.batch_size=3", f"train.out_dir={tmp_path}"]
    r = run_train([*common, "train.steps=6", "checkpoint.every=6"], np_=3)
    assert r.returncode == 0, r.stderr
    r = run_train([*common, "train.steps=10", "checkpoint.every=0", "--resume", "auto"], np_=2)
    assert r.returncode == 0, r.stderr
    assert "shared outer state only" in r.stderr
    steps = [e["step"] for e in _events(tmp_path, "step")]
    assert steps[-1] == 10
    assert np.isfinite(_events(tmp_path, "step")[-1]["loss"])


def test_overlapped_int4_wire_keeps_ranks_in_agreement(tmp_path):
    """Background fragment syncs with a lossy wire: every rank decodes the same sum, so at
    the end (all syncs landed) the ranks hold one model."""
    args = [*COMMON, _nodes([2, 3]), "dist.fragments=2", "dist.overlap_steps=1", "dist.outer_wire=int4",
            "train.steps=8", "checkpoint.every=0", f"train.out_dir={tmp_path}"]
    r = run_train(args, np_=2)
    assert r.returncode == 0, r.stderr
    anchors = final_weights(tmp_path)
    for rank in range(2):
        _close(_rank_weights(tmp_path, 8, rank), anchors, 0.0)
    syncs = _events(tmp_path, "outer_sync", rank=1)
    assert len(syncs) == 4 and all(e["bytes"] > 0 for e in syncs)


if __name__ == "__main__":  # the reference's own process (see `reference`)
    import sys

    from mlxdist.blas import ensure_openblas

    ensure_openblas()
    overrides, sizes, fragments, steps, snapshot, out = json.loads(sys.argv[1])
    anchor, local = _reference(overrides, sizes, fragments, steps, snapshot)
    for i, arrays in enumerate([anchor, *local]):
        np.savez(f"{out}/{i}.npz", **arrays)


def test_rollback_waits_for_the_next_meeting_and_is_taken_together(tmp_path):
    """Local steps mean local health verdicts; ranks roll back together at the next meeting
    (every control.balance_interval steps), never one without the other."""
    args = [*COMMON, _nodes([3, 5]), "train.steps=12", "checkpoint.every=3", "control.max_bad_steps=2",
            "control.balance_interval=5", f"train.out_dir={tmp_path}"]
    r = run_train(args, np_=2, extra_env={"MLXDIST_INJECT_NAN": "4,5"})
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        rollbacks = _events(tmp_path, "rollback", rank)
        assert [e["step"] for e in rollbacks] == [9], rollbacks  # wished at step 6, agreed at the step-10 meeting
        assert [e["step"] for e in _events(tmp_path, "step", rank)][-1] == 12
