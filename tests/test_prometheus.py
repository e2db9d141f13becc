"""Monitoring with a real Prometheus: the alert rules and the generated config pass `promtool`,
each rule fires on synthetic series as its unit test says (and breaking a rule breaks its unit
test), and a real server, started here on a free port with the config `mlxdist.scrape_config`
writes, scrapes both ranks of a 2-host namespace run and fires the host-down alert once a host
is killed.

Needs Debian's `prometheus` package (`apt-get install prometheus`: prometheus and promtool);
skips with that hint without it. The server test also needs root (namespace hosts). Cluster
mlxprom, subnet 10.77.63.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import pytest
import yaml
from helpers import FAST, ROOT, env, mpirun_path, namespace_cluster

from mlxdist.rig.simcluster import SimCluster

RULES = ROOT / "configs" / "prometheus-rules.yml"
RULES_TEST = ROOT / "tests" / "prometheus" / "rules_test.yml"
ALERTS = {"MlxdistHostDown", "MlxdistRankStalled", "MlxdistWeightDriftRepaired",
          "MlxdistRolledBack", "MlxdistRestarted"}
METRICS_PORT = 9460
T = TypeVar("T")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.skip(f"{name} not found: apt-get install prometheus (Debian's package has "
                    "prometheus and promtool), then run pytest tests/test_prometheus.py")
    return path


def promtool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([_tool("promtool"), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def scrape_config(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxdist.scrape_config", *map(str, args)],
                          capture_output=True, text=True, timeout=60, env=env())


def _rules(path: Path = RULES) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


# --- promtool: rules, generated config, rule unit tests ------------------------------------------

def test_rules_pass_promtool_check() -> None:
    r = promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in r.stdout
    assert {rule["alert"] for rule in _rules()} == ALERTS


def test_generated_config_with_rules_passes_promtool_check(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("studio.local slots=2\nmacbook.local\n")
    r = scrape_config("--hostfile", hosts, "--interval", "2s", "--rules", RULES)
    assert r.returncode == 0, r.stderr
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(r.stdout)
    check = promtool("check", "config", cfg)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 1 rule files found" in check.stdout and f"SUCCESS: {len(ALERTS)} rules found" in check.stdout
    parsed = yaml.safe_load(r.stdout)
    assert parsed["rule_files"] == [str(RULES)]
    assert parsed["global"]["evaluation_interval"] == "2s"
    assert parsed["scrape_configs"][0]["static_configs"][0]["targets"] == \
        ["studio.local:9400", "studio.local:9401", "macbook.local:9400"]


def test_scrape_config_without_rules_has_no_rule_section(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("studio slots=1\n")
    r = scrape_config("--hostfile", hosts)
    assert r.returncode == 0 and set(yaml.safe_load(r.stdout)) == {"scrape_configs"}, r.stdout


def test_scrape_config_names_a_missing_rules_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("studio slots=1\n")
    r = scrape_config("--hostfile", hosts, "--rules", tmp_path / "nope.yml")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.count("\n") == 1 and f"--rules {tmp_path / 'nope.yml'}: no such file" in r.stderr


def test_rule_unit_tests_pass() -> None:
    r = promtool("test", "rules", RULES_TEST)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.parametrize("alert", sorted(ALERTS))
def test_breaking_a_rule_fails_its_unit_test(tmp_path: Path, alert: str) -> None:
    """The unit tests really cover every rule: one that never fires makes them fail, by name."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == alert:
                rule["expr"] = 'up{job="no such job"} == 42'
    broken = tmp_path / "rules.yml"
    broken.write_text(yaml.safe_dump(doc))
    tests = yaml.safe_load(RULES_TEST.read_text())
    tests["rule_files"] = [str(broken)]
    test_file = tmp_path / "rules_test.yml"
    test_file.write_text(yaml.safe_dump(tests))
    r = promtool("test", "rules", test_file)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"alertname: {alert}," in r.stdout + r.stderr


def test_rules_ask_only_for_exported_metrics() -> None:
    """A renamed metric would leave its alert silently empty: every name a rule uses is one
    a rank really serves (read from a live registry, not from source text)."""
    import re

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from mlxdist.telemetry.metrics import Metrics

    text = generate_latest(Metrics(0, "studio").registry).decode()
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    used = {n for rule in _rules() for n in re.findall(r"\b(mlxdist_\w+|up)\b", rule["expr"])}
    assert "mlxdist_last_step_timestamp_seconds" in exported
    assert used - exported - {"up"} == set(), used - exported


def test_last_step_timestamp_moves_with_steps() -> None:
    from mlxdist.telemetry.metrics import Metrics

    m = Metrics(1, "macbook")

    def value() -> float:
        got = m.registry.get_sample_value("mlxdist_last_step_timestamp_seconds",
                                          {"rank": "1", "host": "macbook"})
        assert got is not None
        return got

    started = value()
    assert abs(started - time.time()) < 5
    time.sleep(0.05)
    m.record("step", {"tokens": 64, "samples": 2, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0,
                      "tokens_per_s": 100.0, "micro_batch": 2, "accum": 1, "step_s": 0.1, "sync_s": 0.01,
                      "sync_bytes": 10, "data_wait_s": 0.0, "memory_active_bytes": 1,
                      "memory_peak_bytes": 1, "memory_limit_bytes": 1})
    assert value() > started


# --- a real Prometheus server watching a 2-host run ---------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    _tool("prometheus")
    yield from namespace_cluster(tmp_path_factory, 2, "mlxprom", "10.77.63")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# No proxy: the server is on loopback, and an http_proxy in the environment must not see it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}" + (f"?{urlencode(params)}" if params else "")
    with _OPENER.open(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]


@contextlib.contextmanager
def _prometheus(config: Path, workdir: Path) -> Iterator[str]:
    """A Prometheus server of our own (never the system service) on a free loopback port,
    storing in `workdir`; stopped on exit. Yields its base URL."""
    port = _free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen([_tool("prometheus"), f"--config.file={config}",
                             f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), _OPENER.open(f"{base}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start:\n{(workdir / 'prometheus.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class _Watch:
    """A Prometheus server watching a live 2-host run: its HTTP API, and what to print when an
    expectation is not met (targets' health, the run's output)."""

    def __init__(self, api: str, run_log: Path) -> None:
        self.api, self.run_log = api, run_log

    def query(self, expr: str) -> list[dict]:
        return _api(self.api, "query", query=expr)["result"]

    def alerts(self, name: str, state: str | None = None, **labels: str) -> list[dict]:
        return [a for a in _api(self.api, "alerts")["alerts"]
                if a["labels"]["alertname"] == name and state in (None, a["state"])
                and all(a["labels"].get(k) == v for k, v in labels.items())]

    def context(self) -> str:
        targets = [(t["scrapeUrl"], t["health"], t["lastError"])
                   for t in _api(self.api, "targets")["activeTargets"]]
        alerts = [(a["labels"], a["state"]) for a in _api(self.api, "alerts")["alerts"]]
        return f"targets: {targets}\nalerts: {alerts}\nrun:\n{self.run_log.read_text()[-3000:]}"

    def wait(self, what: str, probe: Callable[[], T], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = probe()
            if got:
                return got
            time.sleep(0.5)
        pytest.fail(f"{what} not seen within {timeout:.0f}s\n{self.context()}")


def _test_rules(dst: Path) -> Path:
    """The shipped rules with `for: 2s` and a 3 s stall threshold, so a test sees alerts go
    pending then firing in seconds (the production windows are covered by the unit tests)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
            if rule["alert"] == "MlxdistRankStalled":
                assert "> 300" in rule["expr"], rule["expr"]
                rule["expr"] = rule["expr"].replace("> 300", "> 3")
    dst.write_text(yaml.safe_dump(doc))
    return dst


@contextlib.contextmanager
def _watched_run(cluster: SimCluster, tmp_path: Path, *train_args: str) -> Iterator[_Watch]:
    """Prometheus, configured by `mlxdist.scrape_config` from the cluster's hostfile, scraping
    a long run on both hosts every second; yields once it has both ranks' step counters. The
    run, everything on the hosts and the server are gone afterwards."""
    gen = scrape_config("--hostfile", cluster.hostfile, "--port", str(METRICS_PORT), "--interval", "1s",
                        "--rules", _test_rules(tmp_path / "rules.yml"))
    assert gen.returncode == 0, gen.stderr
    config = tmp_path / "prometheus.yml"
    config.write_text(gen.stdout)
    run_log = tmp_path / "run.log"
    train = [mpirun_path(), *cluster.mpirun_args(), "-np", "2", sys.executable, "-m", "mlxdist.train",
             *FAST, "model.dtype=float32", "train.batch_size=4", "dist.backend=mpi4py",
             "checkpoint.every=0", "train.steps=100000", f"metrics.port={METRICS_PORT}",
             f"train.out_dir={tmp_path / 'run'}", *train_args]
    with _prometheus(config, tmp_path) as api, run_log.open("w") as out:
        watch = _Watch(api, run_log)
        job = subprocess.Popen(train, stdout=out, stderr=subprocess.STDOUT)
        try:
            def both_stepping() -> dict[str, dict] | None:
                found = {s["metric"]["rank"]: s for s in watch.query("mlxdist_steps_total")}
                return found if len(found) == 2 and all(float(s["value"][1]) >= 2 for s in found.values()) else None

            counters = watch.wait("both ranks' mlxdist_steps_total >= 2", both_stepping, 120)
            # Each rank's counter came through its own host's target, with its own labels.
            for rank, host in enumerate(cluster.hosts):
                labels = counters[str(rank)]["metric"]
                assert (labels["host"], labels["instance"], labels["job"]) == \
                    (host, f"{cluster.ip(host)}:{METRICS_PORT}", "mlxdist"), labels
            # Both answer now: the start-up's host-down alerts (endpoints not up yet) resolve, so an
            # alert seen later comes from what the test does next.
            watch.wait("no MlxdistHostDown while both ranks answer",
                       lambda: not watch.alerts("MlxdistHostDown"), 15)
            assert not watch.alerts("MlxdistRankStalled", "firing"), watch.context()
            yield watch
        finally:
            job.kill()
            job.wait()
            for h in cluster.hosts:
                cluster.kill(h)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.netns
def test_prometheus_scrapes_both_ranks_and_alerts_on_a_killed_host(cluster: SimCluster, tmp_path: Path) -> None:
    with _watched_run(cluster, tmp_path, "dist.stall_timeout_s=10") as watch:
        lost = f"{cluster.ip(2)}:{METRICS_PORT}"
        assert cluster.kill(2) >= 1
        (alert,) = watch.wait(f"MlxdistHostDown firing for {lost}",
                              lambda: watch.alerts("MlxdistHostDown", "firing", instance=lost), 60)
        assert alert["labels"]["severity"] == "critical"
        assert f"{lost} is gone from the scrape" in alert["annotations"]["summary"]


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.netns
def test_stalled_rank_alert_fires_for_the_rank_left_waiting(cluster: SimCluster, tmp_path: Path) -> None:
    """A host that sleeps (SIGSTOP on all it runs): the rank on the other host still answers
    scrapes but waits in the all-reduce, so it is the one reported stalled; the sleeper is
    gone from the scrape. The stall timeout is long so nothing aborts meanwhile."""
    with _watched_run(cluster, tmp_path, "dist.stall_timeout_s=120") as watch:
        assert cluster.kill(2, signal.SIGSTOP) >= 1
        (stalled,) = watch.wait("MlxdistRankStalled firing for rank 0",
                                lambda: watch.alerts("MlxdistRankStalled", "firing"), 60)
        assert (stalled["labels"]["rank"], stalled["labels"]["host"]) == ("0", cluster.hosts[0])
        assert float(stalled["value"]) > 3
        asleep = f"{cluster.ip(2)}:{METRICS_PORT}"
        watch.wait(f"MlxdistHostDown firing for {asleep}",
                   lambda: watch.alerts("MlxdistHostDown", "firing", instance=asleep), 30)
        # Still one stalled rank: the sleeper's series went stale with its endpoint.
        assert [a["labels"]["rank"] for a in watch.alerts("MlxdistRankStalled")] == ["0"]
