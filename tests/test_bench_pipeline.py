"""`python -m mlxdist.bench pipeline` at its smallest (tiny LM, one round, 1 Gbit/s): on two
namespace hosts, equal and one at half speed, or, without namespaces, on 2 ranks of this host
(equal only). The report's numbers are real, the cuts are the ones asked for, and the
pipeline's losses equal ZeRO-3's on the same samples."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from helpers import ROOT, env
from tiny_hf import make_llama

from mlxdist.rig.simcluster import available

pytestmark = pytest.mark.cluster


def test_smallest_bench_reports_every_run_and_matches_zero3(tmp_path) -> None:
    out = tmp_path / "bench.json"
    hosts = available()[0]
    where = (["--simcluster", "2", "--name", "mlxppt", "--subnet", "10.79.29", "--setups", "equal,slow"] if hosts
             else ["--simcluster", "0", "--ranks", "2", "--setups", "equal"])
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "pipeline", *where, "--preset", "tiny", "--rounds", "1",
                        "--rates", "1gbit", "--steps", "4", "--skip", "1", "--seq-len", "16", "--global-batch", "8",
                        "--json", str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    res = json.loads(out.read_text())
    # The model does not fit one rank's budget; the pipeline runs 8 micro-batches of one sample.
    assert res["budget_bytes"] < res["whole_model_bytes"] == 16 * res["n_params"]
    assert res["micro_batches"] == 8 and math.isclose(res["schedule_bubble"], 1 / 9)
    rows = {(x["setup"], x["contender"]): x for x in res["runs"]}
    want = {("equal", "pipeline"), ("equal", "zero3")}
    if hosts:
        want |= {("slow", "pipeline"), ("slow", "pipeline-equal"), ("slow", "zero3")}
    assert set(rows) == want
    for x in rows.values():
        assert x["step_s"] > 0 and x["samples_per_s"] > 0 and 0 <= x["idle"] < 1
        assert len(x["losses"]) == 4 and all(math.isfinite(v) for v in x["losses"])
        if x["contender"] != "zero3":
            assert -0.05 < x["bubble"] < 1
            # same samples, other micro-batching and other sums: fp32 rounding only
            assert x["loss_vs_base"] < 1e-4, x["loss_vs_base"]
            assert x["losses"][-1] < x["losses"][0]
    # 4 blocks between an embedding and a head that cost little: 2 + 2 of them, or 1 + 3 as the
    # timings at start tip a near tie (the last rank, recomputing nothing, takes a third more).
    equal = re.match(r"by memory budget and measured stage costs: rank 0 ([23]) stages",
                     rows[("equal", "pipeline")]["cut"])
    assert equal, rows[("equal", "pipeline")]["cut"]
    if hosts:
        assert rows[("slow", "pipeline-equal")]["cut"].startswith("by dist.pipeline_cut: rank 0 3 "
                                                                  "stages (0-2), rank 1 3 stages")
        speed = rows[("slow", "pipeline")]["cut"]
        slow = re.match(r"by memory budget and speed \(1, 0\.5\) and measured stage costs: rank 0 (\d) stages", speed)
        assert slow and int(slow.group(1)) >= int(equal.group(1)), (speed, rows[("equal", "pipeline")]["cut"])
        solo = res["solo_samples_per_s"][0]
        # Both hosts' solo rates, measured at once; which is the slower depends on what else the box
        # runs (the suite's other worker can take the full-speed host's core): not asserted.
        assert len(solo) == 2 and min(solo) > 0
        # The ratios to the ideals are what the solo rates make of the run's rate; their size depends on
        # what else the box runs (seen 2.37 in CI, where a quota'd solo host is slowed more than its share).
        x = rows[("slow", "pipeline")]
        assert math.isclose(x["of_ideal"], x["samples_per_s"] / sum(solo), rel_tol=1e-9)
        assert math.isclose(x["of_nominal_ideal"], x["samples_per_s"] / (solo[0] * (1 + res["cpu"]["slow"] / res["cpu"]["fast"])),
                            rel_tol=1e-9)
    assert "bench pipeline:" in r.stdout and "x ZeRO-3's" in r.stdout
    assert ("of the ideal" in r.stdout) == hosts


def test_the_lora_row_holds_a_pipelined_base_against_data_parallel(tmp_path) -> None:
    """`--setups lora` on 2 ranks of this host, a tiny pretrained Llama as the base: the pipeline
    and data parallel train the same adapters on the same samples, the pipeline's ranks each
    hold part of the base, and the report says so."""
    base = make_llama(tmp_path / "base")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "pipeline", "--simcluster", "0", "--ranks", "2",
                        "--setups", "lora", "--lora-model", str(base), "--lora-seq-len", "16", "--lora-batch", "4",
                        "--lora-micro", "1", "--rounds", "1", "--rates", "1gbit", "--steps", "3", "--skip", "1",
                        "--json", str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rows = {x["contender"]: x for x in json.loads(out.read_text())["runs"]}
    assert set(rows) == {"pipeline", "ddp"} and rows["pipeline"]["baseline"] == "ddp"
    assert rows["pipeline"]["loss_vs_base"] < 1e-5, rows["pipeline"]["loss_vs_base"]
    # Speeds are measured at start, as in a user's run: on a busy box the cut may follow them.
    assert re.match(r"by memory budget(?: and speed \([\d., ]+\))? and measured stage costs: rank 0 \d stages \(0-",
                    rows["pipeline"]["cut"]), rows["pipeline"]["cut"]
    assert rows["pipeline"]["step_vs_base"] > 0
    assert "1gbit LoRA: pipeline step" in r.stdout and "data parallel's" in r.stdout
