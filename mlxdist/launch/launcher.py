"""`launch/mlxrun`: turn a hostfile into the right `mpirun` command, check it, print it, run it.

The flags that matter for a Mac cluster are easy to get wrong by hand: TCP only (no shared
memory transport across machines), the interface to use, several TCP links per peer for
Thunderbolt bandwidth, no CPU binding (MLX wants the whole machine), and the environment
every rank needs. Hosts are checked first, so a typo or a sleeping MacBook is reported by
name instead of as an mpirun hang. The job then runs under `supervisor.Supervisor`, which
turns Ctrl-C into a saved stop and reports how the job ended as an exit code.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..dist.jaccl import is_mlx_hostfile, read_mlx_hostfile, to_openmpi_hostfile
from ..markers import SUPERVISED_ENV, Exit
from .mpirun import mpirun_command
from .supervisor import Remote, supervise

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.gethostname().split(".")[0]}


@dataclass
class HostEntry:
    name: str
    slots: int


class LaunchError(RuntimeError):
    pass


def read_hostfile(path: str | Path) -> list[HostEntry]:
    p = Path(path)
    if not p.is_file():
        raise LaunchError(f"hostfile {p}: not found")
    hosts = []
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *opts = line.split()
        slots = 1
        for opt in opts:
            key, _, value = opt.partition("=")
            if key in ("slots", "max_slots", "max-slots") and value.isdigit():
                slots = int(value) if key == "slots" else slots
            else:
                raise LaunchError(f"hostfile {p}:{n}: cannot read '{opt}' (expected slots=N)")
        hosts.append(HostEntry(name, slots))
    if not hosts:
        raise LaunchError(f"hostfile {p}: lists no hosts")
    return hosts


def check_host(name: str, remote: Remote | None = None, port: int = 22, timeout: float = 5.0) -> str | None:
    """None if `name` can take part; otherwise what is wrong with it, in words.

    With a `remote` (an ssh stand-in such as the namespace rig's), the host is asked to
    run `true` through it, the same path mpirun's daemons take; otherwise the name must
    resolve and (for a remote host) accept connections on the ssh port."""
    if remote is not None:
        try:
            r = subprocess.run(remote.command(name, "true"), capture_output=True, text=True, timeout=timeout + 5,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"host '{name}' does not answer through {remote.prefix[0]} within {timeout + 5:.0f}s"
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            return f"host '{name}' cannot run commands through {remote.prefix[0]} ({why})"
        return None
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return f"host '{name}' does not resolve (check the name, /etc/hosts or Bonjour: try '{name}.local')"
    if name in LOCAL_NAMES or addr.startswith("127."):
        return None
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except OSError as e:
        return (f"host '{name}' ({addr}) is unreachable on ssh port {port} ({e.strerror or e}); "
                "is it awake, on the network, with Remote Login enabled?")


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
        path.write_text("".join(f"{n} slots={slots[n]}\n" for n in names))
        return Launch(path, [HostEntry(n, slots[n]) for n in names], self.ssh_agent, self.network)

    def command(self, train_args: list[str], *, python: str, tcp_links: int, env: list[str], tag: str) -> list[str]:
        # `-X mlxdist_job=TAG` is inert for Python and names the job's ranks in `ps` on every
        # host, so the supervisor (or a user) can find what a failed job left behind.
        program = [python, "-X", f"mlxdist_job={tag}", "-m", "mlxdist.train", *train_args]
        return mpirun_command(program, hostfile=self.hostfile, np=self.n_ranks, ssh_agent=self.ssh_agent,
                              network=self.network, tcp_links=tcp_links, env=[*env, *self.exports, f"{SUPERVISED_ENV}=1"],
                              mpirun=_mpirun_beside(python))


def _mpirun_beside(python: str) -> str:
    from ..dist.world import find_mpirun

    return find_mpirun(python)


def plan_hostfile(path: str, ssh_agent: str | None, iface: str | None) -> Launch:
    """A user's hostfile; one that `launch/simcluster` wrote brings its stand-in and subnet."""
    hostfile = Path(path)
    exports, notes = [], []
    if is_mlx_hostfile(hostfile):
        hostfile, exports, notes = _from_mlx_hostfile(hostfile)
    hosts = read_hostfile(hostfile)
    launch = Launch(hostfile, hosts, Path(ssh_agent) if ssh_agent else None, iface, notes, exports)
    if ssh_agent is None and (hostfile.parent / "state.json").is_file() and (hostfile.parent / "ssh-agent").is_file():
        from ..rig.simcluster import SimCluster

        cluster = SimCluster.load(hostfile.parent)
        launch.ssh_agent, launch.network = cluster.ssh_agent, iface or cluster.cidr
        launch.notes.append(f"{hostfile} belongs to simulated cluster '{cluster.name}': using its ssh stand-in")
    if launch.ssh_agent is not None and not launch.ssh_agent.is_file():
        raise LaunchError(f"ssh agent {launch.ssh_agent}: not found")
    return launch


def _from_mlx_hostfile(path: Path) -> tuple[Path, list[str], list[str]]:
    """A JSON hostfile from `mlx.distributed_config`: the same hosts as an Open MPI
    hostfile for mpirun, its `envs` exported to every rank, and its path handed to the
    ranks (MLXDIST_MLX_HOSTFILE) so `mlx-jaccl` builds the RDMA device matrix from it."""
    try:
        hf = read_mlx_hostfile(path)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    out = Path(tempfile.mkdtemp(prefix="mlxrun-")) / f"{path.stem}.hosts"
    out.write_text(to_openmpi_hostfile(hf))
    note = (f"{path} is an mlx.distributed_config hostfile ({len(hf.hosts)} ranks"
            + (f", backend {hf.backend}" if hf.backend else "") + f"): launching from {out}")
    return out, [*hf.envs, f"MLXDIST_MLX_HOSTFILE={path.resolve()}"], [note]


def plan_simcluster(name: str, select: str | None, iface: str | None) -> Launch:
    """A namespace cluster by name or state directory, optionally some of its hosts."""
    from ..rig.simcluster import find_cluster

    try:
        cluster = find_cluster(name)
    except LookupError as e:
        raise LaunchError(str(e)) from None
    chosen = [h.strip() for h in select.split(",") if h.strip()] if select else None
    try:
        opts = cluster.mpirun_options(chosen)
    except KeyError as e:
        raise LaunchError(f"--hosts {select}: {e.args[0]} (hosts are 1..{cluster.n_hosts}, "
                          f"{cluster.hosts[0]}.. or their IPs)") from None
    hostfile = Path(opts["hostfile"])
    return Launch(hostfile, read_hostfile(hostfile), Path(opts["ssh_agent"]), iface or opts["network"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/mlxrun", description=__doc__.splitlines()[0],
                                epilog="example: launch/mlxrun --hostfile hostfiles/studio+macbook.hosts "
                                       "-- --config configs/cluster.yaml. Exit codes: "
                                       + ", ".join(f"{int(c)} {c.name.lower()}" for c in Exit))
    p.add_argument("--hostfile", help="Open MPI hostfile (name slots=N per line)")
    p.add_argument("--simcluster", metavar="NAME|DIR",
                   help="rehearse on a namespace cluster made by `launch/simcluster up` (name or state dir)")
    p.add_argument("--hosts", metavar="LIST", help="with --simcluster: only these hosts, e.g. 1,2 or mlxsim2,mlxsim3")
    p.add_argument("--ssh-agent", metavar="PATH", help="command mpirun uses instead of ssh (plm_ssh_agent)")
    p.add_argument("--iface", help="network interface or CIDR for MPI traffic, e.g. en0, bridge0, 10.0.0.0/24")
    p.add_argument("--tcp-links", type=int, default=2, help="TCP connections per peer (Thunderbolt: 4)")
    p.add_argument("--python", default=sys.executable, help="python on every host (same path)")
    p.add_argument("-x", dest="env", action="append", default=[], help="extra env var to pass to ranks")
    p.add_argument("--grace", type=float, default=3.0,
                   help="seconds mpirun gets to end a failed job before it is killed (default 3)")
    p.add_argument("--elastic", action="store_true",
                   help="when a host dies, is cut off or stalls: restart on the hosts that answer, from the "
                        "newest checkpoint that verifies on any of them")
    p.add_argument("--min-hosts", type=int, default=1, metavar="K",
                   help="--elastic: give up (exit 5) when fewer than K hosts answer (default 1)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="R",
                   help="--elastic: restarts after failures before giving up (default 5)")
    p.add_argument("--rejoin", action="store_true",
                   help="--elastic: take a dropped host back at the next checkpoint once it answers again")
    p.add_argument("--dry-run", action="store_true", help="check hosts and print the command only")
    p.add_argument("--no-check", action="store_true", help="skip the host reachability check")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then python -m mlxdist.train arguments")
    args = p.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if bool(args.hostfile) == bool(args.simcluster):
        p.error("give one of --hostfile or --simcluster")
    if args.hosts and not args.simcluster:
        p.error("--hosts picks hosts of a --simcluster; for real machines, write a hostfile with those lines")
    if (args.rejoin or args.min_hosts != 1 or args.max_restarts != 5) and not args.elastic:
        p.error("--min-hosts, --max-restarts and --rejoin need --elastic")
    if args.min_hosts < 1 or args.max_restarts < 0:
        p.error("--min-hosts must be at least 1 and --max-restarts at least 0")
    tag = secrets.token_hex(4)
    try:
        if args.simcluster:
            launch = plan_simcluster(args.simcluster, args.hosts, args.iface)
        else:
            launch = plan_hostfile(args.hostfile, args.ssh_agent, args.iface)
        where = f"hostfile {args.hostfile}" if args.hostfile else f"--simcluster {args.simcluster}"
        if not args.no_check:
            remote = launch.remote() if launch.ssh_agent else None
            for h in launch.hosts:
                problem = check_host(h.name, remote)
                if problem:
                    raise LaunchError(f"{where}: {problem}")
        cmd = launch.command(train_args, python=args.python, tcp_links=args.tcp_links, env=args.env, tag=tag)
        elastic = _elastic_run(args, launch, train_args) if args.elastic else None
    except (LaunchError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.USAGE
    for note in launch.notes:
        print(f"mlxrun: {note}", file=sys.stderr)
    if elastic is not None and not args.dry_run:
        return elastic.run()  # prints each job's command itself
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return Exit.OK
    return supervise(cmd, n_ranks=launch.n_ranks, hosts=[h.name for h in launch.hosts], remote=launch.remote(),
                     tag=tag, grace=args.grace)


def _elastic_run(args: argparse.Namespace, launch: Launch, train_args: list[str]):
    """The elastic loop for this launch; the run's config is read here (as the ranks will read
    it) for where its checkpoints live, so a bad key fails before any host is touched."""
    from ..config import ConfigError, load_config
    from ..train import parse_args
    from .elastic import ElasticSettings
    from .elastic_run import ElasticRun, ProbeTarget

    if args.min_hosts > len(launch.hosts):
        raise LaunchError(f"--min-hosts {args.min_hosts}: the job has only {len(launch.hosts)} host(s)")
    try:
        a = parse_args(train_args)
        cfg = load_config(a.config, list(a.overrides) + ([f"checkpoint.resume={a.resume}"] if a.resume else []))
    except (ConfigError, SystemExit) as e:
        raise LaunchError(f"--elastic: cannot read the run's config: {e}") from None
    if not cfg.checkpoint.every:
        launch.notes.append("--elastic with checkpoint.every=0: a failure restarts from the last saved stop, "
                            "or from the start; set checkpoint.every")
    if not cfg.checkpoint.on_every_host:
        launch.notes.append("--elastic: only rank 0's host keeps checkpoints; if it is lost with its disk, the "
                            "run restarts from the start. Set checkpoint.on_every_host=true")
    cwd = os.getcwd()
    target = ProbeTarget(python=args.python, cwd=cwd, run_dir=os.path.join(cwd, cfg.train.out_dir))
    return ElasticRun(launch, ElasticSettings(args.min_hosts, args.max_restarts, args.rejoin), train_args,
                      python=args.python, tcp_links=args.tcp_links, env=args.env, grace=args.grace,
                      target=target, checkpoint_every=cfg.checkpoint.every)


if __name__ == "__main__":
    sys.exit(main())
