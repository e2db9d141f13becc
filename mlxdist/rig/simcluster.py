"""A cluster of real hosts on one Linux machine, for testing distributed training.

Each host is a network namespace with its own address, its own hostname (a UTS
namespace entered per command) and its own link to a shared bridge. That is enough
for Open MPI to treat the hosts as separate nodes (one shared hostname made it treat
them as one node and crash), and it lets tests break one host's network or CPU while
the others keep running, which a single-host run cannot show.

Everything here shells out to iproute2 (`ip`, `tc`), `unshare` and the cgroup
filesystem, so it needs root on Linux; `available()` says so instead of failing.
No MLX import: the tool must work before the rest of the package does.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..launch.hosts import HostEntry, hostfile_text
from ..launch.profile import (
    CLUSTERS_ROOT,
    PROFILE_FILE,
    ClusterProfile,
    ProfileHost,
    find_dir,
    pointer,
)

# Where `launch/mlxrun --simcluster NAME` looks for a cluster by name.
DEFAULT_STATE_ROOT = CLUSTERS_ROOT
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "mlxdist-simcluster"
ETC_NETNS = Path("/etc/netns")
CFS_PERIOD_US = 100_000
# Read by mlxdist.training.faults in every process started on a host slowed with `--compute`.
COMPUTE_SCALE_VAR = "MLXDIST_RIG_COMPUTE_SCALE"

_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,30}$")
# ssh options that take a value; the stand-in must drop the value with the option.
_SSH_VALUE_OPTS = "BbcDEeFIiJLlmOopQRSWw"


def link_limit_seconds(nbytes: int, n_ranks: int, rate_bits_per_s: float) -> float:
    """Lower bound on a ring all-reduce time over links capped at `rate_bits_per_s`.

    A ring all-reduce sends 2*(n-1)/n of the buffer over each link, so no
    implementation can beat this; benchmarks report measured time against it.
    """
    if n_ranks <= 1:
        return 0.0
    return 2.0 * (n_ranks - 1) / n_ranks * nbytes * 8.0 / rate_bits_per_s


_RATE_UNITS = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 1024.0,
    "mibit": 1024.0**2,
    "gibit": 1024.0**3,
    "bps": 8.0,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}


def parse_rate(rate: str) -> float:
    """Bits per second for a tc-style rate ("100mbit", "1gbit"), so benchmarks can
    compare a measured time with the cap they asked `tc` for."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", rate)
    if not m:
        raise ValueError(f"bad rate {rate!r}")
    unit = m.group(2).lower() or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(f"bad rate unit in {rate!r}")
    return float(m.group(1)) * _RATE_UNITS[unit]


def _run(cmd: Sequence[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(cmd), check=check, text=True, capture_output=True, **kw
    )


def _quiet(cmd: Sequence[str]) -> bool:
    """Teardown steps must go on past a step that fails (the thing may be gone)."""
    try:
        return _run(cmd, check=False).returncode == 0
    except OSError:
        return False


_AVAILABLE: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether this machine can make namespace hosts, and if not, how to fix it.

    Tests call this and skip with the reason, so a developer without root sees what
    to do rather than a wall of `ip` errors.
    """
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    how = (
        "simcluster needs Linux, root and iproute2 + util-linux "
        "(apt-get install iproute2 util-linux); run the tests as root"
    )
    if not sys.platform.startswith("linux"):
        _AVAILABLE = (False, f"not Linux; {how}")
    elif os.geteuid() != 0:
        _AVAILABLE = (False, f"not root; {how}")
    else:
        missing = [t for t in ("ip", "tc", "unshare", "hostname") if not shutil.which(t)]
        if missing:
            _AVAILABLE = (False, f"missing {', '.join(missing)}; {how}")
        else:
            probe = f"mlxdistprobe-{os.getpid()}"
            res = _run(["ip", "netns", "add", probe], check=False)
            _quiet(["ip", "netns", "del", probe])
            if res.returncode != 0:
                _AVAILABLE = (
                    False,
                    f"cannot create a network namespace ({res.stderr.strip()}); {how}",
                )
            else:
                _AVAILABLE = (True, "")
    return _AVAILABLE


_QDISCS: dict[str, bool] = {}


def qdisc_supported(kind: str) -> bool:
    """Whether the kernel has qdisc `kind` (e.g. "netem", "tbf"), tried on a
    throwaway namespace's loopback: some kernels (the project's VMs) ship tbf but
    not netem, and a shaping request should fail with that, not an `ip` error."""
    if kind not in _QDISCS:
        probe = f"mlxdistq-{os.getpid()}"
        ok = _quiet(["ip", "netns", "add", probe])
        args = {"netem": ["delay", "1ms"], "tbf": ["rate", "1gbit", "burst", "64kb",
                                                 "latency", "50ms"]}.get(kind, [])
        ok = ok and _quiet(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev",
                            "lo", "root", kind, *args])
        _quiet(["ip", "netns", "del", probe])
        _QDISCS[kind] = ok
    return _QDISCS[kind]


def _cgroup_mode() -> str | None:
    """Which CPU-limit mechanism works here: cgroup v1 cpu controller, v2, or none."""
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
        return "v1"
    ctrl = CGROUP_V2_ROOT / "cgroup.controllers"
    if ctrl.exists() and "cpu" in ctrl.read_text().split():
        return "v2"
    return None


class SimCluster:
    """N hosts `{name}1..{name}N` at `{subnet}.1..N`, bridged to the root namespace
    at `{subnet}.254`, where `mpirun` itself runs and reaches them.

    Use as a context manager: teardown runs on exit, at interpreter exit and on
    SIGTERM/SIGINT, because leftover namespaces and bridges break the next run.
    """

    def __init__(
        self,
        n_hosts: int,
        name: str = "mlxsim",
        subnet: str = "10.77.0",
        rate: str | None = None,
        delay: str | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        slots: int = 1,
    ) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(
                f"cluster name {name!r} must be lowercase letters/digits, starting "
                "with a letter (it becomes hostnames and interface names)"
            )
        if not 0 <= n_hosts <= 253:
            raise ValueError("n_hosts must be in 0..253 (one /24, .254 is the bridge)")
        parts = subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise ValueError(f"subnet {subnet!r} must be the first three octets, e.g. 10.77.0")
        self.n_hosts = n_hosts
        self.name = name
        self.subnet = subnet
        self.rate = rate
        self.delay = delay
        self.slots = slots
        self.state_dir = Path(state_dir) if state_dir else DEFAULT_STATE_ROOT / name
        # Interface names are capped at 15 chars: long names get a short hashed tag.
        if len(name) <= 9:
            self.tag = name
        else:
            # The dash (never in a name) keeps hashed tags apart from short names.
            self.tag = name[:4] + "-" + hashlib.sha1(name.encode()).hexdigest()[:4]
        self.bridge = f"{self.tag}br"
        self._host_state: dict[str, dict[str, Any]] = {h: {} for h in self.hosts}
        self._prev_handlers: dict[int, Any] = {}
        self._launched: list[subprocess.Popen] = []
        self._is_up = False

    # ----- naming -----------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        return [f"{self.name}{i}" for i in range(1, self.n_hosts + 1)]

    @property
    def cidr(self) -> str:
        return f"{self.subnet}.0/24"

    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.254"

    @property
    def hostfile(self) -> Path:
        return self.state_dir / "hostfile"

    @property
    def ssh_agent(self) -> Path:
        return self.state_dir / "ssh-agent"

    @property
    def hosts_file(self) -> Path:
        return self.state_dir / "hosts"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def profile_file(self) -> Path:
        return self.state_dir / PROFILE_FILE

    def profile(self) -> ClusterProfile:
        """What `launch/mlxrun` needs to launch onto this cluster (`up` writes it to launch.json)."""
        hosts = [ProfileHost(h, self.ip(h), self.slots, (self.netns(h),)) for h in self.hosts]
        return ClusterProfile(self.name, self.state_dir, self.hostfile, hosts, self.ssh_agent, self.cidr)

    def _index(self, host: str | int) -> int:
        """Accept what a user has at hand: a hostname, an IP, a netns name or 1..N."""
        if isinstance(host, int) or (isinstance(host, str) and host.isdigit()):
            i = int(host)
        else:
            m = (
                re.fullmatch(re.escape(self.name) + r"-?(\d+)", host)
                or re.fullmatch(re.escape(self.subnet) + r"\.(\d+)", host)
            )
            if not m:
                raise KeyError(f"unknown host {host!r} in cluster {self.name}")
            i = int(m.group(1))
        if not 1 <= i <= self.n_hosts:
            raise KeyError(f"host {host!r} not in 1..{self.n_hosts} of cluster {self.name}")
        return i

    def hostname(self, host: str | int) -> str:
        return f"{self.name}{self._index(host)}"

    def ip(self, host: str | int) -> str:
        return f"{self.subnet}.{self._index(host)}"

    def netns(self, host: str | int) -> str:
        # The dash keeps cluster "a" host 11 apart from cluster "a1" host 1.
        return f"{self.name}-{self._index(host)}"

    def veth(self, host: str | int) -> str:
        """Bridge-side end of the host's link (its `eth0` lives in the namespace)."""
        return f"{self.tag}v{self._index(host)}"

    def cgroup_dir(self, host: str | int) -> Path | None:
        mode = _cgroup_mode()
        if mode == "v1":
            return CGROUP_V1_CPU / CGROUP_PARENT / self.name / self.hostname(host)
        if mode == "v2":
            return CGROUP_V2_ROOT / CGROUP_PARENT / self.name / self.hostname(host)
        return None

    # ----- lifecycle --------------------------------------------------------

    def __enter__(self) -> SimCluster:
        self._install_cleanup()
        try:
            self.up()
        except BaseException:
            self.down()
            self._remove_cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            self._remove_cleanup()

    def _install_cleanup(self) -> None:
        atexit.register(self.down)
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: atexit and __exit__ must do
            self._prev_handlers.clear()

    def _remove_cleanup(self) -> None:
        atexit.unregister(self.down)
        for sig, prev in self._prev_handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, prev)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.down()
        self._remove_cleanup()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def up(self) -> SimCluster:
        """Build the hosts; leftovers of a cluster with this name go first, so a
        crashed earlier run never makes this one fail."""
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        self.down()
        self._check_subnet_free()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            hosts_text = self._hosts_text()
            for h in self.hosts:
                ns, veth = self.netns(h), self.veth(h)
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                      "netns", ns])
                _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.ip(h)}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                # `ip netns exec` bind-mounts /etc/netns/NS/* over /etc, which gives
                # each host name resolution for its peers without touching /etc/hosts.
                etc = ETC_NETNS / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_text)
                (etc / "hostname").write_text(h + "\n")
                self._make_cgroup(h)
                if self.rate or self.delay:
                    self.shape(h, self.rate, self.delay, _save=False)
            self._write_files(hosts_text)
            self._is_up = True
            self._save_state()
        except subprocess.CalledProcessError as e:
            self.down()
            raise RuntimeError(f"simcluster up failed: {shlex.join(e.cmd)}: {e.stderr}") from e
        except BaseException:
            self.down()
            raise
        return self

    def _check_subnet_free(self) -> None:
        """Two bridges with the same /24 in the root namespace would split routing
        between them; refuse rather than build a cluster that half works."""
        out = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
        for line in out.splitlines():
            f = line.split()
            if len(f) >= 4 and f[3].startswith(self.subnet + "."):
                raise RuntimeError(
                    f"subnet {self.subnet}.0/24 already used by {f[1]}; "
                    "pick another subnet= for this cluster"
                )

    def _hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{self.ip(h)} {h}" for h in self.hosts]
        gw = f"{self.bridge_ip} {self.name}-gw"
        root_name = socket.gethostname()
        if root_name and root_name not in self.hosts:
            gw += f" {root_name}"
        lines.append(gw)
        return "\n".join(lines) + "\n"

    def _write_files(self, hosts_text: str) -> None:
        self.hosts_file.write_text(hosts_text)
        # IPs in the hostfile: the root namespace (where mpirun runs) cannot resolve
        # the host names without editing the machine's /etc/hosts. The ranks still
        # see distinct hostnames, which is what Open MPI's node detection uses.
        self.hostfile.write_text(hostfile_text(HostEntry(self.ip(h), self.slots) for h in self.hosts))
        self._write_agent()
        self.profile().write()

    def _write_agent(self) -> None:
        # Replaced by rename: an mpirun starting now reads either the old or the new one.
        tmp = self.ssh_agent.with_name(self.ssh_agent.name + ".tmp")
        tmp.write_text(self._agent_script())
        tmp.chmod(0o755)
        tmp.replace(self.ssh_agent)

    def compute_scale(self, host: str | int) -> float | None:
        return self._host_state.get(self.hostname(host), {}).get("compute_scale")

    def _agent_script(self) -> str:
        cases = []
        for h in self.hosts:
            cg = self.cgroup_dir(h)
            procs = str(cg / "cgroup.procs") if cg else "/dev/null"
            scale = self.compute_scale(h)
            cases.append(
                f"  {h}|{self.ip(h)}|{self.netns(h)}) ns={self.netns(h)}; name={h}; "
                f"cg={shlex.quote(procs)}; scale={'' if scale is None else repr(float(scale))};;"
            )
        # The venv's bin goes first on PATH so `prted` is found even when mpirun was
        # started by absolute path from a shell without the venv activated.
        venv_bin = os.path.dirname(os.path.abspath(sys.executable))
        return f"""#!/bin/sh
# ssh stand-in for mpirun (--prtemca plm_ssh_agent), written by mlxdist.simcluster
# for cluster {self.name}. Usage: ssh-agent [ssh options] HOST COMMAND...
while [ $# -gt 0 ]; do
  case "$1" in
    -[{_SSH_VALUE_OPTS}]) shift 2 ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
case "$host" in
{chr(10).join(cases)}
  *) echo "simcluster ssh-agent: unknown host $host" >&2; exit 255 ;;
esac
PATH={shlex.quote(venv_bin)}:$PATH
export PATH
# Join the host's CPU cgroup here: `ip netns exec` remounts /sys, hiding cgroupfs.
echo $$ 2>/dev/null >"$cg"
# Rig-only compute slowdown (`simcluster slow HOST --compute X`): the daemon started
# here passes its environment on to the ranks it starts on this host.
if [ -n "$scale" ]; then {COMPUTE_SCALE_VAR}=$scale; export {COMPUTE_SCALE_VAR}
else unset {COMPUTE_SCALE_VAR}; fi
exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$1"; shift; eval "$*"' \\
  simcluster "$name" "$@"
"""

    def down(self) -> None:
        """Remove everything a cluster of this name may have left, known or not:
        processes, namespaces, veths, bridge, cgroups and generated files."""
        name_re = re.compile(re.escape(self.name) + r"-(\d+)$")
        nss = []
        if shutil.which("ip"):
            out = _run(["ip", "netns", "list"], check=False).stdout
            nss = [ln.split()[0] for ln in out.splitlines() if ln.split()]
            nss = [ns for ns in nss if name_re.match(ns)]
        self._kill_launched()
        for ns in nss:
            self._kill_ns(ns)
        for cg in self._cgroup_leaves():
            self._kill_cgroup(cg)
        for ns in nss:
            _quiet(["ip", "netns", "del", ns])
        if shutil.which("ip"):
            out = _run(["ip", "-o", "link", "show"], check=False).stdout
            veth_re = re.compile(re.escape(self.tag) + r"v\d+$")
            for line in out.splitlines():
                f = line.split(":")
                if len(f) < 2:
                    continue
                dev = f[1].strip().split("@")[0]
                if veth_re.match(dev) or dev == self.bridge:
                    _quiet(["ip", "link", "del", dev])
        for cg in self._cgroup_leaves():
            with contextlib.suppress(OSError):
                cg.rmdir()
        for base in (CGROUP_V1_CPU, CGROUP_V2_ROOT):
            with contextlib.suppress(OSError):
                (base / CGROUP_PARENT / self.name).rmdir()
        if ETC_NETNS.is_dir():
            for d in ETC_NETNS.iterdir():
                if name_re.match(d.name):
                    shutil.rmtree(d, ignore_errors=True)
        # Shared parents go only when empty, i.e. when no other cluster uses them.
        for d in (CGROUP_V1_CPU / CGROUP_PARENT, CGROUP_V2_ROOT / CGROUP_PARENT, ETC_NETNS):
            with contextlib.suppress(OSError):
                d.rmdir()
        subsets = list(self.state_dir.glob("hostfile-*")) if self.state_dir.is_dir() else []
        for f in (self.hostfile, self.ssh_agent, self.hosts_file, self.state_file, self.profile_file, *subsets):
            with contextlib.suppress(OSError):
                f.unlink()
        with contextlib.suppress(OSError):
            target = Path(pointer(self.name).read_text().strip())
            if target == self.state_dir or not (target / "state.json").is_file():
                pointer(self.name).unlink()
        self._is_up = False

    def _cgroup_leaves(self) -> list[Path]:
        leaves = []
        for base in (CGROUP_V1_CPU, CGROUP_V2_ROOT):
            d = base / CGROUP_PARENT / self.name
            if d.is_dir():
                leaves += [p for p in d.iterdir() if p.is_dir()]
        return leaves

    def _make_cgroup(self, host: str) -> None:
        cg = self.cgroup_dir(host)
        if cg is None:
            return
        if _cgroup_mode() == "v2":
            # v2 only hands the cpu controller down where each parent enables it.
            d = CGROUP_V2_ROOT
            for part in (CGROUP_PARENT, self.name):
                with contextlib.suppress(OSError):
                    (d / "cgroup.subtree_control").write_text("+cpu")
                d = d / part
                d.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (d / "cgroup.subtree_control").write_text("+cpu")
        cg.mkdir(parents=True, exist_ok=True)

    def _kill_launched(self) -> None:
        """A process `popen` started may not have joined its host's namespace yet (its
        wrapper is still exec'ing into `ip netns exec`); it is killed by pid, or it would
        live on in a namespace that no longer has a name."""
        for p in self._launched:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        self._launched.clear()

    @staticmethod
    def _kill_cgroup(cg: Path) -> None:
        for _ in range(50):
            try:
                pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    @staticmethod
    def _ns_pids(ns: str) -> list[int]:
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def _kill_ns(self, ns: str, sig: int = signal.SIGKILL) -> int:
        killed: set[int] = set()
        for _ in range(50):  # repeat: a dying parent may have forked children
            pids = [p for p in self._ns_pids(ns) if p != os.getpid()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
                    killed.add(pid)
            if sig != signal.SIGKILL:
                break
            time.sleep(0.02)
        return len(killed)

    # ----- running things on hosts -----------------------------------------

    def mpirun_args(self, env: Sequence[str] = ()) -> list[str]:
        """Flags that make the venv's `mpirun` (running in the root namespace, at the
        bridge address) launch onto these hosts and keep all traffic on them; callers
        append `-np N program`. `env` names extra variables to forward to the ranks."""
        from ..launch.mpirun import mpirun_command

        return mpirun_command([], **self.mpirun_options(), env=env, mpirun="mpirun")[1:]

    def mpirun_options(self, hosts: Sequence[str | int] | None = None) -> dict[str, Any]:
        """Keyword arguments for `mlxdist.launch.mpirun.mpirun_command` that launch onto these
        hosts, or onto the subset `hosts` (names, IPs or indices), e.g. to rehearse a
        resume on the machines that are left."""
        return {"hostfile": self.subset_hostfile(hosts) if hosts else self.hostfile,
                "ssh_agent": self.ssh_agent, "network": self.cidr}

    def subset_hostfile(self, hosts: Sequence[str | int]) -> Path:
        """A hostfile of some hosts, kept beside the full one (and removed by `down`)."""
        return self.profile().subset_hostfile([self._index(h) for h in hosts])

    def host_command(self, host: str | int, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run on `host` the way mpirun's daemons do: its netns,
        its hostname, its CPU cgroup."""
        cg = self.cgroup_dir(host)
        procs = str(cg / "cgroup.procs") if cg else "/dev/null"
        scale = self.compute_scale(host)
        rig_env = (["env", "-u", COMPUTE_SCALE_VAR] if scale is None
                   else ["env", f"{COMPUTE_SCALE_VAR}={float(scale)!r}"])
        # The cgroup is joined before `ip netns exec`, which remounts /sys.
        return [
            "/bin/sh", "-c", 'echo $$ 2>/dev/null >"$1"; shift; exec "$@"', "simcluster",
            procs, "ip", "netns", "exec", self.netns(host), "unshare", "--uts",
            "/bin/sh", "-c", 'hostname "$1"; shift; exec "$@"',
            "simcluster", self.hostname(host), *rig_env, *argv,
        ]

    def run(self, host: str | int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run on a host (same keyword arguments)."""
        return subprocess.run(self.host_command(host, argv), **kw)

    def popen(self, host: str | int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """subprocess.Popen on a host, for servers a test talks to; `down` kills it."""
        p = subprocess.Popen(self.host_command(host, argv), **kw)
        self._launched = [q for q in self._launched if q.poll() is None] + [p]
        return p

    def pids(self, host: str | int) -> list[int]:
        return self._ns_pids(self.netns(host))

    def reachable(self, src: str | int, dst: str | int, timeout: float = 1.0) -> bool:
        """Whether `src` can reach `dst` now, without a ping binary: a TCP connect to
        a closed port answers with a reset when the path works and times out or
        fails with 'unreachable' when it does not."""
        code = (
            "import socket,sys\n"
            "s=socket.socket(); s.settimeout(float(sys.argv[2]))\n"
            "try:\n s.connect((sys.argv[1], 9)); sys.exit(0)\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        res = self.run(
            src, [sys.executable, "-c", code, self.ip(dst), str(timeout)],
            capture_output=True, timeout=timeout + 10,
        )
        return res.returncode == 0

    # ----- faults -------------------------------------------------------------

    def kill(self, host: str | int, sig: int = signal.SIGKILL) -> int:
        """Kill every process on the host (a crashed node); returns how many."""
        return self._kill_ns(self.netns(host), sig)

    def cut(self, host: str | int) -> None:
        """Unplug the host's cable: the bridge side goes down, so packets in both
        directions vanish and open TCP connections hang (no reset), as in a real
        partition. Qdiscs on the link survive and apply again after `heal`."""
        _run(["ip", "link", "set", self.veth(host), "down"])
        self._host_state[self.hostname(host)]["cut"] = True
        self._save_state()

    def heal(self, host: str | int) -> None:
        _run(["ip", "link", "set", self.veth(host), "up"])
        self._host_state[self.hostname(host)]["cut"] = False
        self._save_state()

    def slow(self, host: str | int, cpu_percent: float | None) -> None:
        """Cap the host's CPU at `cpu_percent` of one core (None lifts the cap).

        Applies to processes started on the host later (the ssh stand-in and
        `host_command` join the host's cgroup) and to those running there now.
        """
        cg = self.cgroup_dir(host)
        if cg is None:
            raise RuntimeError("no cgroup cpu controller (v1 cpu or v2 cpu.max) here")
        if not cg.is_dir():
            self._make_cgroup(self.hostname(host))
        if cpu_percent is None:
            quota = -1
        else:
            if cpu_percent <= 0:
                raise ValueError("cpu_percent must be > 0")
            quota = max(1000, int(CFS_PERIOD_US * cpu_percent / 100.0))
        if _cgroup_mode() == "v1":
            (cg / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (cg / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (cg / "cpu.max").write_text(
                f"{'max' if quota < 0 else quota} {CFS_PERIOD_US}"
            )
        for pid in self.pids(host):
            with contextlib.suppress(OSError):
                (cg / "cgroup.procs").write_text(str(pid))
        self._host_state[self.hostname(host)]["cpu_percent"] = cpu_percent
        self._save_state()

    def slow_compute(self, host: str | int, scale: float | None) -> None:
        """Make the host compute `scale` times slower with its CPU left free (None: normal).

        Rig-only: processes started on the host later get MLXDIST_RIG_COMPUTE_SCALE, and
        the training loop sleeps (scale - 1) x its forward/backward time after each one (a
        pipeline rank after each forward and backward of its stages).
        That models a slower GPU, whose CPU still drives the network at full speed; a CPU
        quota (`slow`) also slows every collective and Open MPI's busy-wait eats it, the
        harsher and less Mac-like case. Running processes keep the scale they started with.
        """
        if scale is not None and not (scale >= 1.0 and scale < float("inf")):
            raise ValueError(f"compute scale {scale} must be a finite number >= 1")
        self._host_state[self.hostname(host)]["compute_scale"] = (
            None if scale is None else float(scale))
        if self._is_up:
            self._write_agent()
        self._save_state()

    def shape(
        self,
        host: str | int,
        rate: str | None = None,
        delay: str | None = None,
        _save: bool = True,
    ) -> None:
        """Give the host's link a bandwidth cap and/or latency; both None clears it.

        `rate` caps both directions (tbf on the host's eth0 for traffic it sends,
        and on the bridge-side veth for traffic it receives), so shaping one host
        slows its transfers either way. `delay` is added once, on packets the host
        sends: between two delayed hosts one way costs `delay`, a round trip 2x.
        """
        if delay and not qdisc_supported("netem"):
            raise RuntimeError(
                "this kernel has no netem qdisc (sch_netem), so delay cannot be "
                "added; use rate only, or load sch_netem (modprobe sch_netem)"
            )
        if rate and not qdisc_supported("tbf"):
            raise RuntimeError("this kernel has no tbf qdisc (sch_tbf) for rate limits")
        ns = self.netns(host)
        eth0 = ["ip", "netns", "exec", ns, "tc"]
        root = ["tc"]
        for tc, dev in ((eth0, "eth0"), (root, self.veth(host))):
            _quiet([*tc, "qdisc", "del", "dev", dev, "root"])
        tbf = []
        if rate:
            bps = parse_rate(rate)
            # The bucket must hold a GSO super-packet (64 KiB) or tbf stalls, and
            # about 4 ms of traffic so timer granularity does not eat the rate.
            burst = max(64 * 1024, int(bps / 8 / 250))
            tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
        if delay:
            netem = ["netem", "delay", delay, "limit", "100000"]
            _run([*eth0, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", *netem])
            if tbf:
                _run([*eth0, "qdisc", "add", "dev", "eth0", "parent", "1:1",
                      "handle", "10:", *tbf])
        elif tbf:
            _run([*eth0, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", *tbf])
        if tbf:
            _run([*root, "qdisc", "add", "dev", self.veth(host), "root", "handle", "1:",
                  *tbf])
        st = self._host_state.setdefault(self.hostname(host), {})
        st["rate"], st["delay"] = rate, delay
        if _save:
            self._save_state()

    # ----- state (for the CLI) -----------------------------------------------

    def _save_state(self) -> None:
        if not self._is_up and not self.state_file.exists():
            return
        data = {
            "name": self.name,
            "n_hosts": self.n_hosts,
            "subnet": self.subnet,
            "rate": self.rate,
            "delay": self.delay,
            "slots": self.slots,
            "hosts": self._host_state,
        }
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(data, indent=1) + "\n")
        if self.state_dir.resolve() != (DEFAULT_STATE_ROOT / self.name).resolve():
            DEFAULT_STATE_ROOT.mkdir(parents=True, exist_ok=True)
            pointer(self.name).write_text(f"{self.state_dir}\n")

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str]) -> SimCluster:
        """The cluster a previous `up` (another process) left in `state_dir`."""
        data = json.loads((Path(state_dir) / "state.json").read_text())
        c = cls(
            data["n_hosts"], name=data["name"], subnet=data["subnet"],
            rate=data.get("rate"), delay=data.get("delay"), state_dir=state_dir,
            slots=data.get("slots", 1),
        )
        c._host_state.update(data.get("hosts", {}))
        c._is_up = True
        return c

    def status(self) -> dict[str, Any]:
        """What is really there (not what the state file claims), per host."""
        nss = set(_run(["ip", "netns", "list"], check=False).stdout.split())
        hosts = {}
        for h in self.hosts:
            ns = self.netns(h)
            exists = ns in nss
            link = _run(["ip", "-o", "link", "show", self.veth(h)], check=False).stdout
            qd = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0"],
                      check=False).stdout if exists else ""
            hosts[h] = {
                "ip": self.ip(h),
                "netns": ns,
                "exists": exists,
                "link": "up" if ",UP" in link or "<UP" in link else "down",
                "pids": len(self.pids(h)) if exists else 0,
                "qdisc": " | ".join(q.strip() for q in qd.splitlines() if q.strip()),
                **self._host_state.get(h, {}),
            }
        return {"name": self.name, "bridge": self.bridge, "subnet": self.cidr,
                "cgroup": _cgroup_mode(), "hosts": hosts,
                "rig_only": {"compute_scale": f"{COMPUTE_SCALE_VAR} in the host's processes: "
                             "mlxdist sleeps (scale-1) x compute time, a slower GPU, CPU free"}}

    def example_command(self, np: int | None = None) -> str:
        mpirun = shutil.which("mpirun") or "mpirun"
        return shlex.join([
            mpirun, *self.mpirun_args(), "-np", str(np or self.n_hosts * self.slots),
            "hostname",
        ])


def find_cluster(name_or_dir: str) -> SimCluster:
    """The cluster that is up under this name (default root, or a `--state-dir` it was
    made with) or in this state directory; a LookupError that says how to make one."""
    return SimCluster.load(find_dir(name_or_dir, "state.json"))


# ----- CLI ------------------------------------------------------------------------

def _cli_cluster(args: argparse.Namespace) -> SimCluster:
    try:
        return find_cluster(args.state_dir or args.name)
    except LookupError as e:
        raise SystemExit(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: separate invocations share the cluster through its state dir."""
    p = argparse.ArgumentParser(
        prog="simcluster",
        description="Simulated cluster of network-namespace hosts for mpirun (needs root).",
    )
    p.add_argument("--name", default="mlxsim", help="cluster name / hostname prefix")
    p.add_argument("--state-dir", help="default /tmp/mlxdist-simcluster/NAME")
    # The same options after the subcommand too (`up --state-dir D`); SUPPRESS keeps
    # a subparser from overwriting a value given before the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=argparse.SUPPRESS)
    common.add_argument("--state-dir", default=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(cmd: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(cmd, parents=[common], **kw)

    up = add("up", help="create (or recreate) the cluster")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--subnet", default="10.77.0")
    up.add_argument("--rate", help="link cap per host, e.g. 1gbit")
    up.add_argument("--delay", help="added latency per host, e.g. 1ms")
    up.add_argument("--slots", type=int, default=1)
    add("down", help="tear everything of this name down")
    add("status", help="show hosts, links, qdiscs, processes")
    for cmd, what in (("kill", "kill all processes on HOST"), ("cut", "unplug HOST"),
                      ("heal", "plug HOST back in")):
        add(cmd, help=what).add_argument("host", help="name, IP or index")
    sl = add("slow", help="slow a host: CPU quota and/or rig-only compute scale; "
             "neither option: lift both")
    sl.add_argument("host")
    sl.add_argument("--cpu", type=float,
                    help="percent of one core (harsher: also slows its communication)")
    sl.add_argument("--compute", type=float, metavar="X",
                    help="compute X times slower, CPU left free (a slower GPU; rig-only, "
                         "for processes started later)")
    sh = add("shape", help="set a host's link rate/delay (none: clear)")
    sh.add_argument("host")
    sh.add_argument("--rate")
    sh.add_argument("--delay")
    args = p.parse_args(argv)
    try:
        return _cli_run(args)
    except (RuntimeError, KeyError, ValueError, OSError) as e:
        print(f"simcluster {args.cmd}: {e}", file=sys.stderr)
        return 1


def _cli_run(args: argparse.Namespace) -> int:
    if args.cmd in ("up", "down"):
        ok, why = available()
        if not ok:
            print(why, file=sys.stderr)
            return 2
    if args.cmd == "up":
        c = SimCluster(args.hosts, name=args.name, subnet=args.subnet, rate=args.rate,
                       delay=args.delay, state_dir=args.state_dir, slots=args.slots)
        c.up()
        print(f"hostfile: {c.hostfile}")
        print(f"ssh agent: {c.ssh_agent}")
        print(f"hosts: {', '.join(f'{h}={c.ip(h)}' for h in c.hosts)}")
        print(f"example: {c.example_command()}")
        return 0
    if args.cmd == "down":
        try:
            c = find_cluster(args.state_dir or args.name)
        except (LookupError, OSError, ValueError, KeyError):
            c = SimCluster(0, name=args.name, state_dir=args.state_dir or DEFAULT_STATE_ROOT / args.name)
        c.down()
        return 0
    c = _cli_cluster(args)
    if args.cmd == "status":
        print(json.dumps(c.status(), indent=1))
    elif args.cmd == "kill":
        print(f"killed {c.kill(args.host)} processes on {c.hostname(args.host)}")
    elif args.cmd == "cut":
        c.cut(args.host)
    elif args.cmd == "heal":
        c.heal(args.host)
    elif args.cmd == "slow":
        if args.cpu is not None or args.compute is None:
            c.slow(args.host, args.cpu)
        if args.compute is not None or args.cpu is None:
            c.slow_compute(args.host, args.compute)
    elif args.cmd == "shape":
        c.shape(args.host, args.rate, args.delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
