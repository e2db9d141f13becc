"""Real ranks under `mpirun` on localhost: exactness with unequal batches, drift repair,
resume on fewer ranks, metrics from every rank."""

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import (
    FAST,
    assert_same_weights,
    env,
    final_weights,
    logged_steps,
    mpirun_path,
    run_train,
    stop_with_sigterm_after,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.cluster
EXACT = [*FAST, "train.lr=2e-4", "train.grad_clip=0", "checkpoint.every=0", "dist.sync_weights_every=0"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process with the global batch of 8, 6 steps: the reference for every backend below."""
    out = tmp_path_factory.mktemp("single") / "run"
    r = run_train([*EXACT, "train.steps=6", "train.batch_size=8", f"train.out_dir={out}"])
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("backend", ["mpi4py", "mlx-mpi", "mlx-ring"])
def test_unequal_batches_equal_single_process(tmp_path, single, backend):
    multi = tmp_path / "multi"
    r = run_train([*EXACT, "train.steps=6", f"train.out_dir={multi}", f"dist.backend={backend}",
                   "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"], np_=2)
    assert r.returncode == 0, r.stderr
    assert "shares [3, 5]" in r.stderr
    assert_same_weights(final_weights(single), final_weights(multi), atol=1e-5)


def test_three_ranks_and_bf16_wire(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert run_train([*EXACT, "train.steps=4", "train.batch_size=9", f"train.out_dir={single}"]).returncode == 0
    r = run_train([*EXACT, "train.steps=4", "train.batch_size=3", f"train.out_dir={multi}",
                   "dist.wire_dtype=bfloat16", "dist.bucket_mb=0.5"], np_=3)
    assert r.returncode == 0, r.stderr
    # bf16 on the wire rounds gradients: close, not exact
    assert_same_weights(final_weights(single), final_weights(multi), atol=5e-3)


def test_drift_is_detected_and_repaired(tmp_path):
    r = run_train([*FAST, "train.steps=8", "dist.sync_weights_every=2", f"train.out_dir={tmp_path}"],
                  np_=2, extra_env={"MLXDIST_INJECT_DRIFT": "1:3"})
    assert r.returncode == 0, r.stderr
    # two ranks, no checkpoint yet, neither self-check failed: no blame, rank 0's weights kept
    assert re.search(r"drift: step 4: weights disagree \(rank 0 \(\S+\) vs rank 1 \(\S+\)\) and no rank can "
                     r"be shown wrong; restoring the latest checkpoint: none saved yet, so continuing from "
                     r"rank 0's weights", r.stderr), r.stderr[-3000:]
    events = [json.loads(x) for x in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "drift_repair"] == [4]


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    common = [*EXACT, "train.steps=30"]
    ref, two = tmp_path / "ref", tmp_path / "two"
    assert run_train([*common, "train.batch_size=8", f"train.out_dir={ref}"]).returncode == 0
    stop_with_sigterm_after([*common, "train.batch_size=4", f"train.out_dir={two}"], two, 3, np_=2)
    stopped = logged_steps(two)[-1]["step"]  # all ranks agreed on this step and saved it
    assert 3 <= stopped < 30 and (two / "checkpoints" / f"step_{stopped:08d}").is_dir()
    # same global batch, now on one rank: the sample stream continues where it stopped
    r = run_train([*common, "train.batch_size=8", f"train.out_dir={two}", "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    assert "saved by 2 rank(s)" in r.stderr
    assert_same_weights(final_weights(ref), final_weights(two), atol=1e-5)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_scraped_from_every_rank(tmp_path):
    port = _free_port()
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH",
           sys.executable, "-m", "mlxdist.train", *FAST, "train.steps=100000", f"metrics.port={port}",
           "metrics.bind=127.0.0.1", f"train.out_dir={tmp_path}", "checkpoint.every=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        scraped = {}
        deadline = time.time() + 90
        while time.time() < deadline and len(scraped) < 2:
            for rank in (0, 1):
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics", timeout=2).read().decode()
                except OSError:
                    continue
                families = {f.name: f for f in text_string_to_metric_families(body)}
                steps = [s for s in families["mlxdist_steps"].samples if s.name == "mlxdist_steps_total"]
                if steps and steps[0].value >= 2:
                    scraped[rank] = families
            time.sleep(0.3)
        assert set(scraped) == {0, 1}, f"scraped only ranks {sorted(scraped)}"
        for rank, fam in scraped.items():
            loss = fam["mlxdist_loss"].samples[0]
            assert loss.labels["rank"] == str(rank) and loss.labels["host"]
            assert 0 < loss.value < 10
            assert fam["mlxdist_sync_seconds"].type == "histogram"
            assert any(s.value > 0 for s in fam["mlxdist_sync_bytes"].samples)
    finally:
        proc.send_signal(signal.SIGUSR1)  # what mpirun forwards (its own SIGTERM kills unsaved)
        out, err = proc.communicate(timeout=60)
    # the ranks agree on a step, save it, and end
    last = logged_steps(tmp_path)[-1]["step"]
    assert (tmp_path / "checkpoints" / f"step_{last:08d}").is_dir(), err[-2000:]
