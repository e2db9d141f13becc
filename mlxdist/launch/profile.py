"""Cluster profiles: what `launch/mlxrun` needs to know about a cluster that a tool brought up.

A tool that makes a cluster (the namespace rig: `launch/simcluster up`) writes `launch.json`
into the cluster's directory; `mlxrun --simcluster NAME|DIR [--hosts 1,2]` and
`mlxrun --hostfile DIR/hostfile` read it. The launch wing owns this format, so the launcher
never imports the tool that wrote it:

    {"name": "mlxsim", "hostfile": "hostfile", "ssh_agent": "ssh-agent", "network": "10.77.0.0/24",
     "hosts": [{"name": "mlxsim1", "ip": "10.77.0.1", "slots": 1, "aliases": ["mlxsim-1"]}, ...]}

Paths are relative to the profile's directory (or absolute). A cluster called NAME lives in
CLUSTERS_ROOT/NAME, or leaves a pointer there to the directory it was made in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .hosts import HostEntry, LaunchError, hostfile_text

PROFILE_FILE = "launch.json"
CLUSTERS_ROOT = Path("/tmp/mlxdist-simcluster")


def pointer(name: str) -> Path:
    """Where a cluster kept outside CLUSTERS_ROOT leaves its address, so that
    `mlxrun --simcluster NAME` finds it by name alone."""
    return CLUSTERS_ROOT / f"{name}.state-dir"


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
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.path)
        return self.path

    @classmethod
    def load(cls, directory: str | Path) -> ClusterProfile:
        d = Path(directory)
        try:
            data = json.loads((d / PROFILE_FILE).read_text())
            hosts = [ProfileHost(h["name"], h["ip"], int(h.get("slots", 1)), tuple(h.get("aliases", ())))
                     for h in data["hosts"]]
            return cls(data["name"], d, d / data["hostfile"], hosts,
                       d / data["ssh_agent"] if data.get("ssh_agent") else None, data.get("network"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LaunchError(f"cluster profile {d / PROFILE_FILE}: cannot read it ({e})") from None

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
