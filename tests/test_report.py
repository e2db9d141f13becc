"""Observability tooling end to end: the report CLI on a real run's logs, the Prometheus
scrape config from a hostfile, and a Grafana dashboard that only asks for metrics that exist.

The report is run on logs the real trainer wrote (not a hand-made fixture) so a renamed
event field breaks this test rather than a user's post-mortem.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, env, run_train

from mlxdist.launch.hosts import read_hostfile

STEPS = 40
PLOTS = ("loss.png", "throughput.png", "shares.png", "timing.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report(*args: str, cli: bool = False) -> subprocess.CompletedProcess:
    """`python -m mlxdist.report ARGS`: the real command line when `cli`, else its `main` in this
    process (the same code, without a fresh interpreter's numpy/matplotlib imports per call)."""
    argv = list(map(str, args))
    if cli:
        return subprocess.run([sys.executable, "-m", "mlxdist.report", *argv], capture_output=True, text=True,
                              timeout=120, env=env())
    from mlxdist.commands.report import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    r = run_train(["data.source=synthetic", "data.seq_len=32", "model.preset=tiny", "metrics.port=0",
                   "train.progress=false", f"train.steps={STEPS}", "train.eval_every=10",
                   f"train.out_dir={out}"])
    assert r.returncode == 0, r.stderr
    return out


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.is_file() and path.stat().st_size > 0, path
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, (path, img.shape)


def test_report_on_real_run(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    r = report(run_dir, "--out", out, cli=True)  # the real command line, once
    assert r.returncode == 0, r.stderr
    for name in PLOTS:
        assert_png(out / name)
    assert_png(out / "memory.png")  # step events carry memory_active/peak_bytes
    summary = (out / "summary.md").read_text()
    assert f"steps: {STEPS}" in summary
    assert "eval loss: final" in summary and "checkpoints: 1" in summary
    assert summary in r.stdout  # printed as well as written


def test_report_default_out_dir(run_dir):
    pytest.importorskip("matplotlib")
    r = report(run_dir)
    assert r.returncode == 0, r.stderr
    assert (run_dir / "report" / "summary.md").is_file()
    assert_png(run_dir / "report" / "loss.png")


def test_report_without_matplotlib_still_writes_summary(run_dir, tmp_path):
    out = tmp_path / "rep"
    # sys.modules[name] = None makes `import matplotlib` raise ImportError, as on a bare node.
    code = ("import sys; sys.modules['matplotlib'] = None; from mlxdist.report import main; "
            f"sys.exit(main([{str(run_dir)!r}, '--out', {str(out)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env())
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "pip install matplotlib" in err[0], r.stderr
    assert f"steps: {STEPS}" in (out / "summary.md").read_text()
    assert not list(out.glob("*.png"))


def test_report_errors_on_dir_without_logs(tmp_path):
    r = report(tmp_path)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "no event logs" in r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.jsonl").write_text("")
    r = report(tmp_path)
    assert r.returncode == 2 and "empty" in r.stderr and "Traceback" not in r.stderr


def _step(rank: int, step: int, shares: list[int], **extra) -> dict:
    return {"event": "step", "time": 1.0 + step, "rank": rank, "host": f"h{rank}", "step": step,
            "loss": 3.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0 + rank,
            "cluster_tokens_per_s": 201.0, "step_s": 0.5, "compute_s": 0.3, "sync_s": 0.1,
            "data_wait_s": 0.05, "shares": shares, "micro": shares, "skipped": step == 3, **extra}


def test_report_memory_plot_counts_and_torn_lines(tmp_path):
    """Memory fields, a rollback's repeated step, and a half-written last line (killed rank)."""
    pytest.importorskip("matplotlib")
    logs = tmp_path / "logs"
    logs.mkdir()
    mem = {"memory_active_bytes": 2**30, "memory_peak_bytes": 3 * 2**30}
    for rank in (0, 1):
        ev = [_step(rank, s, [8, 8] if s < 3 else [10, 6], **mem) for s in range(1, 6)]
        ev += [{"event": "balance", "rank": rank, "host": f"h{rank}", "step": 2, "old": [8, 8], "new": [10, 6]},
               {"event": "rollback", "rank": rank, "host": f"h{rank}", "step": 3, "lr_scale": 0.5},
               _step(rank, 4, [10, 6], **mem),
               {"event": "drift_repair", "rank": rank, "host": f"h{rank}", "step": 4, "ranks": [1]}]
        text = "\n".join(json.dumps(e) for e in ev) + '\n{"event": "step", "ste'
        (logs / f"rank{rank}.jsonl").write_text(text)
    r = report(tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "report"
    for name in (*PLOTS, "memory.png"):
        assert_png(out / name)
    s = (out / "summary.md").read_text()
    assert "steps: 5" in s and "no end event" in s
    assert "skipped steps (non-finite): 1" in s
    assert "drift repairs: 1; rollbacks: 1; balance changes: 1; checkpoints: 0" in s
    assert "unreadable log lines ignored: 2" in s
    assert "3.00 GiB" in s and "20.0%" in s  # peak memory; sync 0.1 s of a 0.5 s step


# --- scrape config ---------------------------------------------------------------------------

def scrape_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxdist.scrape_config", *map(str, args)],
                          capture_output=True, text=True, timeout=60, env=env())


def test_scrape_config_one_target_per_slot(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# cluster\nstudio.local slots=2\nmacbook.local   # one rank\nmini slots=3\n")
    r = scrape_config("--hostfile", hosts, "--port", "9500")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "mlxdist"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert len(targets) == 2 + 1 + 3
    assert targets == ["studio.local:9500", "studio.local:9501", "macbook.local:9500",
                       "mini:9500", "mini:9501", "mini:9502"]


def test_scrape_config_default_port_and_shipped_hostfiles():
    for path in sorted((ROOT / "hostfiles").glob("*.hosts")):
        r = scrape_config("--hostfile", path)
        assert r.returncode == 0, r.stderr
        targets = yaml.safe_load(r.stdout)["scrape_configs"][0]["static_configs"][0]["targets"]
        assert len(targets) == sum(h.slots for h in read_hostfile(path))
        assert all(t.endswith((":9400", ":9401")) for t in targets)


def test_scrape_config_bad_hostfile(tmp_path):
    r = scrape_config("--hostfile", tmp_path / "missing")
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad"
    bad.write_text("host cpus=2\n")
    r = scrape_config("--hostfile", bad)
    assert r.returncode == 2 and "slots=N" in r.stderr


# --- Grafana dashboard -----------------------------------------------------------------------

def _defined_metrics() -> set[str]:
    """Names as exposed: prometheus_client appends _total to counters and _info to Info."""
    src = (ROOT / "mlxdist" / "telemetry" / "metrics.py").read_text()
    names: set[str] = set()
    for kind, name in re.findall(r'(Counter|Info|counter|gauge|hist|Gauge|Histogram)\(\s*"(mlxdist_\w+)"', src):
        if kind.lower() == "counter":
            names |= {f"{name}_total", f"{name}_created"}
        elif kind == "Info":
            names.add(f"{name}_info")
        elif kind.lower() in ("hist", "histogram"):
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
        else:
            names.add(name)
    return names


def _exprs(node) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "query", "definition") and isinstance(v, str)]
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_dashboard_uses_only_real_metrics():
    dash = json.loads((ROOT / "configs" / "grafana-dashboard.json").read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    defined = _defined_metrics()
    assert {"mlxdist_loss", "mlxdist_steps_total", "mlxdist_step_seconds_bucket"} <= defined  # the regex works
    used = {m for e in _exprs(dash) for m in re.findall(r"\bmlxdist_\w+", e)}
    assert used, "dashboard has no queries"
    assert used <= defined, f"unknown metrics: {sorted(used - defined)}"
    for name in ("mlxdist_loss", "mlxdist_tokens_per_second", "mlxdist_steps_total", "mlxdist_step_seconds_bucket",
                 "mlxdist_sync_seconds_bucket", "mlxdist_step_share_samples", "mlxdist_batch_size",
                 "mlxdist_memory_active_bytes", "mlxdist_nonfinite_steps_total", "mlxdist_drift_repairs_total"):
        assert name in used, name
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            if p["type"] == "timeseries":
                assert "{{host}} rank {{rank}}" in t["legendFormat"], (p["title"], t)
