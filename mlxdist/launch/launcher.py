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
import sys

from ..config import ConfigError, config_from_args
from ..markers import Exit
from . import preflight
from .elastic import ElasticSettings
from .elastic_run import ElasticRun, ProbeTarget
from .hosts import LaunchError, check_host
from .job import Launch, plan_hostfile, plan_simcluster
from .supervisor import supervise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mlxrun", description=__doc__.splitlines()[0],
                                epilog="example: mlxrun (or launch/mlxrun from a checkout) --hostfile hostfiles/studio+macbook.hosts "
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
    p.add_argument("--no-check", action="store_true", help="skip the host checks (reachability, versions, host-to-host reach)")
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
            launch.notes += preflight.check([h.name for h in launch.hosts], launch.remote(), args.python,
                                            os.getcwd(), where)
        cmd = launch.command(train_args, python=args.python, tcp_links=args.tcp_links, env=args.env, tag=tag)
        elastic = _elastic_run(args, launch, train_args) if args.elastic else None
    except (LaunchError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.USAGE
    for note in launch.notes:
        print(f"mlxrun: {note}", file=sys.stderr)
    if elastic is not None and not args.dry_run:
        return elastic.run()
    if args.dry_run:
        print(shlex.join(cmd), flush=True)
        return Exit.OK
    return supervise(cmd, n_ranks=launch.n_ranks, hosts=[h.name for h in launch.hosts], remote=launch.remote(),
                     tag=tag, grace=args.grace)


def _elastic_run(args: argparse.Namespace, launch: Launch, train_args: list[str]) -> ElasticRun:
    """The elastic loop for this launch; the run's config is read here (as the ranks will read
    it) for where its checkpoints live, so a bad key fails before any host is touched."""
    if args.min_hosts > len(launch.hosts):
        raise LaunchError(f"--min-hosts {args.min_hosts}: the job has only {len(launch.hosts)} host(s)")
    try:
        cfg = config_from_args(train_args)
    except ConfigError as e:
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
