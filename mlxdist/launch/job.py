"""What one `launch/mlxrun` job runs on: a `Launch`, made from a hostfile (Open MPI or
`mlx.distributed_config` JSON) or from a cluster profile, and turned into the mpirun command."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster.jaccl import is_mlx_hostfile, read_mlx_hostfile, to_openmpi_hostfile
from ..markers import SUPERVISED_ENV
from .hosts import (
    LOCAL_NAMES,
    HostEntry,
    LaunchError,
    Remote,
    host_name_problem,
    hostfile_text,
    read_hostfile,
    read_hostfile_text,
)
from .mpirun import hostfile_network, mpirun_command
from .profile import PROFILE_FILE, ClusterProfile, find_dir


@dataclass
class Launch:
    """Everything needed to start, supervise and clean up one job."""

    hostfile: Path
    hosts: list[HostEntry]
    ssh_agent: Path | None = None
    network: str | None = None
    notes: list[str] = field(default_factory=list)
    exports: list[str] = field(default_factory=list)  # NAME=VALUE for every rank

    @property
    def n_ranks(self) -> int:
        return sum(h.slots for h in self.hosts)

    def remote(self) -> Remote:
        prefix = (str(self.ssh_agent),) if self.ssh_agent else Remote.prefix
        return Remote(prefix=prefix, local_names=frozenset() if self.ssh_agent else frozenset(LOCAL_NAMES))

    def subset(self, names: list[str], path: Path) -> Launch:
        """The same launch on some of its hosts, in this order (the first runs rank 0)."""
        slots = {h.name: h.slots for h in self.hosts}
        hosts = [HostEntry(n, slots[n]) for n in names]
        path.write_text(hostfile_text(hosts))
        return Launch(path, hosts, self.ssh_agent, self.network)

    def command(self, train_args: list[str], *, python: str, tcp_links: int, env: list[str], tag: str) -> list[str]:
        # `-X mlxdist_job=TAG` is inert for Python and names the job's ranks in `ps` on every
        # host, so the supervisor (or a user) can find what a failed job left behind.
        program = [python, "-X", f"mlxdist_job={tag}", "-m", "mlxdist.train", *train_args]
        return mpirun_command(program, hostfile=self.hostfile, np=self.n_ranks, ssh_agent=self.ssh_agent,
                              network=self.network, tcp_links=tcp_links, env=[*env, *self.exports, f"{SUPERVISED_ENV}=1"],
                              mpirun=_mpirun_beside(python))


def _mpirun_beside(python: str) -> str:
    from ..cluster.world import find_mpirun

    return find_mpirun(python)


def plan_hostfile(path: str, ssh_agent: str | None, iface: str | None) -> Launch:
    """A user's hostfile; one in a cluster profile's directory (`launch/simcluster` writes
    one) brings the cluster's ssh stand-in and network, when the profile passes
    `ClusterProfile.agent_problem`: a hostfile's folder does not choose what runs here."""
    hostfile = Path(path)
    exports, notes = [], []
    read_hostfile_text(hostfile)
    if is_mlx_hostfile(hostfile):
        hostfile, exports, notes = _from_mlx_hostfile(hostfile)
    hosts = read_hostfile(hostfile)
    launch = Launch(hostfile, hosts, Path(ssh_agent) if ssh_agent else None, iface, notes, exports)
    if ssh_agent is None and (hostfile.parent / PROFILE_FILE).is_file():
        profile = ClusterProfile.load(hostfile.parent)
        problem = profile.agent_problem()
        if problem:
            launch.notes.append(f"{problem}: not using its ssh agent (pass --ssh-agent PATH to choose one)")
        elif profile.ssh_agent is not None and profile.ssh_agent.is_file():
            launch.ssh_agent, launch.network = profile.ssh_agent, iface or profile.network
            launch.notes.append(f"{hostfile} belongs to simulated cluster '{profile.name}': using its ssh stand-in")
    if launch.ssh_agent is not None and not launch.ssh_agent.is_file():
        raise LaunchError(f"ssh agent {launch.ssh_agent}: not found")
    if launch.network is None and launch.ssh_agent is None:
        # Without it Open MPI also tries awdl0, llw0, utun* and IPv6 link-local addresses on a Mac.
        launch.network = hostfile_network([h.name for h in hosts])
        if launch.network:
            launch.notes.append(f"MPI traffic on {launch.network} (the hostfile's subnet; --iface to choose)")
    return launch


def _from_mlx_hostfile(path: Path) -> tuple[Path, list[str], list[str]]:
    """A JSON hostfile from `mlx.distributed_config`: the same hosts as an Open MPI
    hostfile for mpirun, its `envs` exported to every rank, and its path handed to the
    ranks (MLXDIST_MLX_HOSTFILE) so `mlx-jaccl` builds the RDMA device matrix from it."""
    try:
        hf = read_mlx_hostfile(path)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    for i, h in enumerate(hf.hosts):
        problem = host_name_problem(h.host)
        if problem:
            raise LaunchError(f"hostfile {path}: entry {i}: {problem}")
    out = Path(tempfile.mkdtemp(prefix="mlxrun-")) / f"{path.stem}.hosts"
    out.write_text(to_openmpi_hostfile(hf))
    note = (f"{path} is an mlx.distributed_config hostfile ({len(hf.hosts)} ranks"
            + (f", backend {hf.backend}" if hf.backend else "") + f"): launching from {out}")
    return out, [*hf.envs, f"MLXDIST_MLX_HOSTFILE={path.resolve()}"], [note]


def plan_simcluster(name: str, select: str | None, iface: str | None) -> Launch:
    """A cluster by the name or directory of its profile, optionally some of its hosts."""
    try:
        profile = ClusterProfile.load(find_dir(name))
    except LookupError as e:
        raise LaunchError(str(e)) from None
    problem = profile.agent_problem()
    if problem:
        raise LaunchError(f"--simcluster {name}: {problem}; bring the cluster up again with "
                          "`sudo launch/simcluster up`, or pass --hostfile and --ssh-agent")
    chosen = [h.strip() for h in select.split(",") if h.strip()] if select else None
    try:
        hostfile = profile.subset_hostfile(chosen) if chosen else profile.hostfile
    except KeyError as e:
        raise LaunchError(f"--hosts {select}: {e.args[0]} (hosts are 1..{len(profile.hosts)}, "
                          f"{profile.hosts[0].name}.. or their IPs)") from None
    return Launch(hostfile, read_hostfile(hostfile), profile.ssh_agent, iface or profile.network)
