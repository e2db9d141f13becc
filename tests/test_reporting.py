"""One event, three sinks: what `Reporter.emit` writes to the JSONL log, the Prometheus
registry and the log line."""

import json

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mlxdist.telemetry.events import EventLog, Progress
from mlxdist.telemetry.metrics import Metrics
from mlxdist.telemetry.reporter import Log, Reporter


def _reporter(tmp_path, rank=0):
    progress = Progress(10, enabled=False)
    metrics = Metrics(rank, "hostA")
    return Reporter(Log(rank, f"rank {rank} (hostA)", tmp_path), EventLog(tmp_path, rank, "hostA"), metrics,
                    progress), metrics


def _samples(metrics, name):
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    return fams[name].samples


def test_a_decision_becomes_event_metric_and_line(tmp_path, capfd):
    report, metrics = _reporter(tmp_path)
    report.emit("balance", "balance: step 5: shares [16, 16] -> [20, 12]", step=5, old=[16, 16], new=[20, 12])
    report.emit("rollback", "rollback: back to step 3", step=6, lr_scale=0.5)
    report.close()
    events = [json.loads(x) for x in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"], e["rank"], e["host"]) for e in events] == [("balance", 5, 0, "hostA"),
                                                                             ("rollback", 6, 0, "hostA")]
    decisions = {(s.labels["controller"], s.labels["action"]): s.value
                 for s in _samples(metrics, "mlxdist_controller_decisions") if s.name.endswith("_total")}
    assert decisions == {("balancer", "resplit"): 1.0}
    assert [s.value for s in _samples(metrics, "mlxdist_rollbacks") if s.name.endswith("_total")] == [1.0]
    err = capfd.readouterr().err
    assert "shares [16, 16] -> [20, 12]" in err and "back to step 3" in err


def test_other_ranks_write_their_lines_to_a_file(tmp_path, capfd):
    report, _ = _reporter(tmp_path, rank=1)
    report.emit("oom", "oom: step 2: micro-batch 8 -> 4", step=2, old=8, new=4)
    report.close()
    assert capfd.readouterr().err == ""
    assert "[rank 1 (hostA)] oom: step 2: micro-batch 8 -> 4" in (tmp_path / "logs" / "rank1.log").read_text()


def test_a_step_event_sets_the_step_series(tmp_path):
    report, metrics = _reporter(tmp_path)
    fields = dict(step=1, loss=2.5, lr=1e-3, grad_norm=0.7, tokens_per_s=100.0, step_s=0.2, sync_s=0.01,
                  sync_bytes=4096, data_wait_s=0.0, micro_batch=8, accum=2, samples=16, tokens=512,
                  memory_active_bytes=1, memory_peak_bytes=2, memory_limit_bytes=3)
    report.emit("step", **fields)
    report.close()
    assert [s.value for s in _samples(metrics, "mlxdist_loss")] == [2.5]
    assert [s.value for s in _samples(metrics, "mlxdist_tokens") if s.name.endswith("_total")] == [512.0]
    assert [s.value for s in _samples(metrics, "mlxdist_sync_bytes") if s.name.endswith("_total")] == [4096.0]


def test_a_task_step_is_counted_in_its_unit_and_an_empty_step_is_counted(tmp_path):
    report, metrics = _reporter(tmp_path)
    fields = dict(step=1, loss=2.5, lr=1e-3, grad_norm=0.7, step_s=0.2, sync_s=0.01, sync_bytes=0, data_wait_s=0.0,
                  micro_batch=8, accum=1, samples=8, memory_active_bytes=1, memory_peak_bytes=2, memory_limit_bytes=3,
                  unit="frames", units=93, units_per_s=465.0, cluster_units_per_s=930.0)
    report.emit("step", **fields)
    report.emit("empty_step", "step 1: the task's count was 0 on every rank; update skipped", step=1)
    report.close()
    units = {(s.labels["unit"], s.name): s.value for s in _samples(metrics, "mlxdist_units")}
    assert units == {("frames", "mlxdist_units_total"): 93.0}
    assert [s.value for s in _samples(metrics, "mlxdist_units_per_second")] == [465.0]
    assert [s.value for s in _samples(metrics, "mlxdist_tokens") if s.name.endswith("_total")] == [0.0]
    assert [s.value for s in _samples(metrics, "mlxdist_empty_steps") if s.name.endswith("_total")] == [1.0]


def test_an_outer_sync_sets_the_diloco_series(tmp_path):
    report, metrics = _reporter(tmp_path)
    for seconds in (0.5, 0.7):
        report.emit("outer_sync", "diloco: step 50: fragment 1/1 synced", step=50, fragment=0, seconds=seconds,
                    bytes=1000, pseudo_grad_norm=0.25, inner_steps=50, samples=100, total_samples=300)
    report.close()
    assert [s.value for s in _samples(metrics, "mlxdist_outer_syncs") if s.name.endswith("_total")] == [2.0]
    assert [s.value for s in _samples(metrics, "mlxdist_outer_sync_bytes") if s.name.endswith("_total")] == [2000.0]
    assert [s.value for s in _samples(metrics, "mlxdist_outer_sync_seconds") if s.name.endswith("_sum")] == [1.2]
    assert [s.value for s in _samples(metrics, "mlxdist_pseudo_grad_norm")] == [0.25]
    assert [s.value for s in _samples(metrics, "mlxdist_inner_steps")] == [50.0]


def test_a_full_disk_under_the_logs_is_said_once_and_training_goes_on(tmp_path, capfd):
    """/dev/full answers every write with ENOSPC, as a full disk does: the first failed line
    is said naming the file, the rest are counted, and nothing raises into the loop."""
    (tmp_path / "logs").mkdir()
    for name in ("rank0.jsonl", "rank1.jsonl", "rank1.log"):
        (tmp_path / "logs" / name).symlink_to("/dev/full")
    for rank in (0, 1):
        report, _ = _reporter(tmp_path, rank)
        for step in range(5):
            report.emit("rollback", f"rollback: back to step {step}", step=step, lr_scale=0.5)
        report.close()
    err = capfd.readouterr().err.splitlines()
    cannot = [ln for ln in err if "cannot write" in ln]
    assert len(cannot) == 3, err
    assert all("No space left on device" in ln and "training goes on" in ln for ln in cannot)
    assert any("rank 0 (hostA)" in ln and "rank0.jsonl" in ln for ln in cannot)
    assert any("rank1.log" in ln for ln in cannot)
    assert any("5 lines not written to" in ln and "rank0.jsonl" in ln for ln in err)
