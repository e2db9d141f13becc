"""Time-boxed DiLoCo (`dist.sync_every_s`): a round is a number of the cluster's steps; a
slower rank trains on fewer of them (spread evenly) and sits the rest out, so every rank
reaches the outer sync at the same time with as many inner steps as its speed allowed.

The arithmetic is checked against the hand-written reference of test_diloco.py (a rank's
inner steps per round may differ, even be 0); the plan, its state and the loop on real
mpirun ranks, one slowed 2x with the rig's compute scale (MLXDIST_RIG_COMPUTE_SCALE, set
per rank), are checked here.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from functools import partial
from pathlib import Path

import helpers
import numpy as np
import pytest
from helpers import FAST, assert_same_weights, final_weights
from test_diloco import SHAPES, Cluster, RankState, inner_step, make_dl, on_threads, reference

from mlxdist.config import ConfigError, load_config
from mlxdist.sync.fragments import RoundPlan, TimeBox, plan_round, works
from mlxdist.telemetry.metrics import Metrics

# ---- which steps a rank trains on, and the plan ----

@pytest.mark.parametrize("inner,steps", [(7, 7), (5, 12), (1, 9), (0, 6), (11, 12)])
def test_working_steps_are_spread_evenly_and_end_the_round(inner, steps):
    done = np.cumsum([works(i, inner, steps) for i in range(steps)])
    assert done[-1] == inner
    # After any step a rank has done its share of the round so far, give or take one step:
    # a collective mid-round (an evaluation, a checkpoint) finds the ranks together.
    assert all(abs(d - (i + 1) * inner / steps) < 1 for i, d in enumerate(done))
    assert inner == 0 or works(steps - 1, inner, steps)


def test_plan_gives_each_rank_the_steps_it_fits_in_the_box():
    first = RoundPlan(4, [4, 4, 4])
    # Paces 0.1 / 0.2 / 3 s per inner step, 2 s box: the fastest trains on every step.
    plan = plan_round([0.1, 0.2, 3.0], [0.0, 0.0, 0.0], 2.0, min_steps=1, previous=first)
    assert plan == RoundPlan(20, [20, 10, 0])  # a rank slower than the box does none (it still syncs)
    # Steps sat out cost time too: 8 x 0.2 + 12 x 0.02 = 1.84 s fits, 9 x 0.2 + 11 x 0.02 does not.
    assert plan_round([0.1, 0.2], [0.0, 0.02], 2.0, min_steps=1, previous=first).inner == [20, 8]
    # A rank never measured keeps its count; a box smaller than a step still has min_steps.
    assert plan_round([0.1, 0.0], [0.0, 0.0], 2.0, min_steps=1, previous=RoundPlan(4, [4, 3])).inner == [20, 3]
    assert plan_round([5.0, 9.0], [0.0, 0.0], 2.0, min_steps=3, previous=first) == RoundPlan(3, [0, 0])


def _report(pace: float, inner: int) -> dict:
    return {"pace": pace, "idle": 0.0, "arrived": 0.0, "samples": 2 * inner, "inner": inner, "seconds": 1.0}


def test_time_box_state_replays_the_plan_and_refuses_another_cluster_size():
    box = TimeBox(2.0, rank=1, size=2, first_steps=4, min_steps=1)
    assert box.plan == RoundPlan(4, [4, 4]) and all(box.works(i) for i in range(4))
    done, nxt = box.close([_report(0.1, 4), _report(0.2, 4)], step=4, steps=4)
    assert done == RoundPlan(4, [4, 4]) and nxt == RoundPlan(20, [20, 10]) and box.rounds == 1
    state = box.state_dict()
    again = TimeBox(2.0, rank=1, size=2, first_steps=4, min_steps=1)
    assert again.load_state_dict(state, steps=4)
    assert again.plan == nxt and again.pace == [0.1, 0.2] and again.rounds == 1
    assert [list(h) for h in again.history] == [[4, 4, 4, 4]]
    assert [again.works(i) for i in range(4)] == [False, True, False, True]
    fewer = TimeBox(2.0, rank=0, size=1, first_steps=4, min_steps=1)
    assert not fewer.load_state_dict(state, steps=20) and fewer.plan == RoundPlan(20, [20])


def test_round_event_counts_this_ranks_inner_steps():
    m = Metrics(1, "Johns-MacBook-Pro.local")
    m.record("diloco_round", {"inner_steps": [20, 9]})
    m.record("diloco_round", {"inner_steps": [18, 8]})
    assert m.inner_steps_total._value.get() == 17


def test_config_takes_the_time_box_with_diloco_only():
    cfg = load_config(None, ["dist.mode=diloco", "dist.sync_every_s=30"])
    assert cfg.dist.sync_every_s == 30.0
    for bad, word in ((["dist.sync_every_s=30"], "dist.mode=diloco"),
                      (["dist.mode=diloco", "dist.sync_every_s=30", "control.balance=true"], "control.balance"),
                      (["dist.mode=diloco", "dist.sync_every_s=0.01"], "dist.sync_every_s")):
        with pytest.raises(ConfigError, match=word) as e:
            load_config(None, bad)
        assert "dist.sync_every_s" in str(e.value) and "\n" not in str(e.value)


# ---- the arithmetic: unequal inner steps per round, one rank with none ----

def run_timeboxed(batches: list[int], plans: list[RoundPlan]) -> list[RankState]:
    """Thread-ranks stepping the cluster's steps of each round, training only on their own."""
    cluster = Cluster(len(batches))
    states = [RankState(make_dl("float32", 1, plans[0].steps)) for _ in batches]

    def body(r: int) -> None:
        s = states[r]
        ar, ag = partial(cluster.allreduce_sum, r), partial(cluster.allgather, r)
        for plan in plans:
            s.dl.set_period(plan.steps)
            for i in range(plan.steps):
                trained = works(i, plan.inner[r], plan.steps)
                if trained:
                    s.local = inner_step(r, s.t, batches[r], s.local, s.adam)
                    s.t += 1
                for k in s.dl.advance(batches[r] if trained else 0, int(trained)):
                    new = s.dl.outer_step(k, s.local, ar, ag)
                    s.stats.append(s.dl.last)
                    s.local = list(new)

    on_threads(len(batches), cluster, body)
    return states


def test_unequal_and_zero_inner_steps_equal_the_reference():
    batches = [4, 2, 3]
    plans = [RoundPlan(5, [5, 5, 5]), RoundPlan(9, [9, 3, 6]), RoundPlan(8, [8, 0, 5]), RoundPlan(7, [7, 2, 0])]
    states = run_timeboxed(batches, plans)
    anchors, _, local, _, steps = reference(batches, [p.inner for p in plans], 1, len(plans))
    assert [s.t for s in states] == steps == [sum(p.inner[r] for p in plans) for r in range(3)]
    for s in states[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(states[0].dl.anchors, s.dl.anchors, strict=True))
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(states[0].dl.anchors[i], anchors[i].reshape(-1), rtol=1e-5, atol=1e-5)
        for r, s in enumerate(states):
            np.testing.assert_allclose(s.local[i], local[r][i], rtol=1e-5, atol=1e-5)
    # Each sync says how many inner steps and samples this rank brought; a rank with none
    # still took part (its samples weigh 0).
    assert [st.inner_steps for st in states[1].stats] == [5, 3, 0, 2]
    assert [st.samples for st in states[1].stats] == [10, 6, 0, 4]
    assert [st.total_samples for st in states[0].stats] == [45, 60, 47, 32]


# ---- real ranks, one slowed 2x by the rig ----

BOX_COMMON = [*FAST, "data.seq_len=32", "train.batch_size=2", "dist.mode=diloco",
              "dist.outer_wire=float32", "train.schedule=constant", "train.warmup_steps=0", "train.lr=2e-3",
              "checkpoint.keep_last=10", "train.log_every=1000"]
# Every rank's compute is stretched (4x and 8x): the sleeps dominate its step, so the 2x
# between them is what the box sees, whatever else runs on this machine's few cores.
SCALES = "4,8"
def run_slowed(args: list[str], scales: str = SCALES) -> subprocess.CompletedProcess:
    return helpers.run_slowed(args, scales)


def _events(run_dir: Path, kind: str, rank: int = 0) -> list[dict]:
    lines = (run_dir / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.mark.cluster
def test_fast_rank_does_twice_the_inner_steps_and_nobody_waits(tmp_path):
    box = 3.0  # long enough that a burst of load on this shared machine is a fraction of it
    r = run_slowed([*BOX_COMMON, "dist.inner_steps=6", f"dist.sync_every_s={box}", "train.steps=120",
                    "checkpoint.every=0", f"train.out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "time box 3s per round" in r.stderr and "computes x8 slower" in (tmp_path / "logs" / "rank1.log").read_text()
    rounds = _events(tmp_path, "diloco_round")
    assert [e["inner_steps"] for e in _events(tmp_path, "diloco_round", 1)] == [e["inner_steps"] for e in rounds]
    first, full = rounds[0], [e for e in rounds[1:] if e["inner_steps"] == e["planned"]]  # not cut by train.steps
    assert first["inner_steps"] == [6, 6]  # the first round trains every rank on every step, to time them
    assert len(full) >= 2, [e["inner_steps"] for e in rounds]
    # The mechanism, not this machine's speed: each round's plan is the one the paces
    # measured in the round before call for, and the slowed rank trains on fewer steps.
    for before, e in zip(rounds, rounds[1:], strict=False):
        expected = plan_round(before["pace_s"], before["idle_s"], box, min_steps=1,
                              previous=RoundPlan(before["round_steps"], before["planned"]))
        assert e["planned"] == expected.inner, (before, e)
        assert e["round_steps"] == expected.steps or e is rounds[-1], (before, e)
        assert before["pace_s"][1] > before["pace_s"][0] > 0, before
    fast, slow = sum(e["inner_steps"][0] for e in full), sum(e["inner_steps"][1] for e in full)
    assert fast > slow, [e["inner_steps"] for e in rounds]
    # The faster rank trained on every step of a round; the step events are the inner steps.
    for e in full:
        assert max(e["inner_steps"]) == e["round_steps"]
    steps = [len(_events(tmp_path, "step", rank)) for rank in (0, 1)]
    assert steps == [sum(e["inner_steps"][rank] for e in rounds) for rank in (0, 1)]
    # Timed rounds end together (the waits are a fraction of one slow step) and last about
    # the box (medians: a burst of load from elsewhere on a shared machine can stretch one).
    assert statistics.median(max(e["waited_s"]) for e in full) < 0.5 * box
    assert 0.6 * box < statistics.median(max(e["seconds"]) for e in full) < 1.8 * box, [e["seconds"] for e in full]
    assert len(_events(tmp_path, "outer_sync")) == len(rounds)


@pytest.mark.cluster
def test_resume_mid_round_replays_the_rounds_counts(tmp_path):
    """A checkpoint in the middle of a timed round (step 5 of a run whose first round is 4
    steps and whose second is far longer than the run): resumed, the round trains the same
    ranks on the same steps, not new timings, and ends on the same weights."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    common = [*BOX_COMMON, "dist.inner_steps=4", "dist.sync_every_s=60", "train.steps=12", "checkpoint.every=5"]
    r = run_slowed([*common, f"train.out_dir={whole}"], scales="2,8")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = _events(whole, "diloco_round")[0]
    assert plan["next_round_steps"] == plan["next_inner_steps"][0] > plan["next_inner_steps"][1] > 0, plan
    shutil.copytree(whole, parts)
    shutil.rmtree(parts / "logs")  # the resumed run's own events only
    for later in ("checkpoints/step_00000010", "checkpoints/step_00000012", "rank_state/step_00000010",
                  "rank_state/step_00000012"):
        shutil.rmtree(parts / later)
    # Resumed without any slowdown: were the round timed again, rank 1 would train on every step.
    r = run_slowed([*common, f"train.out_dir={parts}", "--resume", "auto"], scales="1,1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step 5" in r.stderr and "shared outer state only" not in r.stderr
    assert_same_weights(final_weights(parts), final_weights(whole), 1e-6)
    worked = [[e["step"] for e in _events(d, "step", 1) if e["step"] > 5] for d in (whole, parts)]
    assert worked[0] == worked[1] != list(range(6, 13)), worked  # rank 1 trained on the same steps
    from test_diloco_train import _rank_weights

    for rank in range(2):
        assert_same_weights(_rank_weights(parts, 12, rank), _rank_weights(whole, 12, rank), 1e-6)
