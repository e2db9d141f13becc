"""The distributed layer for a loop of the user's own (`mlxdist.torch`, `mlxdist.mlx`).

One World per process, made by `init()` as the trainer makes its own: ranks from mpirun (one
rank without it), the stall watchdog, signals that ask for a stop at a step boundary, the
Prometheus endpoint, and each rank's share of a global batch from a config's `nodes:`. The
framework modules add what touches tensors; everything here is numbers and numpy.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import gate
from ..cluster.world import World, init_world
from ..config import Config, ConfigError, ControlConfig, load_config
from ..control.health import NonfiniteSteps
from ..control.split import proportional_split


class NotInitialized(ConfigError):
    pass


def _excepthook(kind, value, tb) -> None:
    """mlxdist's own errors in a user's script are one line and exit 2, as in the trainer;
    anything else prints as Python prints it, then ends the other ranks rather than leaving
    them waiting in a collective."""
    if isinstance(value, ConfigError):
        if not getattr(value, "quiet", False):
            sys.stderr.write(f"error: {value}\n")
        sys.stderr.flush()
        os._exit(2)
    _previous_hook(kind, value, tb)
    if _SESSION is not None and _SESSION.size > 1:
        _SESSION.world.end_job(1)


_previous_hook = sys.excepthook
sys.excepthook = _excepthook


@dataclass
class Session:
    world: World
    config: Config | None
    weights: list[float]  # each rank's say in a global batch: its `nodes:` batch size, or 1
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    skipped_steps: int = 0  # updates skipped because no rank had a unit to learn from
    metrics: Any = None  # the Prometheus endpoint's, when one is served

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    def shares(self, global_batch: int) -> list[int]:
        """Every rank's samples of a global batch, proportional to its `nodes:` batch size
        (equal without a config), summing to `global_batch`."""
        if global_batch < self.size:
            raise ConfigError(f"shares({global_batch}): a global batch smaller than the {self.size} ranks")
        return proportional_split(int(global_batch), self.weights)


_SESSION: Session | None = None


@dataclass
class Info:
    rank: int
    size: int
    local_rank: int
    host: str
    device: str  # torch: mps, cuda:LOCAL_RANK or cpu; MLX: its default device


def info(module: str) -> Info:
    s = current(module)
    return Info(s.rank, s.size, s.world.local_rank, s.world.host, s.device)


def refuse_torchrun(env: Mapping[str, str] = os.environ) -> None:
    """torchrun starts processes that each think they are the only one here (no MPI)."""
    if "TORCHELASTIC_RUN_ID" in env or ("LOCAL_WORLD_SIZE" in env and "OMPI_COMM_WORLD_SIZE" not in env
                                        and "PMIX_RANK" not in env):
        raise ConfigError("started by torchrun, whose ranks mlxdist cannot join (it talks MPI): start the script "
                          "with `mpirun -np N python SCRIPT` or `launch/mlxrun --hostfile HOSTS -- SCRIPT`")


def start(framework: str, config: str | os.PathLike | Config | None = None, backend: str = "mpi4py",
          stall_timeout: float | None = None, metrics_port: int | None = None) -> Session:
    """The process's session (made once; a second call returns the first)."""
    global _SESSION
    let_errors_through_hydra()
    if stall_timeout is not None and not (math.isfinite(stall_timeout) and stall_timeout >= 1.0):
        raise ConfigError(f"init(stall_timeout={stall_timeout!r}): give a finite number of seconds >= 1 "
                          "(a NaN would turn stall detection off)")
    if _SESSION is not None:
        return _SESSION
    refuse_torchrun()
    # $MLXDIST_CONFIG names it for a script that parses its own arguments (hydra), in both APIs.
    config = config if config is not None else os.environ.get("MLXDIST_CONFIG") or None
    cfg = config if isinstance(config, Config) or config is None else load_config(config)
    world = init_world(backend)
    world.install_signal_handlers()
    world.start_watchdog(stall_timeout or (cfg.dist.stall_timeout_s if cfg else 120.0))
    weights = [1.0] * world.size
    if cfg is not None and cfg.nodes:
        weights = [float(b) for b in world.allgather(cfg.node_for(world.host, world.rank).batch_size)]
    session = Session(world, cfg, weights)
    from ..markers import write_line

    if world.size > 1:
        write_line(_share_line(framework, world, weights, config))
    port = metrics_port if metrics_port is not None else (cfg.metrics.port if cfg else 0)
    if port:
        from ..telemetry.metrics import Metrics

        metrics = Metrics(world.rank, world.host)
        metrics.set_build(engine=framework, backend="single" if world.size == 1 else backend,
                          world_size=str(world.size))
        warning = metrics.serve(port + world.local_rank, cfg.metrics.bind if cfg else "0.0.0.0")
        session.notes += [warning] if warning else []
        session.metrics = metrics
    _SESSION = session
    return session


def _share_line(framework: str, world: World, weights: list[float], config: Any) -> str:
    """Each rank's line at start: its part of every global batch and where that came from, as
    the trainer's banner says it (a wrong split is seen before a step, not after a run)."""
    total = sum(weights)
    source = (f"nodes: in {config if not isinstance(config, Config) else 'the config given'}"
              if weights != [1.0] * world.size else "equal shares: no config with nodes:")
    return (f"mlxdist.{framework}: rank {world.rank}/{world.size} on {world.host}: {weights[world.rank]:g} of every "
            f"{total:g} rows of a global batch ({source})")


def let_errors_through_hydra(modules: Mapping[str, Any] = sys.modules,
                             env: os._Environ | dict = os.environ) -> bool:
    """Under `@hydra.main`, hydra catches every error, prints its traceback and exits 1: an
    mlxdist error would no longer be one line, and the other ranks would wait in a collective.
    HYDRA_FULL_ERROR=1 makes hydra re-raise, so mlxdist's handler sees it (its own errors: one
    line, exit 2; others: Python's traceback, then the job ends). Set when hydra is loaded and
    the variable is not set already; True when set here."""
    if "hydra" not in modules or "HYDRA_FULL_ERROR" in env:
        return False
    env["HYDRA_FULL_ERROR"] = "1"
    return True


def current(module: str) -> Session:
    if _SESSION is None:
        let_errors_through_hydra()
        raise NotInitialized(f"{module}: call {module}.init() first (once per process, before any other call)")
    return _SESSION


def should_stop(session: Session) -> bool:
    """Whether any rank was asked to stop (Ctrl-C, SIGTERM, `kill -USR1 MPIRUN`): every rank
    gets the same answer, so all leave the loop at the same step. Collective."""
    return any(session.world.allgather(session.world.stop_requested))


def ranks_equal(module: str, step: int, arrays: dict[str, np.ndarray]) -> bool:
    """Whether every rank holds rank 0's whole model state (digests compared, collective): a
    checkpoint saves rank 0's, so ranks that drifted apart are said, naming the first rank and
    entry that differ, not hidden."""
    import hashlib

    s = current(module)
    if s.size == 1:
        return True
    digests = s.world.allgather({n: hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()
                                 for n, a in arrays.items()})
    differ = [(r, n) for r, d in enumerate(digests) for n in d if d[n] != digests[0].get(n)]
    if differ and s.world.is_main:
        from ..markers import write_line

        write_line(f"{module}.save_checkpoint: step {step}: rank {differ[0][0]}'s {differ[0][1]} differs from rank "
                   f"0's ({len(differ)} tensor(s) on other ranks do): the ranks drifted apart; rank 0's state is saved")
    return not differ


class ModelStateSync:
    """A your-loop model's state kept equal across ranks after each step by the trainer's own
    `StateSync`: BatchNorm's running statistics averaged by each rank's units (what one process
    with the global batch holds), other changed state as rank 0 has it."""

    def __init__(self, session: Session, tracker: Any):
        from ..sync.model_state import StateSync

        self.sync, self.tracker = StateSync(session.world), tracker

    def __call__(self, units: float) -> None:
        self.sync(self.tracker, units)


def model_state_sync(session: Session, tracker: Any) -> ModelStateSync | None:
    """None on one rank: there is nothing to agree with."""
    return ModelStateSync(session, tracker) if session.size > 1 else None


def nonfinite_policy(module: str, session: Session, max_in_a_row: int | None = None) -> NonfiniteSteps:
    """The trainer's count of skipped non-finite updates (`control.max_nonfinite_steps`), so a
    loop of the user's own stops where the trainer would: `max_in_a_row` given, else the
    config's, else the trainer's default."""
    if max_in_a_row is None:
        return NonfiniteSteps((session.config.control if session.config else ControlConfig()).max_nonfinite_steps)
    if isinstance(max_in_a_row, bool) or not isinstance(max_in_a_row, int) or max_in_a_row < 1:
        raise ConfigError(f"{module}: max_nonfinite_steps={max_in_a_row!r} is not a whole number >= 1; give how "
                          "many updates in a row with NaN or infinite gradients end the job (the trainer's "
                          f"default: {ControlConfig().max_nonfinite_steps})")
    return NonfiniteSteps(max_in_a_row)


def judge_update(module: str, session: Session, policy: NonfiniteSteps, finite: bool, outcome: str) -> None:
    """After the gradient sum, with `finite` the same on every rank (a NaN on one rank is a NaN
    in everyone's sum): a non-finite update is counted and said by rank 0, the caller skips it;
    the `max_nonfinite_steps`th in a row ends the job on every rank together, in one line, as
    the trainer's does (weights that keep blowing up will not recover by themselves).
    `outcome`: what the caller does with a skipped step, for the line."""
    give_up = policy.observe(finite)
    if finite:
        return
    if session.metrics is not None:
        session.metrics.nonfinite.inc()
    k = policy.max_in_a_row
    if give_up:
        raise session.world.agreed_error(
            f"{module}: {k} updates in a row skipped, their gradients summed over the ranks holding NaN or "
            f"infinity (control.max_nonfinite_steps={k}; {policy.total} skipped in all); the job stopped with the "
            "weights of the last finite update: resume from your last checkpoint with a lower learning rate, "
            "or look at the data of these steps")
    if session.world.is_main:
        from ..markers import write_line

        write_line(f"{module}: step skipped: the gradients summed over the ranks hold NaN or infinity; {outcome} "
                   f"({policy.total} so far, {policy.streak} in a row; the job stops at "
                   f"control.max_nonfinite_steps={k} in a row)")


def all_reduce(module: str, value: Any, op: str, array_type: type, to_numpy, from_numpy) -> Any:
    """`value` (a number, numpy array or the framework's `array_type`) reduced over ranks, in
    its own type."""
    s = current(module)
    if isinstance(value, array_type):
        return from_numpy(all_reduce_numpy(s, to_numpy(value), op), value)
    out = all_reduce_numpy(s, value, op)
    return out if isinstance(value, np.ndarray) else out.item()


def all_gather(module: str, obj: Any) -> list[Any]:
    return current(module).world.allgather(obj)


def broadcast_object(module: str, obj: Any, root: int = 0) -> Any:
    return current(module).world.bcast(obj, root)


def all_reduce_numpy(session: Session, value: Any, op: str) -> np.ndarray:
    if op not in ("sum", "mean", "max", "min"):
        raise ValueError(f"all_reduce: op '{op}' is not one of sum, mean, max, min")
    a = np.asarray(value, dtype=np.float64)
    if op in ("sum", "mean"):
        total = session.world.allreduce_arrays({"v": a})["v"]
        return total / session.size if op == "mean" else total
    gathered = np.stack(session.world.allgather(a))
    return gathered.max(axis=0) if op == "max" else gathered.min(axis=0)


def check_same_shapes(session: Session, shapes: dict[str, tuple], what: str) -> None:
    """Every rank's model has rank 0's parameter names and shapes, or one line naming the first
    rank and parameter that differ."""
    gathered = session.world.allgather(shapes)
    hosts = session.world.allgather(session.world.host)
    ref = gathered[0]
    for r, theirs in enumerate(gathered[1:], start=1):
        if theirs == ref:
            continue
        extra = sorted(set(theirs) - set(ref))
        lacking = sorted(set(ref) - set(theirs))
        differ = sorted(n for n in set(ref) & set(theirs) if ref[n] != theirs[n])
        detail = (f"{differ[0]} is {tuple(theirs[differ[0]])} there, {tuple(ref[differ[0]])} on rank 0" if differ
                  else f"it has {extra[0]}, which rank 0 lacks" if extra else f"it lacks {lacking[0]}")
        err = ConfigError(f"{what}: the model on rank {r} ({hosts[r]}) differs from rank 0's ({hosts[0]}): "
                          f"{detail}; build the same model on every rank")
        err.quiet = session.rank != 0  # every rank saw the same gathered shapes: rank 0 says it
        raise err


def sample_order(n: int, seed: int, start: int, count: int) -> np.ndarray:
    from ..data.sampler import GlobalSampler

    return np.asarray(GlobalSampler(n, seed).indices(start, count))


def my_slice(shares: Sequence[int], rank: int) -> tuple[int, int]:
    from ..data.sampler import rank_slice

    return rank_slice(list(shares), rank)


class RankSampler:
    """This rank's rows of every global batch of a shuffled stream fixed by (seed, position):
    global batch `step` is stream positions [step * global_batch, (step + 1) * global_batch),
    and rank r takes its `shares[r]` rows from sum(shares[:r]) on, so the ranks together hold
    exactly the rows one process would (3+5 == 8), whatever the split, and a resume at any step
    gets the same rows. Each epoch is `n_samples // global_batch` global batches. Framework-free:
    the samplers of `mlxdist.torch` and `mlxdist.mlx` are this one."""

    def __init__(self, n_samples: int, global_batch: int, shares: Sequence[int], rank: int, seed: int = 0,
                 start_step: int = 0, who: str = "DistributedSampler"):
        self.n, self.global_batch, self.seed = int(n_samples), int(global_batch), int(seed)
        self.steps = self.n // self.global_batch if self.global_batch > 0 else 0
        if self.steps == 0:
            raise ConfigError(f"{who}: {n_samples} samples make no global batch of {global_batch}; "
                              "give a global batch between 1 and the number of samples")
        self.begin, self.end = my_slice(shares, rank)
        self.batch_size = self.end - self.begin
        self.epoch, self.start_step = 0, int(start_step)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def indices(self, step: int) -> np.ndarray:
        """This rank's dataset indices of global batch `step` (counted from the run's start,
        across epochs)."""
        return sample_order(self.n, self.seed, int(step) * self.global_batch + self.begin, self.batch_size)

    def epoch_steps(self) -> range:
        """The global batches of the current epoch still to run: all of them, but in the epoch a
        resumed run stopped in, those from `start_step` on (a global step counted from the run's
        start). Epochs after it are whole; epochs before it have none left."""
        first, end = self.epoch * self.steps, (self.epoch + 1) * self.steps
        return range(min(max(first, self.start_step), end), end)


def save_checkpoint(module: str, run_dir: str | os.PathLike, step: int, model: dict[str, np.ndarray],
                    optimizer: dict[str, np.ndarray], state: dict[str, Any], keep_last: int,
                    tensors: dict[str, np.ndarray] | None = None) -> Path | None:
    """Rank 0 writes `run_dir/checkpoints/step_N` in the trainer's format (atomic, checksummed,
    the newest `keep_last` kept); every rank waits for it. `tensors`: the loop's own arrays
    (a carry, an EMA copy), in the checkpoint's `task` file. Returns the path on rank 0."""
    from ..state import checkpoint as ckpt

    s = current(module)
    _hold_run_dir(module, s, run_dir)
    path, refused = None, None
    if s.world.is_main:
        root = Path(run_dir) / "checkpoints"
        meta = {"step": int(step), "world_size": s.size, "your_loop": module, "loop_state": state}
        try:
            path = ckpt.save(root, int(step), model, optimizer, meta, extra={"task": tensors} if tensors else None)
            ckpt.apply_retention(root, keep_last, keep_best=False, newest=path)
        except ckpt.CheckpointError as e:  # NaN weights, a full disk: every rank ends with the same line
            refused = f"{module}.save_checkpoint: {e}"
            if isinstance(e, ckpt.NonFiniteError):
                refused += ("; the weights themselves went non-finite (an overflow, or an update made outside "
                            "mlxdist's gradient sum): resume from the last checkpoint with a lower learning rate")
    with s.world.watch("waiting for the checkpoint writer", patience=10):
        refused = s.world.bcast(refused)
    if refused:
        raise s.world.agreed_error(refused)
    return path


_HELD_DIRS: set[str] = set()


def _hold_run_dir(module: str, s: Session, run_dir: str | os.PathLike) -> None:
    """A run folder holds one run (`state/run_lock.py`): the first save into it takes its lock
    for the rest of the process, so two scripts saving into one folder do not write over each
    other's steps. Every rank calls it with the same folder and learns rank 0's answer."""
    from ..state import run_lock

    key = os.fspath(run_dir)
    if key in _HELD_DIRS:
        return
    refused = None
    if s.world.is_main:
        try:
            for note in run_lock.hold_for_process(run_dir, f"{module}-{os.getpid()}",
                                                  key=f"{module}.save_checkpoint: run_dir"):
                sys.stderr.write(f"{module}: {note}\n")
        except ConfigError as e:
            refused = str(e)
    refused = s.world.bcast(refused)
    if refused:
        raise s.world.agreed_error(refused)
    _HELD_DIRS.add(key)


_LOOP_STATE = gate.Dict({"step": gate.Int(), "your_loop": gate.Str(50),
                         "loop_state": gate.Dict({"user": gate.Dict(values=gate.Tree())}, values=gate.Tree())},
                        required=("step", "loop_state"), values=gate.Tree())


def _read_checkpoint(module: str, where: str | os.PathLike) -> Any:
    """Rank 0's read of the newest whole checkpoint under `where` (None: there is none yet), its
    state checked as a loop's; any problem is one line naming the checkpoint."""
    from ..state import checkpoint as ckpt

    p = Path(where)
    if (p / ckpt.MANIFEST).is_file():
        loaded = ckpt.load(p)
    else:
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        loaded = ckpt.load_latest(root, warn=lambda m: sys.stderr.write(f"{module}: {m}\n"))
        unverified = [] if loaded is not None else [f"{c.name}: {ckpt.verify(c)}" for c in ckpt.list_checkpoints(root)]
        if unverified:  # starting over would write new steps over them
            raise ConfigError(f"{module}.load_checkpoint({where}): none of its {len(unverified)} checkpoint(s) "
                              f"verifies ({'; '.join(unverified)}); nothing was changed: look at them, then move them "
                              f"out of {where} to start afresh (a new run would write its steps over them)")
    if loaded is None:
        return None
    if "loop_state" not in loaded.state:
        raise ConfigError(f"{module}.load_checkpoint({where}): a checkpoint of mlxdist's trainer, not of a loop "
                          "(resume it with python -m mlxdist.train --resume)")
    gate.check(loaded.state, _LOOP_STATE, loaded.path / "state.json")
    return loaded


def load_checkpoint(module: str, where: str | os.PathLike, tensors: dict[str, np.ndarray] | None = None
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]] | None:
    """Rank 0 reads the newest whole checkpoint under `where` (a run dir, its `checkpoints/`,
    or one `step_N`), every rank gets its arrays and state; None when there is none. `tensors`,
    when given, receives the loop's own arrays (`save_checkpoint`'s `tensors`)."""
    from ..state import checkpoint as ckpt

    s = current(module)
    loaded, problem = None, None
    if s.world.is_main:
        try:
            loaded = _read_checkpoint(module, where)
        except (ConfigError, ckpt.CheckpointError) as e:  # every rank ends with the same one line
            problem = str(e)
    problem = s.world.bcast(problem)
    if problem:
        err = ConfigError(problem)
        err.quiet = s.rank != 0
        raise err
    found = s.world.bcast(None if loaded is None else loaded.state)
    if found is None:
        return None
    model = s.world.broadcast_arrays(loaded.weights if s.world.is_main else {})
    optimizer = s.world.broadcast_arrays(loaded.optimizer if s.world.is_main else {})
    if tensors is not None:
        tensors.update(s.world.broadcast_arrays(loaded.extra.get("task", {}) if s.world.is_main else {}))
    return model, optimizer, {"step": found["step"], **found["loop_state"]}
