"""Ctrl-C on plain `mpirun` that stops and saves.

Open MPI 5's mpirun answers Ctrl-C by sending the ranks SIGCONT, SIGTERM 250 ms later and
SIGKILL 250 ms after that (hard-coded in PRRTE's odls; no MCA parameter lengthens it, and
SIGINT cannot be put on its forwarding list), so a rank cannot finish its step and save.
The terminal sends Ctrl-C to its *foreground process group*, though, and the ranks on the
machine you typed at share mpirun's session and terminal. So the first local rank makes its
own process group the foreground one: Ctrl-C then reaches that rank instead of mpirun, the
rank asks every rank to stop after the current step (the stop flag travels with the step's
all-gather), they save and exit 0, and mpirun ends normally. The first Ctrl-C also hands the
terminal back to mpirun, at once and from a thread (the rank's main thread may be inside a
collective waiting for a frozen peer, where no Python handler runs), so a second Ctrl-C
reaches mpirun and ends the whole job at once. The terminal also goes back when the rank
exits (and the shell takes it back in any case once mpirun ends)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable

Restore = Callable[[], None]




def take_ctrl_c(launcher_pid: int, tty: str = "/dev/tty") -> Restore | None:
    """Make this process's group the terminal's foreground group, if the launcher (mpirun)
    holds it now; returns the function that gives it back, or None when there is nothing to
    take: no terminal (a remote host, CI, a script with its input redirected), or mpirun
    runs in the background or under a supervisor that owns Ctrl-C itself."""
    try:
        fd = os.open(tty, os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
    try:
        theirs, mine = os.getpgid(launcher_pid), os.getpgrp()
        if theirs == mine or os.tcgetpgrp(fd) != theirs:
            os.close(fd)
            return None
        # tcsetpgrp from a background group raises SIGTTOU, which would stop this process;
        # ignored for good, as giving the terminal back happens on another thread.
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        os.tcsetpgrp(fd, mine)
    except OSError:
        os.close(fd)
        return None

    def give_back() -> None:
        try:
            if os.tcgetpgrp(fd) == mine:
                os.tcsetpgrp(fd, theirs)
        except OSError:
            pass  # mpirun's group is gone: the shell has taken the terminal back

    return give_back


def give_back_on_signal(give_back: Restore, signals: Iterable[int]) -> bool:
    """Run `give_back` the moment one of `signals` arrives, even while the main thread is
    blocked in C: Python's C-level handler writes each signal's number to the wakeup fd at
    once, and a thread reads it. The signals' own Python handlers still run as before.
    Needs the main thread (Python's rule for the wakeup fd); False where it cannot."""
    wanted = {int(s) for s in signals}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        return False

    def watch() -> None:
        while True:
            try:
                got = os.read(read_fd, 64)
            except OSError:
                return
            if not got or wanted.intersection(got):
                give_back()
                return

    threading.Thread(target=watch, daemon=True, name="ctrl-c-terminal").start()
    return True
