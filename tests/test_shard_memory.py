"""What a rank holds, seen from outside: the `mlxdist_optimizer_state_bytes` gauge each rank
serves (all of AdamW's state under data parallel, its shard under `dist.shard`), scraped from
real ranks; and the memory plan's one warning line when `dist.shard=none` does not fit."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import FAST, env, logged_steps, mpirun_path, run_train
from prometheus_client.parser import text_string_to_metric_families

from mlxdist.telemetry.metrics import Metrics

HERE = Path(__file__).parent
PARAMS = 195  # user_tasks:mlx_mlp, Linear(8, 16) + Linear(16, 3)
GAUGE = "mlxdist_optimizer_state_bytes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(args: list[str], n: int, tmp_path: Path) -> tuple[dict[int, dict], str]:
    """Start `n` ranks training for a long while, scrape every rank's gauge once it has
    trained a step, stop them (SIGUSR1, which mpirun forwards) and return the samples by rank
    and the run's stderr."""
    port = _free_port()
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(n), "-x", "PYTHONPATH",
           "-x", "OPENBLAS_NUM_THREADS", sys.executable, "-m", "mlxdist.train", "train.steps=100000",
           f"metrics.port={port}", "metrics.bind=127.0.0.1", "checkpoint.every=0", "train.progress=false",
           "train.eval_every=0", "task.factory=user_tasks:mlx_mlp", f"train.out_dir={tmp_path}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=HERE)
    scraped: dict[int, dict] = {}
    try:
        deadline = time.time() + 90
        while time.time() < deadline and len(scraped) < n and proc.poll() is None:
            for rank in range(n):
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics", timeout=2).read().decode()
                except OSError:
                    continue
                families = {f.name: f for f in text_string_to_metric_families(body)}
                steps = families["mlxdist_steps"].samples
                if steps and steps[0].value >= 1:
                    scraped[rank] = {s.name: s for s in families[GAUGE].samples}[GAUGE]
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    assert set(scraped) == set(range(n)), f"scraped only ranks {sorted(scraped)}:\n{err[-3000:]}"
    return scraped, err


def test_the_gauge_follows_the_shard_event():
    m = Metrics(1, "macbook")
    labels = {"rank": "1", "host": "macbook"}
    m.optimizer_state.set(8 * PARAMS)  # what the loop sets at start: data parallel holds it all
    assert m.registry.get_sample_value(GAUGE, labels) == 8 * PARAMS
    m.record("shard", {"step": 0, "mode": "optimizer", "rank": 1, "elements": [156, 39],
                       "optimizer_bytes": [1248, 312], "optimizer_bytes_here": 312})
    assert m.registry.get_sample_value(GAUGE, labels) == 312


@pytest.mark.cluster
@pytest.mark.parametrize("shard, expected", [
    ("none", [8 * PARAMS, 8 * PARAMS]),  # data parallel: every rank all of m and v
    ("optimizer", [8 * 156, 8 * 39]),  # ZeRO-1, shards 0.8 : 0.2 of the memory (the shard event's elements)
])
def test_each_rank_serves_the_optimizer_state_bytes_it_holds(tmp_path, shard, expected):
    scraped, err = _scrape([f"dist.shard={shard}", "train.batch_size=4",
                            "nodes={rank0: {memory_target: 0.8}, rank1: {memory_target: 0.2}}"], 2, tmp_path)
    for rank, sample in scraped.items():
        assert sample.labels["rank"] == str(rank) and sample.labels["host"], sample.labels
        assert sample.value == expected[rank], (rank, sample.value, expected)
    assert sum(s.value for s in scraped.values()) == 8 * PARAMS * (2 if shard == "none" else 1)
    assert "warning: memory plan" not in err  # the machine's memory: data parallel fits


@pytest.mark.cluster
def test_data_parallel_that_does_not_fit_warns_once_at_start_and_trains_on(tmp_path):
    """The built-in tiny LM on 2 ranks: data parallel's plan is 23.5 MiB a rank, ZeRO-1's 16.6;
    a 22 MB limit (budget 17.8 MiB) fits ZeRO-1 only. `dist.shard=none` warns in one line and
    trains all its steps, unsharded."""
    r = run_train([*FAST, "train.batch_size=4", "train.steps=2", "dist.shard=none", f"train.out_dir={tmp_path}"],
                  np_=2, extra_env={"MLXDIST_MEMORY_LIMIT_BYTES": "22000000"})
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [ln for ln in r.stderr.splitlines() if "warning: memory plan:" in ln]
    assert len(warnings) == 1, r.stderr[-3000:]
    line = warnings[0]
    assert "rank 0 (" in line and "needs 23.5 MiB under dist.shard=none (data parallel) but its budget is " \
                                  "17.8 MiB (21.0 MiB x memory_target 0.85)" in line, line
    assert "set dist.shard=auto (or optimizer/gradients): auto would choose optimizer (ZeRO-1)" in line, line
    assert "sharded data parallel" not in r.stderr
    assert [e["step"] for e in logged_steps(tmp_path)] == [1, 2]
