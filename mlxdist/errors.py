"""One line for an error that ends a run: mlxdist's own are sentences already; one raised in
the user's code (a task's loss, dataset, build, hook) says where, with the way to the
traceback."""

from __future__ import annotations

import os
import socket
import sysconfig
import traceback
from pathlib import Path

from .config import ConfigError

_PACKAGE = Path(__file__).resolve().parent


def error_line(e: BaseException) -> str:
    """One line for a failed run. mlxdist's own errors are sentences already; an exception from
    the user's code (a task's loss, dataset, build) says where: rank, host, and the last frame
    outside mlxdist and the frameworks, with the way to the whole traceback."""
    where = user_frame(e.__traceback__)
    frames = list(traceback.walk_tb(e.__traceback__))
    ours = bool(frames) and _PACKAGE in Path(frames[-1][0].f_code.co_filename).resolve().parents
    if (where is None or ours) and isinstance(e, (ConfigError, RuntimeError, ValueError, OSError)):
        return f"error: {e}"  # raised by mlxdist itself: already a sentence that says what to do
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0"))
    at = f" at {where}" if where else ""
    return (f"error: rank {rank} ({socket.gethostname()}){at}: {type(e).__name__}: {e} "
            "(set MLXDIST_DEBUG=1 for the traceback)")


def user_frame(tb) -> str | None:
    """`file.py:LINE in FUNCTION` of the innermost frame that is the user's: not mlxdist's, not
    the standard library's, not a framework's (torch, mlx, numpy, ...) it called into."""
    found = None
    for frame, line in traceback.walk_tb(tb):
        if _users(Path(frame.f_code.co_filename)):
            found = f"{Path(frame.f_code.co_filename).name}:{line} in {frame.f_code.co_name}"
    return found


_FRAMEWORKS = {"torch", "mlx", "numpy", "mpi4py", "safetensors", "transformers", "peft", "mlx_lm"}


def _users(path: Path) -> bool:
    if path.name.startswith("<"):
        return False
    path = path.resolve()
    if _PACKAGE in path.parents:
        return False
    parts = path.parts
    if "site-packages" in parts:
        top = parts[parts.index("site-packages") + 1:]
        return not top or top[0].split(".")[0] not in _FRAMEWORKS
    return Path(sysconfig.get_paths()["stdlib"]).resolve() not in path.parents
