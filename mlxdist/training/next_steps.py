"""The line a run ends with: what to do next, with this run's own folder in the commands.

    next: sample  python -m mlxdist.generate --checkpoint runs/default --prompt "def " | resume  python -m
    mlxdist.train --resume auto train.steps=800 | two Macs  launch/mlxrun --hostfile hostfiles/studio+macbook.hosts
    -- train.out_dir=runs/two-macs

A pure function of the config and the command line, so it is tested without a run.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from ..config import Config

TWO_MACS = "launch/mlxrun --hostfile hostfiles/studio+macbook.hosts -- train.out_dir=runs/two-macs"


def next_line(cfg: Config, *, world_size: int, builtin_lm: bool, stopped_by_signal: bool,
              argv: Sequence[str] | None = None) -> str:
    """Sample (the built-in LM), resume (this run's own command with `--resume auto`), and, after
    a run on one machine, the same on two Macs (a new folder: this one holds this run)."""
    run_dir = cfg.train.out_dir
    parts = []
    if builtin_lm:
        prompt = ' --prompt "def "' if cfg.data.source == "builtin" else ""
        parts.append(f"sample  python -m mlxdist.generate --checkpoint {shlex.quote(run_dir)}{prompt}")
    # Stopped by a signal: the same target; finished: a longer run (the schedule follows train.steps).
    more = [] if stopped_by_signal else [f"train.steps={2 * cfg.train.steps}"]
    again = _command(sys.argv if argv is None else argv)
    if again is not None and world_size == 1:
        parts.append("resume  " + shlex.join([*again, "--resume", "auto", *more]))
    else:  # under mpirun or launch/mlxrun, or a script of the user's: its own command line
        parts.append("resume  the same command + " + " ".join([spelling(argv)[0], *more]))
    if world_size == 1:
        parts.append(f"two Macs  {TWO_MACS}")
    return "next: " + " | ".join(parts)


def spelling(argv: Sequence[str] | None = None) -> tuple[str, str]:
    """How this process is told to resume and to overwrite: the CLI's flags, or the config keys
    (`mlxdist.fit` in a script of the user's takes overrides)."""
    if _command(sys.argv if argv is None else argv) is not None:
        return "--resume auto", "--overwrite"
    return "checkpoint.resume=auto", "checkpoint.overwrite=true"


def _command(argv: Sequence[str]) -> list[str] | None:
    """`python -m mlxdist.train` (or `mlxdist-train`) and this process's arguments without the
    ones the resume sets (--resume, --overwrite, train.steps, checkpoint.resume/overwrite); None
    when the process is not the trainer's CLI (`mlxdist.fit` in a script of the user's)."""
    if not argv:
        return None
    prog = Path(argv[0])
    if prog.name == "train.py" and prog.parent.name == "mlxdist":
        head = ["python", "-m", "mlxdist.train"]
    elif prog.name == "mlxdist-train":
        head = ["mlxdist-train"]
    else:
        return None
    args, rest = [], list(argv[1:])
    while rest:
        arg = rest.pop(0)
        flag, eq, _ = arg.partition("=")
        if len(flag) > 2 and "--resume".startswith(flag):
            if not eq and rest:
                rest.pop(0)  # its value
            continue
        if len(flag) > 3 and "--overwrite".startswith(flag) and not eq:
            continue
        if flag in ("train.steps", "checkpoint.resume", "checkpoint.overwrite"):
            continue
        args.append(arg)
    return head + args
