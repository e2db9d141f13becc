"""What every test needs from the machine: the BLAS the product runs with, and no leftovers
of killed MPI jobs.

On Linux the test process itself re-execs with OpenBLAS preloaded, as `mlxdist.train` does:
the mlx-cpu wheel's bundled reference BLAS is ~35x slower, and tests that run MLX in-process
(a 135M model's forward, LoRA on SmolLM2) spent most of their time in it. One BLAS thread,
the count every subprocess of the suite has always had (tests/helpers.py `env`); torch keeps
a thread per core.

Tests SIGKILL ranks and whole namespace hosts, which leaves Open MPI / PRRTE session
directories in /tmp named by the dead process's PID (`ompi.PID`, `prted.PID`). With Linux's
default pid_max of 32768 a later launcher can be given the same PID and find stale
rendezvous files there; once in a full run, mpirun then died at start with "The PMIx server's
listener thread failed to start". Only directories of PIDs that no longer exist are removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from mlxdist import blas

    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker: its controller re-exec'd already, and an exec would cut it off
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # torch's threads, as before
    env = blas.reexec_env()
    if env is None:
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()  # the new process starts with the terminal, not pytest's capture files
    blas.ensure_blas()


@pytest.fixture(autouse=True)
def _no_stale_mpi_session_dirs():
    for d in [*Path("/tmp").glob("ompi.*"), *Path("/tmp").glob("prted.*"), *Path("/tmp").glob("prterun.*")]:
        pid = d.name.rsplit(".", 1)[-1]
        if d.is_dir() and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
    yield
