"""Linux only: swap mlx-cpu's bundled reference BLAS for the system OpenBLAS (~11x faster).

The dynamic loader reads LD_PRELOAD only at process start, so when OpenBLAS exists and is
not preloaded yet, the process re-executes itself once with the variable set. On macOS
nothing happens: MLX uses Metal and Accelerate there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_MARK = "MLXDIST_BLAS_CHECKED"


def find_openblas() -> str | None:
    for path in CANDIDATES:
        if Path(path).exists():
            return path
    return None


def status() -> str:
    """One line for the startup banner saying which BLAS the MLX CPU backend uses."""
    if sys.platform != "linux":
        return "BLAS: platform default (Accelerate/Metal on macOS)"
    lib = find_openblas()
    if lib and lib in os.environ.get("LD_PRELOAD", ""):
        return f"BLAS: system OpenBLAS preloaded ({lib})"
    if os.environ.get("MLXDIST_NO_OPENBLAS"):
        return "BLAS: mlx-cpu reference BLAS (MLXDIST_NO_OPENBLAS set)"
    return ("BLAS: mlx-cpu reference BLAS (slow); install OpenBLAS for ~10x: "
            "apt-get install libopenblas0-pthread")


def late_note() -> str | None:
    """Why the fast BLAS could not be preloaded when MLX came first (`mlxdist.fit`), or None."""
    lib = find_openblas()
    if sys.platform != "linux" or lib is None or lib in os.environ.get("LD_PRELOAD", "") \
            or os.environ.get("MLXDIST_NO_OPENBLAS") or "mlx" not in sys.modules:
        return None
    return (f"BLAS: mlx was imported before mlxdist.fit(), too late to preload OpenBLAS, so the CPU backend "
            f"uses the slow reference BLAS; import mlx inside your build/loss functions, or start with "
            f"LD_PRELOAD={lib}")


def ensure_openblas(argv: list[str] | None = None) -> None:
    """Re-exec with OpenBLAS preloaded, once, when it helps and the user has not opted out."""
    if sys.platform != "linux" or os.environ.get("MLXDIST_NO_OPENBLAS") or os.environ.get(_MARK):
        return
    lib = find_openblas()
    if lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        return
    if "mlx" in sys.modules or "mpi4py.MPI" in sys.modules:
        return  # too late to re-exec safely
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_MARK] = "1"
    args = argv if argv is not None else [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(args[0], args, env)
