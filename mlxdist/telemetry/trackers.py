"""Experiment trackers beside Prometheus (`train.report_to`): TensorBoard, Weights & Biases, MLflow.

Rank 0 only: the loss, eval loss and learning rate are the cluster's (the same on every
rank) and rank 0 hears every cluster-wide decision; per-rank views are Prometheus' job.
The scalars come from the events `Reporter.emit` already records, through one mapping
(`ScalarMap`), so a tracker cannot show a number the event log does not have, and the
names follow the Prometheus series (`mlxdist_loss` -> `train/loss`). Each tracker is an
optional extra, imported only when asked for.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import yaml

from .. import gate, markers
from ..config import Config, ConfigError, report_to_names
from .metrics import DECISIONS

# Tracker -> (module it imports, pip package). The extras in pyproject.toml carry the tracker's name.
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
# Event kind -> running total, named as the Prometheus counter (mlxdist_nonfinite_steps_total ...).
_COUNTS = {"skipped": "health/nonfinite_steps", "empty_step": "health/empty_steps", "rollback": "health/rollbacks",
           "drift_repair": "health/drift_repairs"}
# Run ids kept in the run dir, so a resumed (or elastically restarted) run goes on with the same tracker run.
_IDS_FILE = "trackers.json"


class Tracker(Protocol):
    """One backend. `scalars` takes one event's values at once, so a backend that stores a
    row (W&B) or a request (MLflow) per call gets one per event, not one per number."""

    name: str
    run_id: str | None
    where: str  # for the start banner: where to look

    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self, status: str) -> None:
        """`status`: completed, stopped (by a signal, resumable) or failed."""


class ScalarMap:
    """Event kind + fields -> tracker scalars at a training step: the trackers' `Metrics.record`.

    Counters are sent as running totals (a chart of rollbacks so far reads better than
    spikes), decisions under `control/CONTROLLER/ACTION` as Prometheus labels them."""

    def __init__(self) -> None:
        self.step = 0
        self.totals: dict[str, int] = {}

    def __call__(self, kind: str, f: dict[str, Any]) -> tuple[int, dict[str, float]]:
        self.step = int(f.get("step", self.step))
        out: dict[str, Any] = {}
        if kind == "step":
            out = self._step(f)
        elif kind == "eval":
            out["eval/loss"] = f["eval_loss"]
            out |= {f"eval/{k}": v for k, v in (f.get("metrics") or {}).items()}
        elif kind == "checkpoint":
            out["checkpoint/seconds"] = f["seconds"]
        elif kind == "outer_sync":
            out = {"diloco/outer_sync_seconds": f["seconds"], "diloco/outer_sync_bytes": f["bytes"],
                   "diloco/pseudo_grad_norm": f["pseudo_grad_norm"], "diloco/inner_steps": f["inner_steps"]}
        elif kind == "rollback":
            out["train/lr_scale"] = f.get("lr_scale")
        elif kind == "plateau":
            out["control/plateau_lr_scale"] = f.get("scale")
        elif kind == "end" and f.get("reason") == "early stopping":
            out["control/early_stop"] = 1
        if kind in _COUNTS:
            out[_COUNTS[kind]] = self._count(_COUNTS[kind])
        if kind in DECISIONS:
            controller, action = DECISIONS[kind]
            name = f"control/{controller}/{f.get('action', action)}"
            out[name] = self._count(name)
        values = {k: _number(v) for k, v in out.items()}
        return self.step, {k: v for k, v in values.items() if v is not None}

    def _count(self, name: str) -> int:
        self.totals[name] = self.totals.get(name, 0) + 1
        return self.totals[name]

    @staticmethod
    def _step(f: dict[str, Any]) -> dict[str, Any]:
        out = {"train/loss": f.get("loss"), "train/lr": f.get("lr"), "train/grad_norm": f.get("grad_norm"),
               "train/global_batch": f.get("global_batch"), "train/micro_batch": f.get("micro_batch"),
               "train/accum": f.get("accum"), "time/step_s": f.get("step_s"), "time/sync_s": f.get("sync_s"),
               "time/data_wait_s": f.get("data_wait_s"), "memory/active_bytes": f.get("memory_active_bytes"),
               "memory/peak_bytes": f.get("memory_peak_bytes"), "memory/limit_bytes": f.get("memory_limit_bytes")}
        # The cluster's rate in the task's unit (what the progress line shows), not rank 0's alone.
        unit = f.get("unit", "tokens")
        out[f"train/{unit}_per_s"] = f.get("cluster_units_per_s", f.get("units_per_s", f.get("tokens_per_s")))
        out |= {f"train/{k}": v for k, v in (f.get("metrics") or {}).items()}  # the task's own
        # Every rank's share and micro-batch: how re-splits and batch-size changes anywhere show on rank 0.
        for key, series in (("shares", "cluster/share"), ("micro", "cluster/micro_batch")):
            if len(f.get(key) or ()) > 1:
                out |= {f"{series}/rank{r}": v for r, v in enumerate(f[key])}
        return out


_OPEN: list[Trackers] = []


def close_open() -> None:
    """Close every open tracker now, as failed: before MPI_Abort, which runs no exit handlers."""
    for trackers in list(_OPEN):
        trackers.close()


class Trackers:
    """The fourth sink of `Reporter.emit`: fans one event out to every tracker.

    A tracker that fails mid-run (a full disk, a dropped W&B connection) is dropped with one
    line; the training it watches goes on. Closed by `Reporter.close`, or at interpreter exit
    after an error (then marked failed), so a crashed run still flushes what it logged."""

    def __init__(self, backends: list[Tracker], warn: Callable[[str], None] | None = None):
        self.backends = list(backends)
        self.warn = warn or markers.write_line
        self.map = ScalarMap()
        self.status = "failed"  # until the `end` event says otherwise
        if self.backends:
            atexit.register(self.close)
            _OPEN.append(self)

    def describe(self) -> str:
        return ", ".join(f"{t.name} -> {t.where}" for t in self.backends)

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        if not self.backends:
            return
        if kind == "end":
            self.status = "stopped" if fields.get("reason") == "signal" else "completed"
        step, values = self.map(kind, fields)
        if values:
            self._each(lambda t: t.scalars(values, step))
        if kind == "checkpoint":  # a run killed later keeps its charts up to its last checkpoint
            self._each(lambda t: t.flush())

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for t in list(self.backends):
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - a tracker must never end the training
                self.backends.remove(t)
                self.warn(f"report_to: {t.name} failed ({type(e).__name__}: {_line(e)}); training goes on without it")
                _quietly(lambda t=t: t.close("failed"))

    def close(self) -> None:
        backends, self.backends = self.backends, []
        atexit.unregister(self.close)
        if self in _OPEN:
            _OPEN.remove(self)
        for t in backends:
            try:
                t.close(self.status)
            except Exception as e:  # noqa: BLE001 - the run's own results are already safe
                self.warn(f"report_to: closing {t.name} failed ({type(e).__name__}: {_line(e)})")


class TensorBoard:
    """Event files under RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`)."""

    name, run_id = "tensorboard", None

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        self.dir = run_dir / "tensorboard"
        self.where = str(self.dir)
        self.writer = _tensorboardx().SummaryWriter(logdir=str(self.dir), flush_secs=30)
        # As text: tensorboardX's add_hparams writes a separate run per call and needs final metrics.
        text = "\n".join("    " + line for line in yaml.safe_dump(config, sort_keys=False).splitlines())
        self.writer.add_text("config", text, 0)

    def scalars(self, values: dict[str, float], step: int) -> None:
        wall = time.time()
        for name, value in values.items():
            self.writer.add_scalar(name, value, step, walltime=wall)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class WandB:
    """A W&B run (WANDB_MODE=offline: files under RUN_DIR/wandb, `wandb sync` later).

    Logged against `train/step`, not W&B's own step: W&B drops rows whose step goes back,
    and a rollback or a resume does go back."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], run_id: str | None):
        import wandb

        self.run_id = run_id or uuid.uuid4().hex[:8]
        # console off: W&B's stdout capture would sit between the ranks and mpirun / launch/mlxrun.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mlxdist"), name=run_dir.resolve().name,
                              dir=os.environ.get("WANDB_DIR") or str(run_dir), config=config, id=self.run_id,
                              resume="allow", settings=wandb.Settings(console=os.environ.get("WANDB_CONSOLE", "off")))
        self.where = str(Path(self.run.dir).parent) if self.run.offline else (self.run.url or self.run.dir)
        self.run.define_metric("train/step")
        self.run.define_metric("*", step_metric="train/step")

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "train/step": step})

    def flush(self) -> None:
        pass  # W&B's own process writes as it goes

    def close(self, status: str) -> None:
        self.run.finish(exit_code=1 if status == "failed" else 0)


class MLflow:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default mlxdist) at
    MLFLOW_TRACKING_URI, default a file store at RUN_DIR/mlruns (no server, no database)."""

    name = "mlflow"
    _STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

    def __init__(self, run_dir: Path, config: dict[str, Any], run_id: str | None):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses file stores unless asked; a database store would need sqlalchemy,
            # which mlflow-skinny leaves out.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "mlxdist")
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        run = _quietly(lambda: client.get_run(run_id)) if run_id else None
        if run is None:
            run = client.create_run(experiment_id, run_name=run_dir.resolve().name)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self.where = f"{uri} (experiment {experiment}, run {self.run_id})"
        # Params cannot change once logged: a resumed run adds only the ones it lacks.
        have = run.data.params
        params = [Param(k, v) for k, v in _flat_params(config).items() if k not in have]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            client.log_batch(self.run_id, params=params[i:i + 100])

    def scalars(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in values.items()])

    def flush(self) -> None:
        pass  # every batch is written when it is logged

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, self._STATUS[status])


_BACKENDS: dict[str, Callable[..., Tracker]] = {
    "tensorboard": lambda run_dir, config, run_id: TensorBoard(run_dir, config),
    "wandb": WandB, "mlflow": MLflow}


def make_trackers(cfg: Config, run_dir: Path, rank: int) -> Trackers:
    """Rank 0's trackers from `train.report_to` (other ranks: none). A missing package is a
    ConfigError naming the tracker and its install line, raised before any tracker opens."""
    names = report_to_names(cfg.train.report_to)
    if rank != 0 or not names:
        return Trackers([])
    for name in names:
        require(name)
    ids = _saved_ids(run_dir) if cfg.checkpoint.resume != "none" else {}
    config, made = cfg.to_dict(), []
    try:
        for name in names:
            try:
                made.append(_BACKENDS[name](run_dir, config, ids.get(name)))
            except Exception as e:
                raise RuntimeError(f"train.report_to: {name} could not start ({type(e).__name__}: {_line(e)}); "
                                   f"fix that or remove {name} from train.report_to") from e
    except BaseException:
        for t in made:
            _quietly(lambda t=t: t.close("failed"))
        raise
    _save_ids(run_dir, {t.name: t.run_id for t in made if t.run_id})
    return Trackers(made)


def start_trackers(cfg: Config, run_dir: Path, world: Any) -> Trackers:
    """`make_trackers` on rank 0, its outcome broadcast: a missing package on rank 0's host
    ends every rank together (exit 2) instead of leaving peers in their next collective.
    Only rank 0 needs the package: a MacBook worker without tensorboardX is fine."""
    if not report_to_names(cfg.train.report_to):
        return Trackers([])
    trackers, problem = Trackers([]), None
    if world.rank == 0:
        try:
            trackers = make_trackers(cfg, run_dir, 0)
        except ConfigError as e:
            problem = ("config", str(e))
        except Exception as e:  # noqa: BLE001 - reported on every rank as one line
            problem = ("runtime", _line(e))
    if world.size > 1:
        problem = world.bcast(problem)
    if problem is not None:
        err = ConfigError(problem[1]) if problem[0] == "config" else RuntimeError(problem[1])
        err.all_ranks = True  # every rank raises it together: no abort needed
        raise err
    return trackers


def require(name: str) -> None:
    """Import the tracker's package now, so a missing one stops the run before it trains."""
    module, package = PACKAGES[name]
    try:
        _tensorboardx() if name == "tensorboard" else importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"train.report_to: {name} needs the {package} package ({_line(e)}); "
                          f"pip install 'mlxdist[{name}]' (or pip install {package})") from None


def _tensorboardx() -> Any:
    """tensorboardX imports torch when it can, for tensor types we never pass: in an MLX run
    that is seconds and hundreds of MB for nothing, so torch is hidden from it unless loaded."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    try:
        import tensorboardX
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tensorboardX


def _flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = re.sub(r"[^\w\-. /]", "_", f"{prefix}{key}")  # node keys may be globs: `macbook*`
        if isinstance(value, dict) and value:
            out |= _flat_params(value, name + ".")
        else:
            out[name] = str(value)[:6000]  # MLflow's limit on a param's length
    return out


def _saved_ids(run_dir: Path) -> dict[str, str]:
    if not (run_dir / _IDS_FILE).is_file():
        return {}
    return gate.read_json(run_dir / _IDS_FILE, "tracker ids", gate.Dict(values=gate.Str(200)), max_bytes=1 << 20)


def _save_ids(run_dir: Path, ids: dict[str, str]) -> None:
    if ids:
        (run_dir / _IDS_FILE).write_text(json.dumps(_saved_ids(run_dir) | ids) + "\n")


def _number(v: Any) -> float | None:
    """Fields may be numpy or engine scalars (which JSON already turns into floats), or absent."""
    if v is None or isinstance(v, (bool, str, list, tuple, dict)):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _quietly(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # noqa: BLE001 - best effort on a path that is already failing
        return None
