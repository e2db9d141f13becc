"""What every test needs from the machine: no leftovers of killed MPI jobs.

Tests SIGKILL ranks and whole namespace hosts, which leaves Open MPI / PRRTE session
directories in /tmp named by the dead process's PID (`ompi.PID`, `prted.PID`). With Linux's
default pid_max of 32768 a later launcher can be given the same PID and find stale
rendezvous files there; once in a full run, mpirun then died at start with "The PMIx server's
listener thread failed to start". Only directories of PIDs that no longer exist are removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_stale_mpi_session_dirs():
    for d in [*Path("/tmp").glob("ompi.*"), *Path("/tmp").glob("prted.*"), *Path("/tmp").glob("prterun.*")]:
        pid = d.name.rsplit(".", 1)[-1]
        if d.is_dir() and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
    yield
