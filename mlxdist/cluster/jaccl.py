"""`dist.backend=mlx-jaccl`: MLX's RDMA-over-Thunderbolt-5 backend, bootstrapped over MPI.

JACCL needs, on every rank, `MLX_RANK`, `MLX_JACCL_COORDINATOR` (an ip:port on rank 0
that all ranks reach over ordinary IP) and `MLX_IBV_DEVICES` (a path to a JSON matrix:
row i, column j = the RDMA device rank i uses to reach rank j, null on the diagonal).
`mlx.launch` writes these from a hostfile made by `mlx.distributed_config`, which probes
the Thunderbolt topology. Under mpirun we do the same: ranks all-gather what they know
about themselves, every rank builds the same matrix from the hostfile (or, for two
machines, from the one device each sees), and MLX connects.

It only works on Macs with macOS 26.2+, RDMA enabled and an MLX build with the backend;
anywhere else the user gets one line saying which of these is missing, on which host.

The Mac's version is read here for all of mlxdist (`macos_version`, the launcher's preflight
too): `platform.mac_ver()` alone is not enough, since a Python built against an older SDK is
told "16.0" on macOS 26 (Apple's compatibility mode); `sw_vers -productVersion` run with
`SYSTEM_VERSION_COMPAT=0` gives the real one.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .. import gate

MIN_MACOS = (26, 2)
# A Mac upgraded to 26.2 after mlx was installed keeps the wheel without jaccl (same version
# number, so `pip install -U mlx` does nothing): only a forced reinstall fetches the 26.x build.
JACCL_REINSTALL = "pip install --force-reinstall --no-cache-dir mlx mlx-metal"
# `macos_version`'s answer on a Mac whose version could not be read at all.
UNKNOWN_MACOS = "unknown"

Device = str | list[str] | None

_MLX_SETTING = re.compile(r"MLX_[A-Z0-9_]+")


class MlxHost(NamedTuple):
    host: str
    ips: list[str]
    rdma: list[Device]


@dataclass
class MlxHostfile:
    hosts: list[MlxHost]
    backend: str = ""
    envs: list[str] = field(default_factory=list)


def read_mlx_hostfile(path: str | Path) -> MlxHostfile:
    """Read a hostfile written by `mlx.distributed_config` (or by hand for `mlx.launch`).

    Either {"backend": ..., "envs": [...], "hosts": [{"ssh", "ips", "rdma"}, ...]} or a
    bare list of host entries; one entry per rank, in rank order.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"hostfile {p}: not found")
    try:
        data = gate.read_json(p, "hostfile", max_bytes=1 << 20)
    except gate.FileRefused as e:
        raise ValueError(f"hostfile {p}: {re.sub(r'^hostfile (is )?', '', e.problem)}; write it with "
                         "mlx.distributed_config --output") from None
    if isinstance(data, dict):
        entries, backend, envs = data.get("hosts"), data.get("backend", ""), data.get("envs", [])
    else:
        entries, backend, envs = data, "", []
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"hostfile {p}: lists no hosts (expected a 'hosts' list of {{\"ssh\": NAME, \"ips\": [...]}})")
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise ValueError(f"hostfile {p}: 'envs' must be a list of NAME=VALUE strings")
    for e in envs:
        # Every rank starts with these: LD_PRELOAD or PYTHONPATH from a file would run its code.
        name = e.split("=", 1)[0]
        if not _MLX_SETTING.fullmatch(name):
            raise ValueError(f"hostfile {p}: 'envs' sets {name!r}; a hostfile may carry MLX_* settings only: "
                             f"give it on the command line (-x {name}=VALUE) if you mean it")
    hosts = []
    for i, h in enumerate(entries):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str) or not h["ssh"]:
            raise ValueError(f"hostfile {p}: host {i} has no 'ssh' name")
        ips, rdma = h.get("ips", []), h.get("rdma", [])
        if not isinstance(ips, list) or not all(isinstance(x, str) for x in ips):
            raise ValueError(f"hostfile {p}: host {i} ({h['ssh']}): 'ips' must be a list of addresses")
        if not isinstance(rdma, list):
            raise ValueError(f"hostfile {p}: host {i} ({h['ssh']}): 'rdma' must be a list, one entry per host")
        hosts.append(MlxHost(h["ssh"], ips, rdma))
    return MlxHostfile(hosts, str(backend or ""), envs)


def is_mlx_hostfile(path: str | Path) -> bool:
    """JSON hostfiles start with '{' or '['; Open MPI ones with a host name."""
    if not Path(path).is_file():  # a FIFO would block this read for good
        return False
    try:
        with open(path, "rb") as f:  # the head only: the file may be large, or not a hostfile
            head = f.read(4096).lstrip()[:1]
    except OSError:
        return False
    return head in (b"{", b"[")


def to_openmpi_hostfile(hf: MlxHostfile) -> str:
    """The same hosts as an Open MPI hostfile (one rank per entry, as mlx.launch does)."""
    counts: dict[str, int] = {}
    for h in hf.hosts:
        counts[h.host] = counts.get(h.host, 0) + 1
    return "".join(f"{name} slots={n}\n" for name, n in counts.items())


@dataclass
class RankFacts:
    """What one rank knows about itself, all-gathered before the matrix is built."""
    host: str
    ip: str
    macos: str | None
    jaccl_built: bool
    devices: list[str]


def macos_tuple(text: str | None) -> tuple[int, ...]:
    """"26.2.1" -> (26, 2, 1); () when `text` is no version, or tells no version. Compatibility
    readings (what an interpreter built against an older SDK is told): "16.x" is macOS 26 or
    newer (there was no macOS 16), so (26,); "10.16" is any of macOS 11 onwards, so ()."""
    out: list[int] = []
    for part in (text or "").strip().split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    if out[:1] == [16]:
        return (26,)
    if out[:2] == [10, 16]:
        return ()
    return tuple(out)


def macos_version(platform: str, mac_ver: str = "", sw_vers: str | None = None) -> str | None:
    """The Mac's real macOS version ("26.2"), None where `platform` (a `sys.platform`) is not a Mac.

    `mac_ver` is `platform.mac_ver()[0]`, `sw_vers` the output of `sw_vers -productVersion`
    (None: not run, or it failed). sw_vers wins: `mac_ver` says "16.0" on macOS 26 when Python
    was built against an older SDK (`macos_tuple` still reads that as 26 or newer). Without
    either, `UNKNOWN_MACOS`."""
    if platform != "darwin":
        return None
    for text in (sw_vers, mac_ver):
        if macos_tuple(text):
            return text.strip()
    return UNKNOWN_MACOS


def read_sw_vers(platform: str = sys.platform, run=subprocess.run) -> str | None:
    """What `sw_vers -productVersion` prints on a Mac, asked for the real version
    (`SYSTEM_VERSION_COMPAT=0`); None elsewhere or when it cannot run. `run`: subprocess.run."""
    if platform != "darwin":
        return None
    try:
        return run(["sw_vers", "-productVersion"], capture_output=True, text=True, timeout=10,
                   env={**os.environ, "SYSTEM_VERSION_COMPAT": "0"}).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def this_macos() -> str | None:
    """This machine's macOS version (`macos_version`), None when it is not a Mac."""
    return macos_version(sys.platform, platform.mac_ver()[0], read_sw_vers(sys.platform))


def local_facts(ip: str | None = None) -> RankFacts:
    import mlx.core as mx

    macos = this_macos()
    devices: list[str] = []
    ibv = shutil.which("ibv_devices")
    if ibv:
        try:
            out = subprocess.run([ibv], capture_output=True, text=True, timeout=10).stdout
            devices = sorted(w for w in out.split() if w.startswith("rdma_"))
        except (OSError, subprocess.SubprocessError):
            devices = []
    return RankFacts(host=socket.gethostname(), ip=ip or "", macos=macos,
                     jaccl_built=bool(mx.distributed.is_available(backend="jaccl")), devices=devices)


def missing(facts: RankFacts) -> str | None:
    """One line saying why JACCL cannot run on this rank, or None."""
    where = f"dist.backend=mlx-jaccl: host {facts.host}"
    if facts.macos is None:
        return (f"{where} is not a Mac (JACCL is RDMA over Thunderbolt 5 between Macs); "
                "use dist.backend=mlx-ring or mpi4py here")
    if macos_tuple(facts.macos) < MIN_MACOS:
        return f"{where} runs macOS {facts.macos}; RDMA over Thunderbolt needs macOS 26.2 or newer"
    if not facts.jaccl_built:
        return (f"{where}: this MLX build has no jaccl backend (an mlx installed before the Mac ran macOS 26.2 "
                "stays without it, and pip install -U mlx keeps it, same version); reinstall it: "
                f"{JACCL_REINSTALL}")
    if not facts.devices:
        return (f"{where} shows no rdma_* devices (ibv_devices); enable RDMA (rdma_ctl enable in "
                "Recovery) and connect the Thunderbolt 5 cables")
    return None


def check(all_facts: list[RankFacts]) -> str | None:
    """The first rank's problem, in rank order, so every rank reports the same line."""
    for f in all_facts:
        problem = missing(f)
        if problem:
            return problem
    return None


def device_matrix(all_facts: list[RankFacts], hostfile: MlxHostfile | None = None,
                  source: str = "hostfile") -> list[list[Device]]:
    """Row i, column j: the RDMA device rank i uses to reach rank j.

    From a `mlx.distributed_config` hostfile when there is one: its rows are matched to
    ranks by host name (mpirun may order ranks differently from the file). Without one,
    only two ranks can be guessed: each uses the one rdma_* device it sees.
    """
    n = len(all_facts)
    if hostfile is None:
        if n == 2 and all(len(f.devices) == 1 for f in all_facts):
            return [[None, all_facts[0].devices[0]], [all_facts[1].devices[0], None]]
        raise ValueError(f"dist.backend=mlx-jaccl with {n} ranks needs the device matrix: "
                         "run mlx.distributed_config --backend jaccl --output hosts.json and launch with it")
    names = [h.host for h in hostfile.hosts]
    if len(names) != n:
        raise ValueError(f"{source}: lists {len(names)} hosts but the job has {n} ranks")
    short = [x.split(".")[0] for x in names]
    order = []
    for f in all_facts:
        candidates = [i for i, (x, s) in enumerate(zip(names, short, strict=True))
                      if (x == f.host or s == f.host.split(".")[0]) and i not in order]
        if not candidates:
            raise ValueError(f"{source}: rank on host {f.host} has no entry (hosts: {', '.join(names)})")
        order.append(candidates[0])
    matrix = []
    for i in range(n):
        row = hostfile.hosts[order[i]].rdma
        if len(row) != n:
            raise ValueError(f"{source}: host {names[order[i]]} lists {len(row)} rdma entries, expected {n} "
                             "(one per host, null for itself)")
        matrix.append([row[order[j]] for j in range(n)])
    for i in range(n):
        if matrix[i][i] is not None:
            raise ValueError(f"{source}: host {all_facts[i].host}: its own rdma entry must be null")
        for j in range(n):
            if i != j and not matrix[i][j]:
                raise ValueError(f"{source}: no RDMA device from {all_facts[i].host} to {all_facts[j].host}; "
                                 "rerun mlx.distributed_config (is every pair cabled?)")
    return matrix


def jaccl_env(all_facts: list[RankFacts], matrix: list[list[Device]], rank: int, port: int,
              devices_path: str) -> dict[str, str]:
    """The environment MLX's jaccl backend reads, for `rank`; the matrix goes to `devices_path`."""
    coordinator = all_facts[0].ip
    if not coordinator:
        raise ValueError(f"dist.backend=mlx-jaccl: rank 0 ({all_facts[0].host}) has no IP address the others can reach")
    return {"MLX_RANK": str(rank), "MLX_JACCL_COORDINATOR": f"{coordinator}:{port}",
            "MLX_IBV_DEVICES": devices_path}


def bootstrap(world, ip: str, hostfile: str | None = None, port: int | None = None):
    """Check, build the matrix, set the environment, connect. Every rank gets the same
    one-line error when a host lacks something. `world` is mlxdist.cluster.world.World."""
    import mlx.core as mx

    facts = world.allgather(local_facts(ip))
    problem = check(facts)
    if problem:
        raise RuntimeError(problem)
    hf = read_mlx_hostfile(hostfile) if hostfile else None
    matrix = device_matrix(facts, hf, source=f"hostfile {hostfile}")
    if port is None:
        s = socket.socket()
        s.bind((ip, 0))
        port = s.getsockname()[1]
        s.close()
    port = world.bcast(port)
    fd, path = tempfile.mkstemp(prefix=f"mlxdist-jaccl-{world.rank}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(matrix, f)
    os.environ.update(jaccl_env(facts, matrix, world.rank, port, path))
    if hf is not None:
        for e in hf.envs:
            key, _, value = e.partition("=")
            os.environ.setdefault(key, value)
    with world.watch("jaccl backend connect"):
        group = mx.distributed.init(strict=True, backend="jaccl")
    os.unlink(path)
    return group
