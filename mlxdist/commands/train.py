"""`python -m mlxdist.train`: the CLI. The loop itself is `training/loop.py`."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import yaml

from ..config import Config, ConfigError, describe_keys, load_config
from ..engine import ENGINES, prepare_process
from ..errors import error_line
from ..tasks import Task
from ..tasks.load import checked

# Nothing above imports MLX: `main` may still re-exec the process with OpenBLAS preloaded.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mlxdist.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model (the built-in LM, or task.factory: your own) on one machine or, under mpirun, on several.",
        epilog="Your own model: task.factory=package.module:callable (returns an mlxdist.Task; task.args=... "
               "its keyword\narguments), or mlxdist.fit(task) from Python; check it first with "
               "python -m mlxdist.check_task CONFIG.\n\n"
               "Config keys (YAML sections, or KEY=VALUE overrides such as train.lr=3e-4), with defaults:\n"
               + "\n".join(describe_keys()),
    )
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("--engine", choices=ENGINES, default="mlx", help="what does the math (default mlx)")
    p.add_argument("--device", default="auto", help="torch engine: auto|cuda|mps|cpu")
    p.add_argument("--resume", help="shortcut for checkpoint.resume=VALUE (auto, none or a checkpoint dir)")
    p.add_argument("--overwrite", action="store_true",
                   help="shortcut for checkpoint.overwrite=true: a fresh run into a train.out_dir that holds another "
                        "run's checkpoints deletes them (and its logs) instead of stopping")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (defaults <- --config <- overrides) as YAML and exit")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides (keys listed below)")
    return p.parse_intermixed_args(argv)  # overrides may sit on either side of --options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = (list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
                 + (["checkpoint.overwrite=true"] if args.overwrite else []))
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    prepare_process(args.engine)
    return _run(cfg, args.engine, args.device)


def fit(task: Task, config: str | Path | Config | None = None, overrides: Sequence[str] = (),
        engine: str = "mlx", device: str = "auto") -> int:
    """Train `task` with everything the CLI does; returns the exit code. Under
    `mpirun -np N python my_train.py` every rank calls it. `config` is a YAML path or a
    Config; `overrides` are `key=value` strings. Call it before anything imports MLX so
    Linux can re-exec with a fast BLAS (it says so when it is too late)."""
    from ..blas import late_note

    prepare_process(engine)
    spec = ENGINES.get(engine)
    note = late_note() if spec is not None and spec.openblas else None
    if note:
        print(note, file=sys.stderr)
    try:
        cfg = config if isinstance(config, Config) else load_config(config, list(overrides))
        if isinstance(config, Config) and overrides:
            raise ConfigError("mlxdist.fit: give overrides with a YAML path (or None), not with a Config object")
        if cfg.task.factory:
            raise ConfigError(f"mlxdist.fit: the config sets task.factory ({cfg.task.factory}) and a task was "
                              "passed; remove one")
        task = checked(task, "mlxdist.fit(task)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run(cfg, engine, device, task)


def _run(cfg: Config, engine: str, device: str, task: Task | None = None) -> int:
    try:
        return train(cfg, engine, device, task)
    except Exception as e:  # noqa: BLE001 - one line for the user, traceback on request
        if not getattr(e, "quiet", False):  # raised by every rank, said by rank 0
            print(error_line(e), file=sys.stderr)
        if os.environ.get("MLXDIST_DEBUG"):
            traceback.print_exc()
        if not getattr(e, "all_ranks", False):  # raised by every rank together: nobody waits
            trackers = sys.modules.get("mlxdist.telemetry.trackers")
            if trackers is not None:
                trackers.close_open()
            _abort_peers(2 if isinstance(e, ConfigError) else 1)
        return 2 if isinstance(e, ConfigError) else 1


def _abort_peers(code: int) -> None:
    """Under mpirun, one rank's fatal error must end every rank, not leave them waiting; the
    job's exit status is still the error's (2: fix the input)."""
    from ..cluster.world import abort_peers

    abort_peers(code)


def train(cfg: Config, engine_name: str = "mlx", device: str = "auto", task: Task | None = None) -> int:
    from ..training.loop import Trainer  # imports MLX or torch: after the BLAS re-exec

    return Trainer(cfg, engine_name, device, task).run()


if __name__ == "__main__":
    sys.exit(main())
