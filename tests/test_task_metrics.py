"""A task's metrics beside its loss: summed over the cluster's micro-batches and divided by the
units (or by the task's own count), so 3+5 shows what 8 shows; in the step and eval events, the
progress line, Prometheus and the trackers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_train

HERE = Path(__file__).parent
SPLIT = "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"
COMMON = ["metrics.port=0", "train.warmup_steps=0", "train.schedule=constant", "train.lr=1e-2",
          "dist.sync_weights_every=0", "checkpoint.every=0", "train.eval_every=3", "train.steps=6",
          "train.eval_batches=0"]  # the whole eval set: its windows then do not depend on train.batch_size
TASKS = {"mlx": ["task.factory=user_tasks:mlx_with_metrics"],
         "torch": ["--engine", "torch", "--device", "cpu", "task.factory=user_tasks:torch_with_metrics"]}


def _events(run: Path, kind: str) -> list[dict]:
    lines = (run / "logs" / "rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _train(args, np_=0):
    r = run_train([*COMMON, *args], np_=np_, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.cluster
@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_metrics_of_3_plus_5_equal_8(tmp_path, engine):
    one = _train([*TASKS[engine], "train.batch_size=8", f"train.out_dir={tmp_path / 'one'}"])
    _train([*TASKS[engine], SPLIT, f"train.out_dir={tmp_path / 'two'}"], np_=2)
    for kind, key in (("step", "metrics"), ("eval", "metrics")):
        a, b = _events(tmp_path / "one", kind), _events(tmp_path / "two", kind)
        assert len(a) == len(b) > 0 and a[0][key], a
        for ea, eb in zip(a, b, strict=True):
            assert ea[key].keys() == eb[key].keys()
            for name in ea[key]:
                assert eb[key][name] == pytest.approx(ea[key][name], abs=1e-6), (kind, name)
    names = {"close", "hit"} if engine == "mlx" else {"close"}
    assert set(_events(tmp_path / "one", "step")[0]["metrics"]) == names
    assert all(0 <= v <= 1 for e in _events(tmp_path / "one", "step") for v in e["metrics"].values())
    assert "eval: step 6: loss" in one.stderr and ", close " in one.stderr


def test_metrics_reach_the_progress_line_prometheus_and_trackers():
    import io

    from prometheus_client import generate_latest

    from mlxdist.telemetry.events import Progress, rate_text
    from mlxdist.telemetry.metrics import Metrics
    from mlxdist.telemetry.trackers import ScalarMap

    out = io.StringIO()
    progress = Progress(10, True, every=1, stream=out)
    progress.unit = "puzzles"
    progress.update(1, 0.5, 20.0, metrics={"exact": 0.25})
    assert "loss 0.5000 exact 0.25 | 20.0 puzzles/s" in out.getvalue(), out.getvalue()
    assert rate_text(20.0) == "20.0" and rate_text(512.0) == "512" and rate_text(41_200.0) == "41.2k"
    m = Metrics(0, "studio")
    m.record("eval", {"eval_loss": 1.0, "metrics": {"exact": 0.5}})
    text = generate_latest(m.registry).decode()
    assert 'mlxdist_eval_metric{host="studio",name="exact",rank="0"} 0.5' in text, text
    _, values = ScalarMap()("eval", {"eval_loss": 1.0, "metrics": {"exact": 0.5}})
    assert values["eval/exact"] == 0.5


def test_a_metric_that_is_not_a_scalar_is_one_line(tmp_path):
    r = run_train([*COMMON, *TASKS["mlx"], "task.args={vector_metric: true}", f"train.out_dir={tmp_path}"],
                  cwd=HERE)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "metric 'close' is shape (" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
