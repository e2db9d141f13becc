"""Load balancing end to end: real ranks, real timings, the global batch never changes.

The unit tests in test_control.py feed the balancer made-up timings; only a run with a
host that is really slower shows that measured compute times, the all-gather and the
re-split together move work to where it finishes soonest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, ROOT, env, mpirun_path, run_train

GLOBAL = 24


def _events(run_dir: Path) -> list[dict]:
    log = run_dir / "logs" / "rank0.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


@pytest.mark.cluster
@pytest.mark.netns
def test_slow_host_gets_smaller_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxdist.rig.simcluster import SimCluster, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    # mpirun_args forwards only variables set in this process's environment.
    for k, v in env().items():
        if k in ("PYTHONPATH", "OPENBLAS_NUM_THREADS"):
            monkeypatch.setenv(k, v)
    run_dir = tmp_path / "run"
    # Host 1 stays uncapped: under a CFS quota, rank 0's busy-wait in the collectives
    # for the slow rank burns its own quota, throttles its next compute and makes it
    # measure as slow as rank 1, so the equal split can persist for many steps.
    # Host 2 at 30% stays well under the fair share of a busy 2-core machine.
    with SimCluster(2, name="mlxbt", subnet="10.77.42", state_dir=tmp_path / "sc") as c:
        c.slow(2, 30)
        cmd = [mpirun_path(), *c.mpirun_args(env=["OPENBLAS_NUM_THREADS"]), "-np", "2",
               sys.executable, "-m", "mlxdist.train", *FAST, "data.seq_len=64",
               f"train.batch_size={GLOBAL}", f"train.global_batch={GLOBAL}", "train.steps=30",
               "checkpoint.every=0", "control.balance=true", "control.balance_interval=2",
               f"train.out_dir={run_dir}"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    events = _events(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 30
    assert all(sum(e["shares"]) == GLOBAL for e in steps), [e["shares"] for e in steps]
    assert steps[0]["shares"] == [GLOBAL // 2, GLOBAL // 2]
    assert [e for e in events if e["event"] == "balance"], "balancer never re-split"
    # Host 2 (rank 1) has at most a third of host 1's CPU: at most ~1/3 of the batch.
    final = steps[-1]["shares"]
    assert final[1] < 0.42 * GLOBAL, (final, [e["shares"] for e in steps])


@pytest.mark.cluster
def test_shares_always_sum_to_global_batch_localhost(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Unequal micro-batches make the first split unequal, so the balancer has work either way.
    res = run_train([*FAST, "train.steps=12", "train.global_batch=12", "checkpoint.every=0",
                     "control.balance=true", "control.balance_interval=1",
                     "nodes={rank0: {batch_size: 8}, rank1: {batch_size: 4}}",
                     f"train.out_dir={run_dir}"], np_=2, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 12
    assert steps[0]["shares"] == [8, 4]
    for e in steps:
        assert sum(e["shares"]) == 12 and min(e["shares"]) >= 1, e["shares"]
    for e in events:
        if e["event"] == "balance":
            assert sum(e["old"]) == sum(e["new"]) == 12, e

