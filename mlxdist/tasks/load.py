"""Which task a run trains: `task.factory` from the config, or the built-in LM.

A factory is `"package.module:callable"`, imported from the working directory or an
installed package and called with `task.args`; it returns a `Task`. Every failure is one
line naming the factory and what to do (exit code 2).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Config
from . import Task, TaskError


def import_factory(spec: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task.factory '{spec}': expected 'package.module:callable', e.g. 'mytasks:make_task'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise TaskError(f"task.factory '{spec}': no module '{e.name}' on this host (working directory "
                            f"{os.getcwd()}); run from the directory that holds {module_name.replace('.', '/')}.py "
                            "or pip install its package on every host") from None
        raise TaskError(f"task.factory '{spec}': importing {module_name} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed at import: say where
        raise TaskError(f"task.factory '{spec}': importing {module_name} failed: {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"task.factory '{spec}': module {module_name} ({module.__file__}) has no '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"task.factory '{spec}': {attr} is a {type(obj).__name__}, not a callable returning a Task")
    return obj


def task_from_factory(spec: str, args: dict[str, Any]) -> Task:
    factory = import_factory(spec)
    try:
        task = factory(**args)
    except TypeError as e:
        raise TaskError(f"task.factory '{spec}': calling it with task.args {sorted(args)} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's factory failed: say which, exit 2
        raise TaskError(f"task.factory '{spec}' raised {type(e).__name__}: {e}") from None
    return checked(task, f"task.factory '{spec}'", spec)


def checked(task: Any, where: str, name: str | None = None) -> Task:
    """The task, named (default: where its build function lives), after the checks that
    need no framework."""
    if not isinstance(task, Task):
        raise TaskError(f"{where}: returned {type(task).__name__}, not an mlxdist.Task "
                        "(return mlxdist.Task(build=..., loss=..., dataset=...))")
    for field in ("build", "loss"):
        if not callable(getattr(task, field)):
            raise TaskError(f"{where}: Task.{field} must be callable")
    for field in ("dataset", "eval_dataset"):
        ds = getattr(task, field)
        if ds is None and field == "eval_dataset":
            continue
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise TaskError(f"{where}: Task.{field} must have len() and [i] (got {type(ds).__name__})")
        if len(ds) == 0:
            raise TaskError(f"{where}: Task.{field} is empty")
    if task.name == "task":
        task.name = name or f"{getattr(task.build, '__module__', '?')}:{getattr(task.build, '__qualname__', '?')}"
    return task


# Keys of the built-in LM's sections that a task's run still uses.
_APPLY_TO_TASKS = ("model.dtype", "data.prefetch")


def check_keys_apply(cfg: Config, task: Task) -> None:
    """A task brings its own model and data: a `model.*`, `data.*` or `finetune.*` key set in
    the config would change nothing, unless the task reads it (`Task.config_keys`)."""
    declared = set(task.config_keys)
    unknown = sorted(k for k in declared if k.split(".")[0] not in ("model", "data", "finetune"))
    if unknown:
        raise TaskError(f"task {task.name}: config_keys names {', '.join(unknown)}; it lists the model.*, data.* "
                        "and finetune.* keys the task reads (the others always apply)")
    ignored = sorted(k for k in cfg.explicit if k.split(".")[0] in ("model", "data", "finetune")
                     and k not in _APPLY_TO_TASKS and k not in declared)
    if ignored:
        one = len(ignored) == 1
        they, them = ("it", "it") if one else ("they", "them")
        raise TaskError(f"task {task.name}: {', '.join(ignored)} {'is' if one else 'are'} set, but a task brings its "
                        f"own model and data, so {they} would change nothing; remove {them}, or, where the task "
                        f"reads {them} from ctx.config, list {them} in Task(config_keys=(...))")


def config_file(path: str | os.PathLike | None, flag: str = "") -> None:
    """Refuse a run folder or a checkpoint where a tool takes the user's config: the tool
    imports the task.factory its config names, and a checkpoint's state.json is data anyone
    who can write the folder can rewrite, so the factory comes only from a file the user names."""
    if path is None:
        return
    p, where = Path(path), f"{flag} {path}".strip()
    checkpoint = (p / "manifest.json").is_file() or (p / "state.json").is_file()
    if p.is_dir() and (checkpoint or (p / "checkpoints").is_dir()):
        raise TaskError(f"{where}: a run or checkpoint directory, not a config file; give the YAML config you "
                        "trained with (nothing in a checkpoint is imported)")
    if p.is_dir():
        raise TaskError(f"{where}: a directory, not a config file; give a YAML config")
    if p.name in ("state.json", "manifest.json") and (p.parent / "manifest.json").is_file():
        raise TaskError(f"{where}: a checkpoint's {p.name}, not a config file; give the YAML config you "
                        "trained with (nothing in a checkpoint is imported)")


def resolve_task(cfg: Config, say: Callable[[str], None] | None = None) -> Task:
    """The config's task: its factory's, or the built-in LM's (presets, pretrained, LoRA)."""
    if cfg.task.factory:
        return task_from_factory(cfg.task.factory, dict(cfg.task.args))
    from ..models.build import inspect_base
    from .lm import lm_task

    return lm_task(cfg, inspect_base(cfg), say)
