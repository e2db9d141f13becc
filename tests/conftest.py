"""What every test needs from the machine: the BLAS the product runs with, and no leftovers
of killed MPI jobs.

On Linux the test process itself re-execs with OpenBLAS preloaded, as `mlxdist.train` does:
the mlx-cpu wheel's bundled reference BLAS is ~35x slower, and tests that run MLX in-process
(a 135M model's forward, LoRA on SmolLM2) spent most of their time in it. One BLAS thread,
the count every subprocess of the suite has always had (tests/helpers.py `env`); torch keeps
a thread per core. Those threads wait for work asleep (OMP_WAIT_POLICY=PASSIVE), not spinning:
the suite keeps both cores busy (two workers, ranks of one job side by side), and torch's
OpenMP threads spinning for a core another process holds made a torch run 2-4x slower (a
2-rank tiny run 44 s -> 23 s, a SmolLM2 LoRA process 57 s -> 14 s, with another process busy);
the results are the same bit for bit.

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
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (see above)
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


# The files that take longest (measured, whole file), first: with `--dist loadfile` and
# `--no-loadscope-reorder` (pyproject's addopts) they go out to the two workers first and the
# many short files fill in behind them, so both workers finish about together. xdist's own order
# (most tests first) left a one-test file of a minute or more for last, run by one worker alone.
# Files that mostly wait (namespace hosts cut off, stall timeouts) alternate with files that keep
# both cores busy, so the two workers tend to run one of each. Only the order changes; every
# file still runs whole on one worker.
LONGEST_FIRST = [
    "test_torch_dist.py", "test_multihost.py", "test_recipes.py", "test_elastic.py", "test_finetune.py",
    "test_your_loop.py", "test_research_loop.py", "test_smollm2_finetune.py", "test_bench_finetune.py", "test_generate_lm.py",
    "test_sync_batchnorm.py", "test_hf_trainer.py", "test_tasks.py", "test_diloco_train.py", "test_lightning.py",
    "test_own_optimizer.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    # The rest as xdist would order them: files with more tests first (a stable sort keeps each
    # file's own order).
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path.name]))
