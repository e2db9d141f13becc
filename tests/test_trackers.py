"""train.report_to: rank 0's scalars in TensorBoard, W&B (offline) and MLflow (file store),
read back from what each wrote and compared with the JSONL event log."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, env, train_command

from mlxdist.config import ConfigError, load_config
from mlxdist.telemetry.events import EventLog, Progress
from mlxdist.telemetry.metrics import Metrics
from mlxdist.telemetry.reporter import Log, Reporter
from mlxdist.telemetry.trackers import Trackers

STEPS, EVAL_EVERY = 6, 3


def _tracker_env(tmp: Path) -> dict:
    """Offline and inside `tmp`: nothing leaves the machine or lands in the home directory."""
    e = {k: v for k, v in env().items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    return e | {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
                "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short training that reports to all three trackers, shared by the tests below."""
    out = tmp_path_factory.mktemp("tracked")
    args = [*FAST, f"train.steps={STEPS}", f"train.eval_every={EVAL_EVERY}", "checkpoint.every=0",
            f"train.out_dir={out}", "train.report_to=[tensorboard, wandb, mlflow]"]
    r = subprocess.run(train_command(args), capture_output=True, text=True, timeout=300, env=_tracker_env(out))
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in (out / "logs" / "rank0.jsonl").read_text().splitlines()]
    return out, r.stderr, events


def _series(events, kind, key):
    return {e["step"]: e[key] for e in events if e["event"] == kind}


def _tfrecords(path: Path):
    """The records of a TFRecord file (length, its crc, data, its crc); crcs not checked."""
    data, pos = path.read_bytes(), 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        yield data[pos + 12:pos + 12 + n]
        pos += 12 + n + 4


def _tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        from tensorboardX.proto.event_pb2 import Event

        out: dict[str, dict[int, float]] = {}
        for f in sorted(logdir.glob("events.out.tfevents.*")):
            for record in _tfrecords(f):
                ev = Event.FromString(record)
                for v in ev.summary.value:
                    if v.WhichOneof("value") == "simple_value":
                        out.setdefault(v.tag, {})[ev.step] = v.simple_value
                    else:
                        out.setdefault(v.tag, {})
        return out
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()
    return {t: {s.step: s.value for s in acc.Scalars(t)} for t in tags["scalars"]} | {t: {} for t in tags["tensors"]}


def test_tensorboard_has_the_logged_losses_at_their_steps(run):
    out, stderr, events = run
    assert f"tensorboard -> {out / 'tensorboard'}" in stderr
    scalars = _tensorboard_scalars(out / "tensorboard")
    losses = _series(events, "step", "loss")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert scalars["train/loss"] == pytest.approx(losses, rel=1e-6)
    assert scalars["eval/loss"] == pytest.approx(_series(events, "eval", "eval_loss"), rel=1e-6)
    assert sorted(scalars["eval/loss"]) == [EVAL_EVERY, STEPS]
    assert scalars["train/lr"] == pytest.approx(_series(events, "step", "lr"), rel=1e-6)
    for name in ("train/grad_norm", "train/tokens_per_s", "memory/peak_bytes", "checkpoint/seconds"):
        assert name in scalars, sorted(scalars)
    assert any(tag.startswith("config") for tag in scalars)  # the resolved config, as text


def test_mlflow_file_store_has_the_losses_and_the_config(run):
    from mlflow.tracking import MlflowClient

    out, _, events = run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as the trainer set it for its own store
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert history == pytest.approx(_series(events, "step", "loss"), rel=1e-6)
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED"
    assert info.data.params["train.steps"] == str(STEPS) and info.data.params["train.report_to"] == \
        "tensorboard,wandb,mlflow"


def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline `.wandb` file: a LevelDB-style log (7-byte file header,
    32 KiB blocks of records with crc(4) length(2) type(1) headers) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, part, rows = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record.FromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_has_the_losses_against_the_training_step(run):
    out, _, events = run
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((out / "wandb").rglob("*"))
    rows = _wandb_history(files[0])
    logged = {r["train/step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert logged == pytest.approx(_series(events, "step", "loss"), rel=1e-6)


def test_missing_package_stops_before_training_with_one_line(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "tensorboardX.py").write_text("raise ImportError(\"No module named 'tensorboardX'\")\n")
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([str(fake), e["PYTHONPATH"]])
    r = subprocess.run(train_command([*FAST, "train.steps=2", f"train.out_dir={tmp_path / 'run'}",
                                      "train.report_to=tensorboard"]),
                       capture_output=True, text=True, timeout=120, env=e)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "train.report_to: tensorboard needs the tensorboardX package" in errors[0]
    assert "pip install 'mlxdist[tensorboard]'" in errors[0]
    log = tmp_path / "run" / "logs" / "rank0.jsonl"
    assert not log.exists() or '"step"' not in log.read_text()


def test_unknown_tracker_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"train\.report_to: unknown tracker 'comet'; use one or more of "
                                          r"tensorboard, wandb, mlflow"):
        load_config(None, ["train.report_to=tensorboard,comet"])
    assert load_config(None, ["train.report_to=[WandB, mlflow]"]).train.report_to == "wandb,mlflow"
    assert load_config(None, []).train.report_to == "none"


class _Fake:
    name, run_id, where = "fake", None, "memory"

    def __init__(self, fail_on: str | None = None):
        self.rows, self.flushes, self.closed, self.fail_on = [], 0, None, fail_on

    def scalars(self, values, step):
        if self.fail_on in values:
            raise OSError("disk full")
        self.rows.append((step, values))

    def flush(self):
        self.flushes += 1

    def close(self, status):
        self.closed = status


def _reporter(tmp_path, *backends):
    return Reporter(Log(0, "rank 0 (hostA)", tmp_path), EventLog(tmp_path, 0, "hostA"), Metrics(0, "hostA"),
                    Progress(10, enabled=False), Trackers(list(backends)))


def test_events_map_to_scalars_and_decisions_count_up(tmp_path):
    fake = _Fake()
    report = _reporter(tmp_path, fake)
    report.emit("step", step=1, loss=2.5, lr=1e-3, grad_norm=0.7, step_s=0.2, sync_s=0.0, sync_bytes=0,
                data_wait_s=0.0, micro_batch=8, accum=2, samples=16, shares=[10, 6], micro=[8, 4], unit="samples",
                units=16, units_per_s=80.0, cluster_units_per_s=160.0, memory_active_bytes=1,
                memory_peak_bytes=2, memory_limit_bytes=3)
    report.emit("balance", "balance", step=5, old=[8, 8], new=[10, 6])
    report.emit("balance", "balance", step=10, old=[10, 6], new=[11, 5])
    report.emit("rollback", "rollback", step=8, lr_scale=0.5)
    report.emit("checkpoint", "checkpoint", step=8, path="x", seconds=0.25)
    report.emit("end", step=12, reason="early stopping")
    report.close()
    rows = dict(fake.rows[:1])
    assert rows[1]["train/loss"] == 2.5 and rows[1]["train/samples_per_s"] == 160.0
    assert rows[1]["cluster/share/rank1"] == 6 and rows[1]["cluster/micro_batch/rank1"] == 4
    assert (10, {"control/balancer/resplit": 2.0}) in fake.rows
    assert (8, {"train/lr_scale": 0.5, "health/rollbacks": 1.0}) in fake.rows
    assert (12, {"control/early_stop": 1.0}) in fake.rows
    assert fake.flushes == 1 and fake.closed == "completed"


def test_a_failing_tracker_is_dropped_and_training_goes_on(tmp_path, capfd):
    bad, good = _Fake(fail_on="eval/loss"), _Fake()
    report = _reporter(tmp_path, bad, good)
    report.emit("eval", "eval", step=3, eval_loss=1.5)
    report.emit("eval", "eval", step=6, eval_loss=1.25)
    report.emit("end", step=6, reason="signal")
    report.close()
    assert bad.closed == "failed" and good.closed == "stopped"
    assert [s for s, _ in good.rows] == [3, 6]
    assert "report_to: fake failed (OSError: disk full); training goes on without it" in capfd.readouterr().err


def test_a_crashed_run_still_flushes_tensorboard_at_exit(tmp_path):
    """No `end` event and no Reporter.close: the interpreter's exit closes the writer."""
    code = ("import sys; from pathlib import Path; from mlxdist.telemetry.trackers import Trackers, TensorBoard\n"
            f"t = Trackers([TensorBoard(Path({str(tmp_path)!r}), {{'train': {{'steps': 3}}}})])\n"
            "t.record('step', {'step': 1, 'loss': 4.5})\n"
            "raise RuntimeError('boom')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env())
    assert r.returncode == 1 and "boom" in r.stderr
    assert _tensorboard_scalars(tmp_path / "tensorboard")["train/loss"] == {1: 4.5}
