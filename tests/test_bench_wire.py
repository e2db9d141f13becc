"""`python -m mlxdist.bench wire` at its smallest (the tiny LM, 2 ranks on this host, one round):
the table's numbers are real, the int8 wire sends about a quarter of fp32's bytes, and its loss
stays near fp32's. docs/measurements.md has its runs at 1 Gbit."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import ROOT, env

pytestmark = pytest.mark.cluster


def test_smallest_run_reports_time_bytes_and_loss_against_fp32(tmp_path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "wire", "--simcluster", "0", "--model",
                        "model.preset=tiny", "--rounds", "1", "--steps", "4", "--skip", "1", "--seq-len", "16",
                        "--json", str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    res = json.loads(out.read_text())
    fp32, int8 = res["wires"]["float32"], res["wires"]["int8"]
    assert fp32["sync_bytes"] == 4 * res["n_params"]
    assert 0.25 < int8["sync_bytes"] / fp32["sync_bytes"] < 0.27
    assert fp32["step_ratio"] == 1.0 and math.isfinite(int8["step_ratio"]) and int8["codec_s"] > 0
    assert abs(int8["eval_diff_rounds"][0]) < 0.01 and len(int8["losses_round1"]) == 4
    assert "int8" in r.stdout and "/ fp32" in r.stdout, r.stdout
