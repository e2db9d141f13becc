"""Elastic restarts with sharded optimizer state (`launch/mlxrun --elastic`, `dist.shard=optimizer`)
on three namespace hosts (cluster `mlxse`, subnet 10.83.27): a host dies with its rank's shard of
AdamW's moments; the checkpoints hold the moments whole (gathered into data parallel's format at
every save), so the job restarts on the two survivors from the newest checkpoint, each rank
cutting its new, larger shard out of it, and finishes where an uninterrupted run does."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, assert_same_weights, final_weights, namespace_cluster, run_train

from mlxdist.state import checkpoint as ckpt

MLXRUN = [sys.executable, str(ROOT / "launch" / "mlxrun")]
STALL_S = 5
STEPS, EVERY = 12, 3
TRAIN = ["data.source=synthetic", "data.seq_len=16", "model.preset=tiny", "model.dtype=float32", "metrics.port=0",
         "train.progress=false", "train.eval_every=0", "train.warmup_steps=2", "train.grad_clip=0.5",
         "train.batch_size=4", f"dist.stall_timeout_s={STALL_S}", f"checkpoint.every={EVERY}",
         "checkpoint.on_every_host=true", "dist.sync_weights_every=0", "dist.shard=optimizer", f"train.steps={STEPS}"]
# Steps slow enough (compute x30, by sleeping) that no further checkpoint lands between the one
# the test waits for and the kill: the resume step is known exactly.
SLOW = "MLXDIST_RIG_COMPUTE_SCALE=30"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from namespace_cluster(tmp_path_factory, 3, "mlxse", "10.83.27")


@pytest.fixture
def healed(cluster):
    yield cluster
    for h in cluster.hosts:
        with contextlib.suppress(Exception):
            cluster.heal(h)
        cluster.kill(h)


def _events(out: Path, rank: int = 0) -> list[dict]:
    path = out / "logs" / f"rank{rank}.jsonl"
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a killed process
            events.append(json.loads(line))
    return events


def _whole(out: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in ckpt.list_checkpoints(out / "checkpoints")
                  if ckpt.verify(p) is None)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.slow
def test_a_lost_hosts_shard_is_in_the_checkpoint_and_the_survivors_finish_the_run(healed, tmp_path: Path) -> None:
    c = healed
    ref = tmp_path / "uninterrupted"
    r = run_train([*TRAIN, f"train.out_dir={ref}"], np_=3)  # the same 3 ranks x 4 samples, on one host
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp_path / "elastic"
    job = subprocess.Popen([*MLXRUN, "--simcluster", str(c.state_dir), "--elastic", "--min-hosts", "2",
                            "-x", SLOW, "--", *TRAIN, f"train.out_dir={out}"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while 2 * EVERY not in _whole(out):  # the second checkpoint, then the host dies
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no checkpoint at step {2 * EVERY} before the fault:\n{''.join(lines)[-3000:]}")
            time.sleep(0.05)
        c.kill(3)  # rank 2's host, with its shard of the moments
        c.cut(3)
        saved = _whole(out)
        code = job.wait(240)
    finally:
        job.kill()
        job.wait()
        reader.join(5)
    text = "".join(lines)
    assert code == 0, f"exit {code}:\n{text[-4000:]}"
    assert saved[-1] == 2 * EVERY, saved
    restarts = [ln for ln in text.splitlines() if "elastic_restart" in ln]
    # One restart; rarely the rig's cut is not seen at the first probe (a stall is reported
    # first), the dead host is taken back, fails to start, and a second restart drops it.
    assert restarts and "dropped 10.83.27.3" in restarts[-1], text[-4000:]
    assert all(f"resuming from step {2 * EVERY} " in ln for ln in restarts), restarts
    assert f"job completed at step {STEPS} (after {len(restarts)} elastic restart(s)," in text, text[-2000:]

    # Before: 3 equal shards; after: 2, each cut from the checkpoint's whole moments.
    shards = [e for e in _events(out) if e["event"] == "shard"]
    first, last = shards[0], shards[-1]
    assert len(first["elements"]) == 3 and len(last["elements"]) == 2 and last["step"] == 2 * EVERY
    assert sum(first["elements"]) == sum(last["elements"])
    steps = [e for e in _events(out) if e["event"] == "step"]
    assert steps[-1]["step"] == STEPS and steps[-1]["shares"] == [6, 6]

    # The moments at the resume step are those of the uninterrupted run (the killed rank's range
    # included), and so are those after the restart, on 2 ranks: the checkpoints are whole.
    resumed_from, after = ckpt.load(out / "checkpoints" / f"step_{2 * EVERY:08d}"), \
        ckpt.load(out / "checkpoints" / f"step_{3 * EVERY:08d}")
    expected_from, expected_after = ckpt.load(ref / "checkpoints" / f"step_{2 * EVERY:08d}"), \
        ckpt.load(ref / "checkpoints" / f"step_{3 * EVERY:08d}")
    assert after.meta.world_size == 2 and after.meta.optimizer_step == 3 * EVERY
    flat = np.concatenate([after.optimizer[k].reshape(-1) for k in sorted(after.optimizer) if k.startswith("v.")])
    assert np.all(np.isfinite(flat)) and np.all(flat >= 0)
    assert all(np.any(v != 0) for v in resumed_from.optimizer.values())  # every parameter's, every shard's
    assert _max_diff(resumed_from.optimizer, expected_from.optimizer) <= 1e-6
    assert _max_diff(after.optimizer, expected_after.optimizer) <= 1e-6

    # Same samples, same order, same global batch: the weights end where the uninterrupted run's do.
    assert_same_weights(final_weights(ref), final_weights(out), atol=1e-5)
