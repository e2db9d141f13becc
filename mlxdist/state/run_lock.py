"""A run folder holds one run: `RUN_DIR/run.lock`.

Two runs started into one `train.out_dir` used to both go on: the second's `--overwrite`
deleted the first's checkpoints, retention mixed their steps and both appended to
`logs/rank0.jsonl`. The lock is a file with an `flock` on it, held by the process that writes
the run's checkpoints for as long as it runs. The kernel drops an `flock` when its process
dies however it dies (kill -9, a crash), so a live run is told from a dead one without trusting
what a file says; the file's content (host, pid, run id, since when) is what the refusal names.

Content is read as data from elsewhere (through `gate`): a folder may come from another
machine, and a lock with a dead pid on this host is taken over and said, while one from another
host is not (this host cannot see its processes; a shared disk's `flock` may be local to each
host), except by the next job of the same `launch/mlxrun --elastic` run, which starts only once
the job before it has ended (`ELASTIC_ENV`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import gate
from ..problems import ConfigError

LOCK_NAME = "run.lock"
# Set by `launch/mlxrun --elastic` to one value for every job of its run: the restarted job may
# take the lock over from the job before it, on whichever host that job's writer ran.
ELASTIC_ENV = "MLXDIST_ELASTIC_RUN"
LOCK_BYTES = 64 * 1024
_READ_WAIT_S = 2.0  # a lock just taken by another process is written within milliseconds
_ELASTIC_WAIT_S = 15.0  # the previous job of an elastic run, its processes still being reaped

_HOLDER = gate.Dict({"host": gate.Str(255), "pid": gate.Int(1, 2**31), "run_id": gate.Str(200),
                     "since": gate.Float(0), "elastic": gate.Maybe(gate.Str(200))},
                    required=("host", "pid", "run_id", "since"), values=gate.Tree())


class RunFolderError(ConfigError):
    """One line: the run folder, what is wrong with it, and what to do; nothing was changed."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    run_id: str
    since: float
    elastic: str | None = None

    @classmethod
    def this_process(cls, run_id: str) -> Holder:
        return cls(socket.gethostname(), os.getpid(), run_id, time.time(), os.environ.get(ELASTIC_ENV) or None)

    @property
    def here(self) -> bool:
        return self.host == socket.gethostname()

    def describe(self) -> str:
        ago = _ago(time.time() - self.since)
        return (f"pid {self.pid} on {'this host (' + self.host + ')' if self.here else 'host ' + self.host} "
                f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))} ({ago}), run id {self.run_id}")


def check_out_dir(value: str) -> Path:
    """`train.out_dir` as a folder, or why it cannot be one. An empty value would put a run's
    checkpoints and logs into whatever directory the command runs in; a NUL byte no file system
    takes (Python's error names neither the key nor the value)."""
    if not value.strip():
        raise RunFolderError("train.out_dir is empty, which would put the run's checkpoints and logs into the "
                             "directory you run in; give the run a folder (train.out_dir=runs/NAME)")
    if "\x00" in value:
        raise RunFolderError(f"train.out_dir {value!r} holds a NUL character (\\0), which no file name may hold; "
                             "give a plain folder name (train.out_dir=runs/NAME)")
    return Path(value)


class RunLock:
    """This process's hold on a run folder, until `release` (or the process ends)."""

    def __init__(self, run_dir: Path, fd: int, holder: Holder, made_dir: bool):
        self.run_dir, self.path, self.holder = run_dir, run_dir / LOCK_NAME, holder
        self._fd: int | None = fd
        self._made_dir = made_dir

    def release(self) -> None:
        """The file goes while it is still locked (a starter that opened it meanwhile finds it
        gone and opens the new one), then the lock with the descriptor. A folder the lock made
        and nothing else filled goes too: a run refused before writing leaves nothing."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                self.path.unlink()
        except OSError:
            pass  # a read-only or vanished folder: the flock still goes with the descriptor
        finally:
            os.close(fd)
        if self._made_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only when empty


def take(run_dir: Path, run_id: str, *, restarted: bool = False,
         key: str = "train.out_dir") -> tuple[RunLock | None, list[str]]:
    """Hold `run_dir` for this run, making the folder if needed; returns the lock and lines to
    say (a stale lock taken over). None for the lock when it is already this run's (another
    host's writer of the same job, on a shared disk). `restarted`: this job is a restart of an
    elastic run. Any refusal is one `RunFolderError` line, with nothing changed."""
    made = _make_folder(run_dir, key)
    try:
        return _take(run_dir, Holder.this_process(run_id), restarted, made, key)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise


def _make_folder(run_dir: Path, key: str) -> bool:
    """True when the folder was made here."""
    if run_dir.is_symlink() and not run_dir.exists():
        raise RunFolderError(f"{key} {run_dir} is a symbolic link to {os.readlink(run_dir)}, which does not "
                             f"exist; make that folder, or give the run another {key.rsplit(' ', 1)[-1]}")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"{key} {run_dir} is a file, not a folder; nothing was changed: give the run a "
                             "folder (a new name, or an existing folder)")
    existed = run_dir.is_dir()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        above = next((p for p in run_dir.parents if p.exists() and not p.is_dir()), None)
        raise RunFolderError(f"{key} {run_dir} cannot be made: {above or 'a part of it'} is a file, not a "
                             "folder; give the run a folder elsewhere") from None
    except OSError as e:
        raise RunFolderError(f"{key} {run_dir} cannot be made ({_reason(e)}); "
                             f"{what_to_do(e)}") from None
    return not existed


def _take(run_dir: Path, me: Holder, restarted: bool, made: bool, key: str) -> tuple[RunLock | None, list[str]]:
    path = run_dir / LOCK_NAME
    deadline, waited_for_elastic = time.monotonic() + _READ_WAIT_S, False
    while True:
        fd, created = _open(path, run_dir, key)
        try:
            got = _flock(fd)
            if got == HELD:
                # A live process holds it: the refusal names it, once it has written who it is.
                holder, problem = _read(fd, path)
                if holder is not None and holder.run_id == me.run_id:
                    os.close(fd)
                    return None, []
                ending = holder is not None and restarted and _same_elastic(holder, me)
                if ending and not waited_for_elastic:  # the job before this one, its processes being reaped
                    deadline, waited_for_elastic = time.monotonic() + _ELASTIC_WAIT_S, True
                if (holder is None or ending) and time.monotonic() < deadline:
                    os.close(fd)
                    time.sleep(0.05)
                    continue
                raise _held(run_dir, holder, problem, key)
            if not _same_file(fd, path):  # released (and removed) between our open and our lock
                os.close(fd)
                continue
            holder, problem = _read(fd, path)
            notes = [] if created or (holder is None and not problem) else \
                _take_over(run_dir, holder, problem, me, restarted, got == LOCKED, key)
            _write(fd, path, me, run_dir, created, key)
            return RunLock(run_dir, fd, me, made), notes
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise


def _open(path: Path, run_dir: Path, key: str) -> tuple[int, bool]:
    """The lock file, opened without following a link or blocking on a FIFO; and whether this
    call made it."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            return fd, True
        except FileExistsError:
            pass
        except OSError as e:
            raise RunFolderError(f"{key} {run_dir}: cannot make its lock {path} ({_reason(e)}); "
                                 f"{what_to_do(e)}") from None
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            continue  # released between the two opens
        except OSError as e:
            kind = "a symbolic link" if e.errno == errno.ELOOP else f"unopenable ({_reason(e)})"
            raise RunFolderError(f"{key} {run_dir}: its lock {path} is {kind}; remove it (rm {path}) if no "
                                 "run uses this folder") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunFolderError(f"{key} {run_dir}: its lock {path} is not a plain file; remove it if no run "
                                 "uses this folder")
        return fd, False
    raise RunFolderError(f"{key} {run_dir}: its lock {path} keeps appearing and vanishing; "
                         "is another program starting runs there?")


HELD, LOCKED, NO_FLOCK = "held", "locked", "no flock"


def _flock(fd: int) -> str:
    """HELD when another process holds it. A file system without `flock` (some network shares)
    leaves only what the file says (NO_FLOCK)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return LOCKED
    except BlockingIOError:
        return HELD
    except OSError:  # ENOLCK, ENOTSUP, ...
        return NO_FLOCK


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read(fd: int, path: Path) -> tuple[Holder | None, str]:
    """Who the file says holds it; None with "" for an empty file, None with the reason for
    one that is not a lock's."""
    try:
        data = os.pread(fd, LOCK_BYTES + 1, 0)
    except OSError as e:
        return None, _reason(e)
    if not data.strip():
        return None, ""
    if len(data) > LOCK_BYTES:
        return None, f"more than {LOCK_BYTES:,} bytes"
    try:
        value = gate.check(gate.parse_json(gate.decode_utf8(data, path, "run lock"), path, "run lock"), _HOLDER,
                           path)
    except ConfigError as e:
        return None, str(e)
    return Holder(value["host"], value["pid"], value["run_id"], value["since"], value.get("elastic")), ""


def _take_over(run_dir: Path, holder: Holder | None, problem: str, me: Holder, restarted: bool,
               locked: bool, key: str) -> list[str]:
    """Nobody holds the flock, but the file names its last holder: taken over where that holder
    is known to be gone, refused where it may still run. On this host a free flock is proof
    (the kernel dropped it with the process; a pid alone may have been reused); without flock
    support, the pid is all there is."""
    lock = run_dir / LOCK_NAME
    if holder is None:
        return [f"run lock: {lock} held nothing readable ({problem}) and no process holds it; taken over"]
    if restarted and _same_elastic(holder, me):
        return [f"run lock: taken over from the previous job of this elastic run ({holder.describe()})"]
    if holder.here and holder.pid == me.pid:
        return []
    if holder.here and (locked or not _alive(holder.pid)):
        return [f"run lock: the run that held {run_dir} ({holder.describe()}) is no longer running; taken over"]
    if holder.here:
        raise _held(run_dir, holder, "", key)
    raise RunFolderError(f"{key} {run_dir} is locked by a run on another host ({holder.describe()}); nothing "
                         f"was changed: this host cannot tell whether it still runs, so if it has ended, remove "
                         f"{lock} and start again; otherwise wait for it, or give this run another {key.rsplit(' ', 1)[-1]}")


def _same_elastic(holder: Holder, me: Holder) -> bool:
    return bool(holder.elastic) and holder.elastic == me.elastic


def _held(run_dir: Path, holder: Holder | None, problem: str, key: str) -> RunFolderError:
    who = holder.describe() if holder is not None else \
        f"a running process that has not said who it is{f' ({problem})' if problem else ''}"
    return RunFolderError(f"{key} {run_dir} is in use by another run ({who}); nothing was changed: wait for "
                          f"it to end, or give this run another {key.rsplit(' ', 1)[-1]}")


def _write(fd: int, path: Path, me: Holder, run_dir: Path, created: bool, key: str) -> None:
    data = (json.dumps(asdict(me)) + "\n").encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except OSError as e:
        if created:
            with contextlib.suppress(OSError):
                path.unlink()
        raise RunFolderError(f"{key} {run_dir}: cannot write its lock {path} ({_reason(e)}); "
                             f"{what_to_do(e)}") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process (EPERM)
    return True


def what_to_do(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "free some space there, or give the run a folder on another disk"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "give the run a folder you may write to"
    if e.errno == errno.EROFS:
        return "the disk is read-only: give the run a folder on a writable disk"
    return "give the run another folder"


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def linked_outputs(run_dir: Path, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, target) of each of a run's outputs that is a symbolic link: deleting a run's
    files (`--overwrite`) never reaches through one into a folder it points at."""
    return [(name, os.readlink(run_dir / name)) for name in names if (run_dir / name).is_symlink()]


# -- a loop of the user's own ------------------------------------------------------------------

_HELD: dict[Path, RunLock] = {}


def hold_for_process(run_dir: str | os.PathLike, run_id: str, key: str = "run folder") -> list[str]:
    """The lock on `run_dir` for the rest of this process (a loop of the user's own has no
    start or end the library sees: its first save takes it, its exit drops it). Lines to say."""
    where = Path(os.path.abspath(run_dir))
    if where in _HELD:
        return []
    lock, notes = take(Path(run_dir), run_id, key=key)
    if lock is not None:
        if not _HELD:
            atexit.register(_release_all)
        _HELD[where] = lock
    return notes


def _release_all() -> None:
    for lock in _HELD.values():
        lock.release()
    _HELD.clear()
