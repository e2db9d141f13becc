"""Prometheus metrics for one rank, served at http://HOST:PORT/metrics (port = base + local rank).

Names follow Prometheus conventions: `mlxdist_` prefix, base units (seconds, bytes),
`_total` for counters; every series carries `rank` and `host` labels so one dashboard
can compare a Mac Studio with a MacBook.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from .. import __version__
from ..markers import RestartCounts

# Event kind -> counter attribute, and -> (controller, default action) of a decision.
# DECISIONS is the trackers' too (trackers.py), so Prometheus and W&B/MLflow name a decision alike.
_COUNTERS = {"skipped": "nonfinite", "rollback": "rollbacks", "drift_repair": "drift_repairs",
             "empty_step": "empty_steps"}
DECISIONS: dict[str, tuple[str, str]] = {"oom": ("batch_size", "oom_shrink"), "memory": ("batch_size", "resize"),
                                         "balance": ("balancer", "resplit"), "plateau": ("plateau", "reduce_lr")}

_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, rank: int, host: str):
        self.registry = CollectorRegistry()
        self.labels = {"rank": str(rank), "host": host}
        self.port: int | None = None
        r, lab = self.registry, ["rank", "host"]

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(**self.labels)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(**self.labels)

        def hist(name, doc):
            return Histogram(name, doc, lab, buckets=_TIME_BUCKETS, registry=r).labels(**self.labels)

        self.steps = counter("mlxdist_steps", "Optimizer steps completed")
        self.tokens = counter("mlxdist_tokens", "Tokens this rank trained on")
        self.samples = counter("mlxdist_samples", "Samples this rank trained on")
        self.loss = gauge("mlxdist_loss", "Training loss of the last step (cluster-wide token mean)")
        self.eval_loss = gauge("mlxdist_eval_loss", "Loss on held-out data at the last evaluation")
        self.lr = gauge("mlxdist_learning_rate", "Learning rate of the last step")
        self.grad_norm = gauge("mlxdist_grad_norm", "Global gradient L2 norm before clipping")
        self.tokens_per_second = gauge("mlxdist_tokens_per_second", "This rank's training throughput")
        self.batch_size = gauge("mlxdist_batch_size", "This rank's micro-batch size (samples)")
        self.accumulation = gauge("mlxdist_accumulation_steps", "This rank's micro-batches per step")
        self.share = gauge("mlxdist_step_share_samples", "Samples of each global step this rank processes")
        self.memory_active = gauge("mlxdist_memory_active_bytes", "Memory in use by this rank")
        self.memory_peak = gauge("mlxdist_memory_peak_bytes", "Peak memory of this rank")
        self.memory_limit = gauge("mlxdist_memory_limit_bytes", "Memory limit the controller works against")
        self.optimizer_state = gauge("mlxdist_optimizer_state_bytes",
                                     "AdamW state (m and v, fp32) this rank holds: all of it under data parallel, "
                                     "its shard under dist.shard=optimizer|gradients")
        self.step_seconds = hist("mlxdist_step_seconds", "Wall time of one optimizer step")
        self.sync_seconds = hist("mlxdist_sync_seconds", "Gradient all-reduce time per step")
        self.sync_bytes = counter("mlxdist_sync_bytes", "Gradient bytes this rank sent into all-reduce")
        self.data_wait = counter("mlxdist_data_wait_seconds", "Time the loop waited for data")
        self.checkpoint_seconds = hist("mlxdist_checkpoint_seconds", "Time to write a checkpoint")
        self.nonfinite = counter("mlxdist_nonfinite_steps", "Steps skipped for non-finite loss or grads")
        self.empty_steps = counter("mlxdist_empty_steps", "Steps skipped: the task's count was 0 on every rank")
        self.units = Counter("mlxdist_units", "Units (the task's: tokens, samples, frames) this rank trained on",
                             [*lab, "unit"], registry=r)
        self.units_per_second = Gauge("mlxdist_units_per_second", "This rank's throughput in the task's unit",
                                      [*lab, "unit"], registry=r)
        self.task_metric = Gauge("mlxdist_task_metric", "The task's own metrics of the last step (per unit or count)",
                                 [*lab, "name"], registry=r)
        self.eval_metric = Gauge("mlxdist_eval_metric", "The task's own metrics at the last evaluation",
                                 [*lab, "name"], registry=r)
        self.drift_repairs = counter("mlxdist_drift_repairs", "Weight drift detected and repaired by broadcast")
        self.rollbacks = counter("mlxdist_rollbacks", "Rollbacks to the last checkpoint")
        # Set by launch/mlxrun --elastic in a restarted job's environment; 0 otherwise.
        self.restarts = counter("mlxdist_restarts", "Times launch/mlxrun --elastic restarted this job so far")
        self.lost_steps = counter("mlxdist_lost_steps", "Steps done but lost to failures (redone after restarts)")
        counts = RestartCounts.from_env()
        self.restarts.inc(counts.restarts)
        self.lost_steps.inc(counts.lost_steps)
        self.outer_syncs = counter("mlxdist_outer_syncs", "DiLoCo outer syncs (one per fragment synced)")
        self.outer_sync_seconds = hist("mlxdist_outer_sync_seconds", "DiLoCo outer sync time (exchange of one fragment)")
        self.outer_sync_bytes = counter("mlxdist_outer_sync_bytes", "DiLoCo pseudo-gradient bytes this rank sent")
        self.pseudo_grad_norm = gauge("mlxdist_pseudo_grad_norm", "L2 norm of the last averaged pseudo-gradient")
        self.inner_steps = gauge("mlxdist_inner_steps", "Inner steps this rank ran before its last outer sync")
        self.inner_steps_total = counter("mlxdist_diloco_inner_steps", "DiLoCo inner steps this rank ran, counted per round")
        # A stalled rank still answers scrapes but stops moving this; the stalled-rank alert in
        # configs/prometheus-rules.yml watches `time() - it`. Set at start so a rank stuck
        # before its first step is caught too.
        self.last_step_time = gauge("mlxdist_last_step_timestamp_seconds",
                                    "Unix time this rank last finished a step (its start, before the first)")
        self.last_step_time.set_to_current_time()
        self.decisions = Counter("mlxdist_controller_decisions", "Controller decisions",
                                 [*lab, "controller", "action"], registry=r)
        self.build = Info("mlxdist_build", "Version and run settings", lab, registry=r)
        self.build.labels(**self.labels).info({"version": __version__})

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        """The metric side of an event (see reporting.Reporter): the one place that maps
        event kinds to series."""
        if kind == "step":
            self._observe_step(fields)
        elif kind == "eval":
            self.eval_loss.set(fields["eval_loss"])
            for name, value in (fields.get("metrics") or {}).items():
                self.eval_metric.labels(**self.labels, name=name).set(value)
        elif kind == "shard":  # sync/sharded.py, at every (re)start: this rank's range of the moments
            self.optimizer_state.set(fields["optimizer_bytes_here"])
        elif kind == "checkpoint":
            self.checkpoint_seconds.observe(fields["seconds"])
        elif kind == "outer_sync":
            self._observe_outer(fields)
        elif kind == "diloco_round":  # per-rank counts (time box: they differ), this rank's own here
            self.inner_steps_total.inc(fields["inner_steps"][int(self.labels["rank"])])
            self.last_step_time.set_to_current_time()  # a rank that sat a round out is not stalled
        elif kind in _COUNTERS:
            getattr(self, _COUNTERS[kind]).inc()
        if kind in DECISIONS:
            controller, action = DECISIONS[kind]
            self.decision(controller, fields.get("action", action))

    def _observe_step(self, f: dict[str, Any]) -> None:
        self.steps.inc()
        self.last_step_time.set_to_current_time()
        if "tokens" in f:
            self.tokens.inc(f["tokens"])
            self.tokens_per_second.set(f["tokens_per_s"])
        if "unit" in f:
            self.units.labels(**self.labels, unit=f["unit"]).inc(f["units"])
            self.units_per_second.labels(**self.labels, unit=f["unit"]).set(f["units_per_s"])
        self.samples.inc(f["samples"])
        self.loss.set(f["loss"])
        for name, value in (f.get("metrics") or {}).items():
            self.task_metric.labels(**self.labels, name=name).set(value)
        self.lr.set(f["lr"])
        self.grad_norm.set(f["grad_norm"])
        self.batch_size.set(f["micro_batch"])
        self.accumulation.set(f["accum"])
        self.share.set(f["samples"])
        self.step_seconds.observe(f["step_s"])
        self.sync_seconds.observe(f["sync_s"])
        self.sync_bytes.inc(f["sync_bytes"])
        self.data_wait.inc(f["data_wait_s"])
        self.memory_active.set(f["memory_active_bytes"])
        self.memory_peak.set(f["memory_peak_bytes"])
        self.memory_limit.set(f["memory_limit_bytes"])

    def _observe_outer(self, f: dict[str, Any]) -> None:
        self.outer_syncs.inc()
        self.outer_sync_seconds.observe(f["seconds"])
        self.outer_sync_bytes.inc(f["bytes"])
        self.pseudo_grad_norm.set(f["pseudo_grad_norm"])
        self.inner_steps.set(f["inner_steps"])

    def decision(self, controller: str, action: str) -> None:
        self.decisions.labels(**self.labels, controller=controller, action=action).inc()

    def set_build(self, **info: str) -> None:
        self.build.labels(**self.labels).info({"version": __version__, **info})

    def serve(self, port: int, bind: str) -> str | None:
        """Start the scrape endpoint; returns a warning instead of crashing if the port is taken."""
        if port == 0:
            return None
        try:
            start_http_server(port, addr=bind, registry=self.registry)
        except OSError as e:
            return (f"metrics: cannot listen on {bind}:{port} ({e.strerror}); "
                    "set metrics.port to a free base port, or 0 to disable")
        self.port = port
        return None
