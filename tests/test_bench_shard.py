"""`python -m mlxdist.bench shard` at its smallest (tiny LM, 2 ranks, one round): the table's
numbers are real, ZeRO-1 holds half of data parallel's AdamW state a rank, and under a
memory limit data parallel's plan does not fit, `dist.shard=auto` picks ZeRO-1, trains, and
matches data parallel's losses."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import ROOT, env

pytestmark = pytest.mark.cluster


def test_smallest_run_reports_memory_time_and_the_no_fit_demo(tmp_path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "shard", "--preset", "tiny", "--rounds", "1",
                        "--steps", "3", "--skip", "1", "--seq-len", "16", "--modes", "none,optimizer",
                        "--json", str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert "optimizer (ZeRO-1)" in r.stdout and "doesn't fit" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"none", "optimizer"}
    ddp, zero1 = res["modes"]["none"], res["modes"]["optimizer"]
    assert all(x["optimizer_bytes"] == 8 * res["n_params"] for x in ddp["ranks"])
    assert zero1["optimizer_ratio_ok"] and sum(x["optimizer_bytes"] for x in zero1["ranks"]) == 8 * res["n_params"]
    for mode in (ddp, zero1):
        assert mode["step_s"] > 0 and math.isfinite(mode["step_ratio"])
        assert all(x["peak_bytes"] >= x["active_bytes"] > 0 for x in mode["ranks"])
    # seconds a step by phase, per rank: ZeRO-1's own phases, data parallel's all-reduce
    for phases in zero1["phases"]:
        assert {"reduce_scatter", "update", "all_gather", "compute"} <= set(phases) and phases["rest"] > -0.01
    assert all("all_reduce" in x for x in ddp["phases"])
    demo = res["no_fit"]
    assert demo["need_optimizer_bytes"] <= demo["budget_bytes"] < demo["need_none_bytes"]
    assert demo["auto_exit"] == 0 and demo["auto_mode"] == "optimizer" and demo["auto_steps"] == 3
    assert demo["auto_max_loss_diff"] <= 1e-4
