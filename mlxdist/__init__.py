"""mlxdist: one training job across several Apple Silicon Macs (MLX or PyTorch, MPI between them).

The Python route: `mlxdist.fit(mlxdist.Task(build, loss, dataset), config)`; the config
route: `task.factory` in YAML and `python -m mlxdist.train --config my.yaml`.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["Task", "TaskContext", "check_task", "fit"]


def __getattr__(name: str) -> Any:
    # Lazy: `import mlxdist` must not import MLX or torch (the BLAS re-exec comes first).
    if name in ("Task", "TaskContext"):
        from . import tasks

        return getattr(tasks, name)
    if name == "fit":
        from .commands.train import fit

        return fit
    if name == "check_task":
        import importlib

        return importlib.import_module(".commands.check_task", __name__)  # a callable module
    raise AttributeError(f"module 'mlxdist' has no attribute '{name}'")
