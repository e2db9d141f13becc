"""`python -m mlxdist.bench compiled` at its smallest (2 ranks on this host, one round): your
loop's step compiled with its sum in the graph against uncompiled, and `--trainer`'s three
kinds of the trainer's step, each timed; docs/measurements.md has the measured runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import ROOT, env

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("mode", [[], ["--trainer", "--context", "16"]])
def test_smallest_run_times_every_kind_of_step_and_gives_ratios(tmp_path, mode) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "compiled", *mode, "--rounds", "1", "--steps", "2",
                        "--warmup", "1", "--dim", "32", "--layers", "1", "--json", str(out)],
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    res = json.loads(out.read_text())
    assert res["n"] == 2 and res["backend"] == "mpi4py+mlx-mpi" and res["params"] > 0
    assert len(res["median_step_s"]) == (3 if mode else 2)
    assert all(len(v) == 1 and v[0] > 0 for v in res["median_step_s"].values())
    assert all(math.isfinite(q[0]) and q[0] > 0 for q in res["ratios"].values())
    assert "sum in the graph" in r.stdout and "round 1:" in r.stdout, r.stdout
