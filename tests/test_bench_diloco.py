"""`python -m mlxdist.bench diloco` at its smallest, on real namespace hosts with shaped
links: both cluster runs happen, and the table's numbers are real (finite, positive,
DiLoCo's step logs carry no gradient all-reduce while DDP's do)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import ROOT, env

pytestmark = [pytest.mark.cluster, pytest.mark.netns]


def test_smallest_run_reports_both_modes(tmp_path) -> None:
    from mlxdist.rig.simcluster import available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "diloco", "--preset", "tiny", "--steps", "8",
                        "--inner-steps", "4", "--wire", "bfloat16", "--solo-steps", "5", "--skip", "1", "--eval-batches", "2",
                        "--subnet", "10.77.53", "--json", str(out)],
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| DDP |" in r.stdout and "| DiLoCo H=4 bfloat16 mu=0.5 |" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    for mode in ("ddp", "diloco"):
        assert res[mode]["samples_per_s"] > 0 and math.isfinite(res[mode]["eval_loss"]), res
    assert res["ddp"]["sync_bytes_per_step"] > 0 and res["diloco"]["outer_sync_bytes"] > 0
    assert res["bound"] == pytest.approx(sum((a + b) / 2 for a, b in zip(res["solo_before"], res["solo_after"], strict=True)))
    assert "mlxdlc" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_each_timed_run_is_held_to_the_solo_rates_around_it() -> None:
    from mlxdist.bench.runs import bracketing_bounds

    # The box slows down between the first and second mode: only the runs next to it see that.
    solos = [[3.0, 2.0], [3.0, 2.0], [2.0, 1.0], [2.0, 1.0]]
    assert bracketing_bounds(solos) == pytest.approx([5.0, 4.0, 3.0])
    assert bracketing_bounds([[1.0], [2.0]]) == pytest.approx([1.5])
    with pytest.raises(ValueError):
        bracketing_bounds([[1.0, 2.0], [1.0]])  # a host missing from one solo measurement


def test_time_boxed_run_reports_ddp_loss_at_its_tokens(tmp_path) -> None:
    """`--modes box --reference`: one time-boxed overlapped run, then DDP on unshaped links for the
    same samples, its eval loss taken at the point nearest the run's."""
    from mlxdist.rig.simcluster import available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "diloco", "--preset", "tiny", "--slow", "2", "--wall", "6",
                        "--box", "2", "--box-first", "3", "--overlap", "1", "--modes", "box", "--reference",
                        "--solo-steps", "5", "--skip", "1", "--eval-batches", "2", "--subnet", "10.77.54",
                        "--json", str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res["runs"]) == ["diloco box 2s"], res["runs"].keys()
    run, ref = res["runs"]["diloco box 2s"], res["reference"]["at_tokens"]["diloco box 2s"]
    assert run["samples"] > 0 and res["overlap_steps"] == 1
    # the reference point is the eval step nearest the run's samples, at most half an eval interval away
    every = min(int(s) for s in res["reference"]["evals"])
    assert abs(ref["ddp_samples"] - run["samples"]) <= every * res["reference"]["samples_per_step"] / 2 + 1
    assert math.isfinite(ref["ddp_eval_loss"]) and ref["ratio"] == pytest.approx(run["eval_loss"] / ref["ddp_eval_loss"])
    assert "DDP reference (links unshaped" in r.stdout
    assert "mlxdlc" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
