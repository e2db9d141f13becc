"""A job's hosts: hostfiles (read and written), running a script on a host, and whether a host
can take part.

The launcher checks every host before a job, the elastic loop asks them again after a failure,
and the supervisor cleans up on them after it; all three reach a host the same way (`Remote`,
the path mpirun's daemons take) and judge the network the same way (`check_host`,
`network_problem`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import gate

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.gethostname().split(".")[0]}
NETWORK_TIMEOUT_S = 3.0


@dataclass
class HostEntry:
    name: str
    slots: int


class LaunchError(RuntimeError):
    pass


# Hostfiles are a few lines; anything larger was not meant as one.
MAX_HOSTFILE_BYTES = 1 << 20
MAX_SLOTS = 1024  # ranks on one host: a Mac Studio has 32 cores; 10^9 would become `mpirun -np 10^9`
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
# A name starts with a letter or digit (as in Open MPI's hostfile grammar): never with '-',
# which ssh, and mpirun's ssh launch, would read as an option.
_HOST_NAME = re.compile(rf"(?=[A-Za-z0-9]){_LABEL}(?:\.{_LABEL})*")
_COUNT = re.compile(r"[0-9]{1,9}")


def _shown(name: str) -> str:
    """A name as an error line can hold it: quoted, escaped, and short."""
    return repr(name if len(name) <= 200 else name[:197] + "...")


def host_name_problem(name: str) -> str | None:
    """Why `name` may not stand as a host for ssh and mpirun (None: it may). Every name the
    launch wing hands to ssh comes through here first: a name is an argument to ssh, and one
    that reads as an option (`-oProxyCommand=...`) runs a command on this machine."""
    if name.startswith("-"):
        return (f"host {_shown(name)} starts with '-', which ssh would take as an option; write the "
                "Mac's name (studio.local) or its address")
    if "@" in name:
        return (f"host {_shown(name)}: no user name here; write the Mac's name alone and give its "
                "user in ~/.ssh/config (Host NAME / User USER)")
    if len(name) <= 253 and _HOST_NAME.fullmatch(name):
        return None
    try:
        if "%" not in name:
            ipaddress.ip_address(name)
            return None
    except ValueError:
        pass
    return (f"host {_shown(name)} is not a host name (letters, digits, '-', '_' and '.') nor an IP "
            "address; write the Mac's name (studio.local) or its address")


def read_hostfile_text(path: str | Path) -> str:
    """The text of a hostfile, for every reader of one; a missing, huge or binary file is a
    LaunchError in one line, not a traceback."""
    p = Path(path)
    if not p.is_file():
        raise LaunchError(f"hostfile {p}: not found (or not a file)")
    try:
        data = gate.read_bytes(p, "hostfile", MAX_HOSTFILE_BYTES)
    except gate.FileRefused as e:
        raise LaunchError(f"hostfile {p}: {re.sub(r'^hostfile (is )?', '', e.problem)}; a hostfile has one `NAME slots=N` "
                          "line per Mac") from None
    bad = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e.start if bad < 0 else min(bad, e.start)
    if bad >= 0:
        line = data[:bad].count(b"\n") + 1
        raise LaunchError(f"hostfile {p}:{line}: binary data, not text; a hostfile "
                          "has one `NAME slots=N` line per Mac")
    return text


def read_hostfile(path: str | Path) -> list[HostEntry]:
    """The hosts of an Open MPI hostfile (`NAME [slots=N] [max_slots=N]` lines, `#` comments),
    each name checked by `host_name_problem` and each count at least 1, so that no reader of
    a hostfile hands ssh or mpirun a name that is an option or a job with no ranks."""
    p = Path(path)
    hosts = []
    for n, raw in enumerate(read_hostfile_text(p).split("\n"), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *opts = line.split()
        problem = host_name_problem(name)
        if problem:
            raise LaunchError(f"hostfile {p}:{n}: {problem}")
        slots = 1
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in ("slots", "max_slots", "max-slots"):
                raise LaunchError(f"hostfile {p}:{n}: cannot read {_shown(opt)} (expected slots=N)")
            if not _COUNT.fullmatch(value) or int(value) < 1:
                raise LaunchError(f"hostfile {p}:{n}: host {_shown(name)}: {_shown(opt)} is not a number of "
                                  f"ranks; write {key}=N with N at least 1 (remove the line to leave the host out)")
            if int(value) > MAX_SLOTS:
                raise LaunchError(f"hostfile {p}:{n}: host {_shown(name)}: {_shown(opt)} is more ranks than one "
                                  f"machine runs (at most {MAX_SLOTS}); write the number of ranks for that Mac, "
                                  "usually 1")
            slots = int(value) if key == "slots" else slots
        hosts.append(HostEntry(name, slots))
    if not hosts:
        raise LaunchError(f"hostfile {p}: lists no hosts; write one `NAME slots=N` line per Mac")
    return hosts


def hostfile_text(hosts: Iterable[HostEntry]) -> str:
    """An Open MPI hostfile of `hosts`, in this order (the first runs rank 0)."""
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)


@dataclass(frozen=True)
class Reply:
    """How a script run on a host ended; `returncode` None: no end within the timeout."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""

    @property
    def why(self) -> str:
        """A failure in one line: the last line the script wrote to stderr, or its exit status."""
        return (self.stderr.strip().splitlines() or [f"exit {self.returncode}"])[-1]


@dataclass
class Remote:
    """How to run a shell command on a job's host: ssh, or the namespace rig's stand-in."""

    prefix: Sequence[str] = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5")
    local_names: frozenset[str] = frozenset()

    def command(self, host: str, script: str) -> list[str]:
        if host in self.local_names:
            return ["sh", "-c", script]
        return [*self.prefix, "--", host, script]

    def run(self, host: str, script: str, timeout: float) -> Reply:
        """Run `script` on `host` (no stdin), waiting at most `timeout` seconds for it to end."""
        try:
            r = subprocess.run(self.command(host, script), capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return Reply(None)
        return Reply(r.returncode, r.stdout, r.stderr)


def _connect(name: str, port: int, timeout: float) -> tuple[str | None, OSError | None]:
    """(address, error) of a TCP connection to the host's `port`: no address when the name does
    not resolve; no error when it connected, or when the host is this machine (not tried)."""
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return None, None
    if name in LOCAL_NAMES or addr.startswith("127."):
        return addr, None
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return addr, None
    except OSError as e:
        return addr, e


def check_host(name: str, remote: Remote | None = None, port: int = 22, timeout: float = 5.0) -> str | None:
    """None if `name` can take part; otherwise what is wrong with it, in words.

    With a `remote` (an ssh stand-in such as the namespace rig's), the host is asked to
    run `true` through it, the same path mpirun's daemons take; otherwise the name must
    resolve and (for a remote host) accept connections on the ssh port."""
    if remote is not None:
        reply = remote.run(name, "true", timeout=timeout + 5)
        if reply.returncode is None:
            return f"host '{name}' does not answer through {remote.prefix[0]} within {timeout + 5:.0f}s"
        if reply.returncode != 0:
            return f"host '{name}' cannot run commands through {remote.prefix[0]} ({reply.why})"
        return None
    addr, err = _connect(name, port, timeout)
    if addr is None:
        return f"host '{name}' does not resolve (check the name, /etc/hosts or Bonjour: try '{name}.local')"
    if err is None:
        return None
    return (f"host '{name}' ({addr}) is unreachable on ssh port {port} ({err.strerror or err}); "
            "is it awake, on the network, with Remote Login enabled?")


def network_problem(name: str, timeout: float = NETWORK_TIMEOUT_S) -> str | None:
    """None if the host's address answers on the network (a TCP connect to its ssh port
    succeeds or is refused), else why not. The namespace rig's ssh stand-in reaches a host
    without the network, so a cut cable shows only here."""
    addr, err = _connect(name, 22, timeout)
    if addr is None:
        return "does not resolve"
    if err is None or isinstance(err, ConnectionRefusedError):
        return None
    return f"unreachable over the network ({err.strerror or err})"


def host_answers(name: str, remote: Remote) -> bool:
    """Whether the host is on the network and runs commands through `remote`."""
    return network_problem(name) is None and check_host(name, remote, timeout=5.0) is None
