"""`bench torchddp`'s two plain loops: DDP over gloo and the same lines on mlxdist.torch (your-loop
mode) train the same model on the same batches, so their losses agree step by step; a faster
your-loop row that trained something else would compare nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, env, mpirun_path

from mlxdist.bench.torchddp import rate_bits


def test_rate_bits() -> None:
    assert rate_bits("1gbit") == 1e9 and rate_bits("100mbit") == 1e8
    with pytest.raises(ValueError):
        rate_bits("1gb")


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[dict, str]:
    """One `bench torchddp` run (ours with and without overlap, DDP, your loop: 2 ranks each),
    read by both tests below."""
    mpirun_path()  # skips where there is no mpirun
    out = tmp_path_factory.mktemp("torchddp") / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "torchddp", "--preset", "tiny", "--steps", "5",
                        "--skip", "1", "--json", str(out)], capture_output=True, text=True, env=env(), timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text()), r.stdout


@pytest.mark.cluster
def test_yourloop_matches_ddp_step_by_step(bench) -> None:
    got, steps = bench[0], 5
    out = got["loops"]
    for loop in ("ddp", "yourloop"):
        assert len(out[loop]["step_s"]) == steps and all(t > 0 for t in out[loop]["step_s"])
    assert out["yourloop"]["loss"] == pytest.approx(out["ddp"]["loss"], abs=1e-6)  # measured: equal


@pytest.mark.cluster
def test_bench_torchddp_runs_both_side_by_side(bench) -> None:
    got, stdout = bench
    assert got["ddp_step_s"] > 0 and got["ours_step_s"] > 0 and got["sync_bytes"] > 0
    assert abs(got["ratio_ours_to_ddp"] - got["ours_step_s"] / got["ddp_step_s"]) < 1e-9
    assert "ours / DDP = " in stdout
