"""Cluster profiles: what `launch/mlxrun` needs to know about a cluster that a tool brought up.

A tool that makes a cluster (the namespace rig: `launch/simcluster up`) writes `launch.json`
into the cluster's directory; `mlxrun --simcluster NAME|DIR [--hosts 1,2]` and
`mlxrun --hostfile DIR/hostfile` read it. The launch wing owns this format, so the launcher
never imports the tool that wrote it:

    {"name": "mlxsim", "hostfile": "hostfile", "ssh_agent": "ssh-agent", "network": "10.77.0.0/24",
     "hosts": [{"name": "mlxsim1", "ip": "10.77.0.1", "slots": 1, "aliases": ["mlxsim-1"]}, ...]}

Paths are relative to the profile's directory (or absolute). A cluster called NAME lives in
CLUSTERS_ROOT/NAME, or leaves a pointer there to the directory it was made in.

A profile names a program that mlxrun runs (the ssh stand-in), and it can sit beside a hostfile
that came from anywhere. So `write` signs it with a key private to this user on this machine
(KEY_FILE), bound to the profile's directory, and the launcher runs a profile's agent only when
that signature holds and the agent is a file of this user's inside that directory that no one
else may change (`ClusterProfile.agent_problem`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import gate
from .hosts import HostEntry, LaunchError, hostfile_text

PROFILE_FILE = "launch.json"
CLUSTERS_ROOT = Path("/tmp/mlxdist-simcluster")
KEY_FILE = Path("mlxdist") / "cluster-profile.key"
_KEY_BYTES = 32


def _key_path() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / KEY_FILE


def _private(st: os.stat_result, mask: int = 0o022) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & mask


def _signing_key(create: bool) -> bytes | None:
    """This user's profile key (made on first use when `create`); None when there is none, or
    when the file is not this user's alone (then no profile is trusted)."""
    try:
        path = _key_path()
        if create and not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(_KEY_BYTES))
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (OSError, RuntimeError):
        return None
    with os.fdopen(fd, "rb") as f:
        key = f.read(_KEY_BYTES + 1)
        ok = _private(os.fstat(f.fileno()), 0o077) and stat.S_ISREG(os.fstat(f.fileno()).st_mode)
    return key if ok and len(key) == _KEY_BYTES else None


def _signature(key: bytes, directory: Path, data: dict) -> str:
    body = json.dumps({"directory": str(directory.resolve()), "profile": data}, sort_keys=True)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def pointer(name: str) -> Path:
    """Where a cluster kept outside CLUSTERS_ROOT leaves its address, so that
    `mlxrun --simcluster NAME` finds it by name alone."""
    return CLUSTERS_ROOT / f"{name}.state-dir"


_NAME = gate.Str(255)
_PROFILE = gate.Dict({
    "name": _NAME, "hostfile": _NAME, "ssh_agent": gate.Maybe(_NAME), "network": gate.Maybe(gate.Tree()),
    "signature": gate.Maybe(gate.Str(200)),
    "hosts": gate.List(gate.Dict({"name": _NAME, "ip": _NAME, "slots": gate.Int(lo=1, hi=1024),
                                  "aliases": gate.List(_NAME, max_len=64)}, required=("name", "ip"),
                                 values=gate.Tree()), max_len=10_000)},
    required=("name", "hostfile", "hosts"), values=gate.Tree())


def find_dir(name_or_dir: str, marker: str = PROFILE_FILE) -> Path:
    """The directory of the cluster that is up under this name (in CLUSTERS_ROOT, or wherever
    its pointer says) or in this directory: the first that holds `marker`. A LookupError says
    how to make one."""
    candidates = [Path(name_or_dir)] if "/" in name_or_dir else []
    candidates.append(CLUSTERS_ROOT / name_or_dir)
    if "/" not in name_or_dir and pointer(name_or_dir).is_file():
        candidates.append(Path(pointer(name_or_dir).read_text().strip()))
    for d in candidates:
        if (d / marker).is_file():
            return d
    raise LookupError(f"no simulated cluster '{name_or_dir}' (looked in "
                      f"{', '.join(map(str, candidates))}); make one with `sudo launch/simcluster up --hosts 2`")


@dataclass(frozen=True)
class ProfileHost:
    name: str  # the host's own name
    ip: str  # what its hostfile lines say
    slots: int = 1
    aliases: tuple[str, ...] = ()  # other names a user may pick it by


@dataclass
class ClusterProfile:
    name: str
    directory: Path
    hostfile: Path
    hosts: list[ProfileHost]
    ssh_agent: Path | None = None  # what mpirun runs instead of ssh (plm_ssh_agent)
    network: str | None = None  # interface or CIDR for MPI traffic
    signed: bool = False  # read back with this user's signature (see the module's doc)

    @property
    def path(self) -> Path:
        return self.directory / PROFILE_FILE

    def write(self) -> Path:
        """Write `launch.json` (by rename: a launcher reading now sees the old or the new one)."""

        def rel(p: Path | None) -> str | None:
            return None if p is None else str(p.relative_to(self.directory) if p.is_relative_to(self.directory)
                                              else p.resolve())

        data = {"name": self.name, "hostfile": rel(self.hostfile), "ssh_agent": rel(self.ssh_agent),
                "network": self.network,
                "hosts": [{"name": h.name, "ip": h.ip, "slots": h.slots, "aliases": list(h.aliases)}
                          for h in self.hosts]}
        key = _signing_key(create=True)
        if key is not None:
            data["signature"] = _signature(key, self.directory, data)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.path)
        return self.path

    @classmethod
    def load(cls, directory: str | Path) -> ClusterProfile:
        """A profile is a file from elsewhere until its signature says otherwise: read through
        the gate, paths inside it are plain names."""
        d = Path(directory)
        try:
            data = gate.read_json(d / PROFILE_FILE, "cluster profile", _PROFILE, max_bytes=1 << 20)
            signature = data.pop("signature", None)
            key = _signing_key(create=False)
            signed = (isinstance(signature, str) and key is not None
                      and hmac.compare_digest(signature, _signature(key, d, data)))
            hosts = [ProfileHost(h["name"], h["ip"], int(h.get("slots", 1)), tuple(h.get("aliases", ())))
                     for h in data["hosts"]]
            return cls(data["name"], d, d / data["hostfile"], hosts,
                       d / data["ssh_agent"] if data.get("ssh_agent") else None, data.get("network"), signed)
        except gate.FileRefused as e:
            raise LaunchError(f"cluster profile {e}") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LaunchError(f"cluster profile {d / PROFILE_FILE}: cannot read it ({e})") from None

    def agent_problem(self) -> str | None:
        """Why mlxrun may not run this profile's ssh agent (None: it may, or it names none).
        The agent runs as this user with the hosts' names as arguments; a profile that merely
        lies beside a hostfile, from a download or another user, must not choose it."""
        if self.ssh_agent is None:
            return None
        where = f"cluster profile {self.path}"
        if not self.signed:
            return f"{where} was not written by `launch/simcluster` on this machine as this user"
        try:
            directory = self.directory.resolve(strict=True)
            agent = self.ssh_agent.resolve(strict=True)
            if not agent.is_relative_to(directory):
                return f"{where}: its ssh agent {self.ssh_agent} lies outside {self.directory}"
            st, dir_st = agent.stat(), directory.stat()
        except OSError as e:
            return f"{where}: its ssh agent {self.ssh_agent} cannot be read ({e.strerror or e})"
        if not stat.S_ISREG(st.st_mode) or not _private(st) or not _private(dir_st):
            return (f"{where}: its ssh agent {self.ssh_agent} or its directory belongs to another user or "
                    "others may change it")
        return None

    def index(self, pick: str | int) -> int:
        """1-based position of a host picked as a user has it at hand: 1..N, its name, its IP
        or an alias; a KeyError names what does not fit."""
        if isinstance(pick, int) or pick.isdigit():
            if not 1 <= int(pick) <= len(self.hosts):
                raise KeyError(f"host {pick!r} not in 1..{len(self.hosts)} of cluster {self.name}")
            return int(pick)
        for i, h in enumerate(self.hosts, 1):
            if pick in (h.name, h.ip, *h.aliases):
                return i
        raise KeyError(f"unknown host {pick!r} in cluster {self.name}")

    def subset_hostfile(self, picks: Sequence[str | int]) -> Path:
        """A hostfile of some hosts in the cluster's order, kept beside its own (`hostfile-1-3`)."""
        idx = sorted(dict.fromkeys(self.index(p) for p in picks))
        path = self.directory / f"hostfile-{'-'.join(map(str, idx))}"
        path.write_text(hostfile_text(HostEntry(self.hosts[i - 1].ip, self.hosts[i - 1].slots) for i in idx))
        return path
