"""The run's checkpoints: when to save, where, which one to resume from, and retention.

The file format and its atomic, checksummed writing live in `checkpoint.py`; this is the
component the loop talks to. Rank 0 writes `RUN_DIR/checkpoints/`. With
`checkpoint.on_every_host`, the first rank of every other host also writes its own copy into
`RUN_DIR/replicas/HOST/` (all ranks hold identical state, DESIGN promise 3): on Macs with their
own disks the run then survives losing any one of them, rank 0's included, and on a shared disk
the copies cannot collide. Reading is rank 0's job; the loop hands what it read to the others.

A run's checkpoints carry its id (`RunState.run_id`). Retention and rollback only ever take
this run's own (`Checkpointer.lineage`), and a run that continues none of the checkpoints in its
folder is refused before it writes anything there (`others_in`; the loop asks every rank):
otherwise retention would delete the new run's newest checkpoint, keeping the old run's
higher steps, and `--resume auto`, generation and evaluation would read the old run.

`python -m mlxdist.state.checkpointer probe RUN_DIR` prints, as one JSON line, the newest copy that
verifies on this host: the elastic supervisor asks every host this before a restart.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..config import CheckpointConfig
from . import checkpoint as ckpt

REPLICAS = "replicas"


def all_copies(run_dir: Path) -> list[Path]:
    """Every checkpoint directory of the run visible here, newest step first; for one step,
    rank 0's copy before the replicas."""
    found = [(p, 0) for p in ckpt.list_checkpoints(run_dir / "checkpoints")]
    replicas = run_dir / REPLICAS
    if replicas.is_dir():
        for host_dir in sorted(replicas.iterdir()):
            found += [(p, 1) for p in ckpt.list_checkpoints(host_dir)]
    found.sort(key=lambda pr: (-_step(pr[0]), pr[1], str(pr[0])))
    return [p for p, _ in found]


def others_in(run_dir: Path, lineage: Collection[str | None] | None) -> list[Path]:
    """Checkpoints in `run_dir` visible here (rank 0's and the replicas) that belong to a run
    other than those in `lineage`; all of them for a fresh run (None)."""
    return [p for p in all_copies(run_dir) if lineage is None or ckpt.run_id_of(p) not in lineage]


# What a run leaves in its folder that the next run there would read as its own: removed by
# `checkpoint.overwrite` (`--overwrite`). config.yaml is rewritten; nothing else is touched.
RUN_OUTPUTS = ("checkpoints", REPLICAS, "rank_state", "logs")


def remove_run(run_dir: Path) -> list[str]:
    """`checkpoint.overwrite`: delete the previous run's outputs in `run_dir`; returns the names
    removed. Every host's first rank does it for its own disk; on a shared disk they race, so a
    file another rank removed first is no error."""
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if not path.is_dir():
            continue
        removed.append(name)
        for _ in range(100):
            try:
                shutil.rmtree(path)
                break
            except FileNotFoundError:  # removed under our feet: go on with what is left
                if not path.exists():
                    break
    return removed


def describe(paths: list[Path], run_dir: Path) -> str:
    """`checkpoints/: steps 150, 200` for a message; a long list by its first and last steps."""
    by_dir: dict[Path, list[int]] = {}
    for p in paths:
        by_dir.setdefault(p.parent, []).append(_step(p))
    parts = []
    for d, steps in by_dir.items():
        steps.sort()
        shown = ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]} ... {steps[-1]} ({len(steps)})"
        parts.append(f"{_where(d, run_dir)}/: step{'s' if len(steps) > 1 else ''} {shown}")
    return "; ".join(parts)


def _step(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return -1


def newest_whole(run_dir: Path, warn: Callable[[str], None],
                 lineage: Collection[str | None] | None = None, cached: bool = False) -> Path | None:
    """The newest copy that verifies (of the runs in `lineage`; None: of any run); each newer
    broken one is reported and left alone. `cached`: trust this process's earlier verdicts."""
    for path in all_copies(run_dir):
        if lineage is not None and ckpt.run_id_of(path) not in lineage:
            continue
        problem = ckpt.verify(path, cached=cached)
        if problem is None:
            return path
        warn(f"checkpoint {path} is unusable ({problem}); falling back to the previous one")
    return None


def claim_for_resume(run_dir: Path) -> tuple[list[str], list[str]]:
    """`--resume auto`'s look at the run folder before anything is written: (refusals, notes).

    Refusals, one line per checkpoint, where the folder holds checkpoints and none verifies:
    starting fresh there would write new steps over them and let retention delete the rest.
    Otherwise every copy newer than the one the run resumes from that fails verification is
    moved aside (the run will save those steps again), and each move is a note."""
    problems: list[tuple[Path, str]] = []
    found = None
    for path in all_copies(run_dir):
        problem = ckpt.verify(path)
        if problem is None:
            found = path
            break
        problems.append((path, problem))
    if found is None:
        return [f"{_where(p, run_dir)}: {why}" for p, why in problems], []
    notes = []
    for path, why in problems:
        moved = ckpt.move_aside(path)
        notes.append(f"resume: {_where(path, run_dir)} fails verification ({why}); moved aside to "
                     f"{_where(moved, run_dir)} so that this run's step {_step(path)} does not replace it")
    return [], notes


def _where(path: Path, run_dir: Path) -> str:
    """`path` as a message shows it: inside the run folder relative to it."""
    try:
        return str(path.relative_to(run_dir))
    except ValueError:
        return str(path)


def remove_interrupted_saves(run_dir: Path, host: str) -> list[str]:
    """Remove the temporary folders that saves cut short (a kill -9, a power cut) left in the
    run's checkpoint folders on this host's disk; a line for each. Called once the run owns the
    folder, before it writes."""
    dirs = [run_dir / "checkpoints", *sorted((run_dir / REPLICAS).glob("*"))]
    return [f"{host}: removed {_where(p, run_dir)}, left by an interrupted save ({size / 1e6:.1f} MB)"
            for d in dirs for p, size in ckpt.remove_temporaries(d)]


class Stateful(Protocol):
    """A part of the run's checkpoint. One with `collective = True` gathers across ranks in
    `state_dict`, so every rank calls it; the others are asked only where a copy is written."""

    def state_dict(self) -> dict[str, Any]:
        """JSON values for state.json, and dicts of numpy arrays for the files named by
        their key (`model`, `optimizer`, `sync`)."""


ARRAY_FILES = ("model", "optimizer", "sync", *ckpt.EXTRA_FILES)


def gather_states(states: Mapping[str, Stateful], writes: bool = True
                  ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """Every part's state, split into array files and one flat JSON state; a key claimed by
    two parts is a bug, caught here rather than by a resume that reads the wrong value."""
    files: dict[str, dict[str, np.ndarray]] = {}
    flat: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for part, obj in states.items():
        if not (writes or getattr(obj, "collective", False)):
            continue
        for key, value in obj.state_dict().items():
            if key in owner:
                raise RuntimeError(f"checkpoint: '{key}' is claimed by both {owner[key]} and {part}")
            owner[key] = part
            (files if key in ARRAY_FILES else flat)[key] = value
    return files, flat


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, *, host: str = "", rank: int = 0,
                 local_rank: int = 0):
        self.cfg = cfg
        self.run_dir = run_dir
        self.dir = run_dir / "checkpoints"
        # Rank 0 writes the run's checkpoints; a replica writer its host's own copy.
        self.writes = rank == 0 or (cfg.on_every_host and local_rank == 0)
        self.write_dir = self.dir if rank == 0 else run_dir / REPLICAS / host
        # The runs whose checkpoints are this run's own: its id, and None where it continued
        # one written before runs had ids. Set by the loop once it knows (after the resume).
        self.lineage: set[str | None] | None = None

    def due(self, step: int, last: bool) -> bool:
        return bool(self.cfg.every and step % self.cfg.every == 0) or last

    def for_resume(self, warn: Callable[[str], None]) -> ckpt.Loaded | None:
        """What `checkpoint.resume` asks for: none, the newest whole one (auto), or a path."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume != "auto":
            path = Path(self.cfg.resume)
            if path.is_dir() and not (path / ckpt.MANIFEST).is_file():
                # Named on the command line after --resume auto refused it: the user looked.
                warn(f"resume: {path} has no manifest, so its files cannot be verified; resuming from it because "
                     "--resume names it")
                return ckpt.load(path, verified=True)
            return ckpt.load(path)
        loaded = self.latest(warn)
        if loaded is None:
            warn(f"resume=auto: no checkpoint in {self.dir} or {self.run_dir / REPLICAS}; starting fresh")
        return loaded

    def latest(self, warn: Callable[[str], None]) -> ckpt.Loaded | None:
        """Newest whole copy here: rank 0's or a replica (after an elastic restart the new
        rank 0 may hold only the replica it wrote while it was another rank)."""
        path = newest_whole(self.run_dir, warn, self.lineage, cached=True)
        return ckpt.load(path, verified=True) if path is not None else None

    def save(self, step: int, states: Mapping[str, Stateful]) -> Written | None:
        """Gather the run's parts by name (on every rank: a part may gather across ranks),
        then, where this rank writes, one checkpoint and its retention. None on a rank that
        does not write."""
        t0 = time.perf_counter()
        files, state = gather_states(states, self.writes)
        if not self.writes:
            return None
        notes: list[str] = []
        path = ckpt.save(self.write_dir, step, files.get("model", {}), files.get("optimizer", {}), state,
                         sync=files.get("sync"), extra={k: files[k] for k in ckpt.EXTRA_FILES if k in files},
                         warn=notes.append)
        ckpt.apply_retention(self.write_dir, self.cfg.keep_last, self.cfg.keep_best,
                             run_ids=self.lineage if self.lineage is not None else {state.get("run_id")}, newest=path,
                             warn=notes.append)
        return Written(path, time.perf_counter() - t0, notes)


@dataclass(frozen=True)
class Written:
    """A checkpoint this rank wrote, and what the writing has to say (moved aside, retention)."""

    path: Path
    seconds: float
    notes: list[str]


def probe(run_dir: Path) -> dict:
    """This host's answer to the elastic supervisor: its name and newest whole copy."""
    unusable: list[str] = []
    path = newest_whole(run_dir, lambda m: unusable.append(m))
    newest = None
    if path is not None:
        state = ckpt.read_state(path)
        newest = {"path": str(path), "step": int(state.get("step", _step(path))),
                  "global_batch": state.get("global_batch")}
    return {"host": socket.gethostname(), "newest": newest, "unusable": unusable}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "probe":
        print("usage: python -m mlxdist.state.checkpointer probe RUN_DIR", file=sys.stderr)
        return 2
    print(json.dumps(probe(Path(args[1]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
