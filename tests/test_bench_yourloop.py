"""`bench yourloop` end to end in its smallest shape: one round, the tiny model, beside one
busy-loop process, a short wait probe. Its rows must exist and be consistent (the ratio is the
two step times' ratio, both loops trained the same batches), not fast: the figures themselves
live in docs/measurements.md, measured by the full run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, env, mpirun_path


@pytest.mark.cluster
def test_bench_yourloop_runs_and_reports(tmp_path) -> None:
    mpirun_path()  # skips where there is no mpirun
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "yourloop", "--rounds", "1", "--models", "tiny",
                        "--loads", "busy", "--busy", "1", "--launches", "1", "--steps", "3", "--skip", "1", "--delay", "0.3",
                        "--probe-repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    (one,) = got["rounds"]
    row = one["busy"]["tiny"]
    assert row["ddp"]["step_s"] > 0 and row["yourloop"]["step_s"] > 0
    assert row["ratio"] == pytest.approx(row["yourloop"]["step_s"] / row["ddp"]["step_s"])
    assert row["max_loss_diff"] < 1e-5  # the same model, batches and update in both loops
    waits = one["busy"]["wait"]
    assert set(waits) == {"ddp", "yourloop"}
    for loop in waits.values():
        assert {"step", "all_reduce", "barrier"} <= set(loop)
        assert all(w["wall_s"] >= 0.2 and w["cpu_s"] >= 0 for kind, w in loop.items() if kind != "idle")
    assert "busy  tiny : yourloop / DDP = " in r.stdout
    assert "CPU over a 0.3 s wait, barrier" in r.stdout
