"""A task's hooks (`on_eval`, `on_checkpoint`): the user's code for samples, plots and
predictions, run on rank 0 with the model in eval mode.

A hook that raises ends the run on every rank with one line that names it, after what it was
called for is done (the checkpoint is on disk before `on_checkpoint` runs), so no training
state is lost; the other ranks learn of it from one broadcast rather than from a hang.
"""

from __future__ import annotations

from typing import Any

from ..cluster.world import World
from ..tasks import Task, TaskError


class HookError(TaskError):
    all_ranks = True  # every rank raises it together: nobody aborts the others


class Hooks:
    def __init__(self, task: Task, world: World):
        self.task, self.world = task, world

    def wants(self, name: str) -> bool:
        return getattr(self.task, name) is not None

    def call(self, name: str, model: Any, *args: Any, kept: str = "") -> None:
        """`task.<name>(model, *args)` on rank 0; `kept` says what is safe if it raises."""
        hook = getattr(self.task, name)
        if hook is None:
            return
        failed = original = None
        if self.world.is_main:
            from ..errors import user_frame

            was_training = getattr(model, "training", True)
            model.eval()
            try:
                hook(model, *args)
            except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
                original = e
                where = user_frame(e.__traceback__)
                failed = (f"task {self.task.name}: {name} raised {type(e).__name__}: {e}"
                          + (f" (at {where})" if where else "") + (f"; {kept}" if kept else "")
                          + "; set MLXDIST_DEBUG=1 for the traceback")
            finally:
                if was_training:
                    model.train()
        failed = self.world.bcast(failed)
        if failed:
            err = HookError(failed)
            err.quiet = not self.world.is_main
            raise err from original
