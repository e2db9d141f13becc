"""Shared helpers: run the real CLI in a subprocess, with or without mpirun, and a namespace
cluster for a test module."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Small, fast, deterministic settings for runs in tests.
FAST = ["data.source=synthetic", "data.seq_len=32", "metrics.port=0", "train.progress=false",
        "train.eval_every=0", "train.warmup_steps=2", "model.preset=tiny"]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    return e


def with_mlxdist_lines(script: Path, dest: Path) -> Path:
    """A vendored public script with its mlxdist diff (`NAME.mlxdist.diff` beside it, the lines
    a user changes) applied, written to dest/NAME: the repository keeps the script as published
    and the diff, not a second copy."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / script.name
    out.write_bytes(script.read_bytes())
    diff = script.with_name(f"{script.stem}.mlxdist.diff")
    r = subprocess.run(["git", "apply", str(diff)], cwd=dest, capture_output=True, text=True)
    assert r.returncode == 0, f"{diff} does not apply to {script}: {r.stderr}"
    return out


def mlxdist_diff_lines(script: Path) -> list[str]:
    """The added and removed lines of a vendored script's mlxdist diff."""
    text = script.with_name(f"{script.stem}.mlxdist.diff").read_text().splitlines()
    return [ln for ln in text if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def mpirun_path() -> str:
    from mlxdist.cluster.world import find_mpirun

    try:
        return find_mpirun()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def train_command(args: list[str], np_: int = 0, extra_env: dict | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "mlxdist.train", *args]
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
               "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS",
               *[x for k in (extra_env or {}) for x in ("-x", k)], *cmd]
    return cmd


def logged_steps(run_dir: Path) -> list[dict]:
    log = run_dir / "logs" / "rank0.jsonl"
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "step"]


@contextlib.contextmanager
def training(args: list[str], np_: int, run_dir: Path, steps: int, timeout: float = 120):
    """A real run (under mpirun when `np_`), handed over once rank 0 logged `steps` steps; killed
    on the way out if it is still running."""
    proc = subprocess.Popen(train_command(args, np_), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env())
    try:
        deadline = time.monotonic() + timeout
        while len(logged_steps(run_dir)) < steps:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no training progress within {timeout:g} s"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def stop_with_sigterm_after(args: list[str], run_dir: Path, step: int, np_: int = 0) -> tuple[int, str]:
    """Start a real run, stop it once rank 0 logged `step`, wait for the end: SIGTERM to a lone
    process, SIGUSR1 to mpirun (which kills the job on SIGTERM but forwards SIGUSR1)."""
    proc = subprocess.Popen(train_command(args, np_), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env())
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(logged_steps(run_dir)) >= step:
            proc.send_signal(signal.SIGUSR1 if np_ else signal.SIGTERM)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


# The rig's compute scale (MLXDIST_RIG_COMPUTE_SCALE) is per host; ranks sharing this one each
# take their own from a list.
PER_RANK = ('s=$(echo "$MLXDIST_TEST_SCALES" | cut -d, -f$((OMPI_COMM_WORLD_RANK+1))); '
            'MLXDIST_RIG_COMPUTE_SCALE=$s exec "$@"')


def run_slowed(args: list[str], scales: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The trainer on one rank per entry of `scales` ("1,3": rank 1 computes 3x slower)."""
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(len(scales.split(","))),
           "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS", "-x", "MLXDIST_TEST_SCALES", "/bin/sh", "-c", PER_RANK,
           "sh", sys.executable, "-m", "mlxdist.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env() | {"MLXDIST_TEST_SCALES": scales})


def run_train(args: list[str], np_: int = 0, timeout: float = 300, cwd: Path | None = None,
              extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mlxdist.train ARGS`, under `mpirun -np N` when N > 0."""
    cmd = train_command(args, np_, extra_env)
    e = env() | (extra_env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=e)


def final_weights(run_dir: Path) -> dict[str, np.ndarray]:
    from mlxdist.state import checkpoint as ckpt

    loaded = ckpt.load_latest(run_dir / "checkpoints")
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return loaded.weights


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert worst <= atol, f"max weight difference {worst:.3g} > {atol}"


def namespace_cluster(tmp_path_factory: pytest.TempPathFactory, hosts: int, name: str, subnet: str):
    """Body of a module-scoped cluster fixture (`yield from` it): `hosts` namespace hosts, torn
    down after the module; ranks import mlxdist from this checkout wherever mpirun starts them.
    Skips with the reason where namespaces cannot be made (not root, no iproute2)."""
    from mlxdist.rig import simcluster

    ok, why = simcluster.available()
    if not ok:
        pytest.skip(why)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)
    try:
        with simcluster.SimCluster(hosts, name=name, subnet=subnet,
                                   state_dir=tmp_path_factory.mktemp(name)) as c:
            yield c
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
