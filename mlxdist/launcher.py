"""`launch/mlxrun`: turn a hostfile into the right `mpirun` command, check it, print it, run it.

The flags that matter for a Mac cluster are easy to get wrong by hand: TCP only (no shared
memory transport across machines), the interface to use, several TCP links per peer for
Thunderbolt bandwidth, no CPU binding (MLX wants the whole machine), and the environment
every rank needs. Hosts are checked first, so a typo or a sleeping MacBook is reported by
name instead of as an mpirun hang.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .world import find_mpirun

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


def check_host(name: str, port: int = 22, timeout: float = 3.0) -> str | None:
    """None if `name` resolves and (for remote hosts) accepts connections on the ssh port."""
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


def build_command(hosts_path: str, hosts: list[HostEntry], train_args: list[str], *, iface: str | None,
                  tcp_links: int, python: str, extra_env: list[str]) -> list[str]:
    cmd = [find_mpirun(python), "--hostfile", hosts_path, "-np", str(sum(h.slots for h in hosts)), "--bind-to", "none",
           "--mca", "btl", "tcp,self", "--mca", "btl_tcp_links", str(tcp_links)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    if iface:
        cmd += ["--mca", "btl_tcp_if_include", iface, "--prtemca", "oob_tcp_if_include", iface]
    env_names = ["PATH", "PYTHONPATH", "LD_PRELOAD", "OPENBLAS_NUM_THREADS", *extra_env]
    cmd += ["-x", "MLX_MPI_LIBNAME=libmpi.so.40"]
    for name in env_names:
        if "=" in name or name in os.environ:
            cmd += ["-x", name]
    return [*cmd, python, "-m", "mlxdist.train", *train_args]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/mlxrun", description=__doc__.splitlines()[0],
                                epilog="example: launch/mlxrun --hostfile hostfiles/studio+macbook.hosts "
                                       "-- --config configs/cluster.yaml")
    p.add_argument("--hostfile", help="Open MPI hostfile (name slots=N per line)")
    p.add_argument("--simcluster", metavar="NAME",
                   help="rehearse on a namespace cluster made by `launch/simcluster up` (e.g. mlxsim)")
    p.add_argument("--iface", help="network interface or CIDR for MPI traffic, e.g. en0, bridge0, 10.0.0.0/24")
    p.add_argument("--tcp-links", type=int, default=2, help="TCP connections per peer (Thunderbolt: 4)")
    p.add_argument("--python", default=sys.executable, help="python on every host (same path)")
    p.add_argument("-x", dest="env", action="append", default=[], help="extra env var to pass to ranks")
    p.add_argument("--dry-run", action="store_true", help="check hosts and print the command only")
    p.add_argument("--no-check", action="store_true", help="skip the host reachability check")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then python -m mlxdist.train arguments")
    args = p.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.simcluster:
        return launch_on_simcluster(args.simcluster, train_args, args)
    if not args.hostfile:
        p.error("one of --hostfile or --simcluster is required")
    try:
        hosts = read_hostfile(args.hostfile)
        if not args.no_check:
            for h in hosts:
                problem = check_host(h.name)
                if problem:
                    raise LaunchError(f"hostfile {args.hostfile}: {problem}")
        cmd = build_command(args.hostfile, hosts, train_args, iface=args.iface, tcp_links=args.tcp_links,
                            python=args.python, extra_env=args.env)
    except (LaunchError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return supervise(cmd)


def launch_on_simcluster(name: str, train_args: list[str], args: argparse.Namespace) -> int:
    """The same launch onto namespace hosts: their ssh stand-in instead of ssh, their subnet."""
    from .rig.simcluster import DEFAULT_STATE_ROOT, SimCluster

    state = DEFAULT_STATE_ROOT / name
    if not (state / "state.json").exists():
        print(f"error: no simulated cluster '{name}' in {state}; make one with "
              "`sudo launch/simcluster up --hosts 2`", file=sys.stderr)
        return 2
    cluster = SimCluster.load(state)
    try:
        mpirun = find_mpirun(args.python)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(h.slots for h in read_hostfile(cluster.hostfile))
    cmd = [mpirun, *cluster.mpirun_args(env=["MLX_MPI_LIBNAME=libmpi.so.40", *args.env]), "-np", str(n),
           "--bind-to", "none", "--mca", "btl_tcp_links", str(args.tcp_links),
           args.python, "-m", "mlxdist.train", *train_args]
    print(shlex.join(cmd), flush=True)
    return 0 if args.dry_run else supervise(cmd)


# Lines after which the job is over even if mpirun does not think so: Open MPI 5 exits 0
# when a host's daemon dies, and waits forever for a daemon behind a cut link.
FATAL_MARKERS = ("stalled", "A daemon failed to report back", "aborting the whole job", "MPI_ABORT")


def supervise(cmd: list[str], grace: float = 10.0) -> int:
    """Run mpirun, pass its output through, and make a failed job end, and end non-zero."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    failed = threading.Event()
    reason: list[str] = []

    def pump(src, dst) -> None:
        for line in src:
            dst.write(line)
            dst.flush()
            if not failed.is_set() and any(m in line for m in FATAL_MARKERS):
                reason.append(line.strip())
                failed.set()

    threads = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, sys.stderr), daemon=True)]
    for t in threads:
        t.start()

    interrupted = threading.Event()

    def forward(signum, _frame):
        interrupted.set()
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while proc.poll() is None:
            if failed.wait(0.2):
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    print(f"mlxrun: mpirun did not exit {grace:.0f}s after the job failed; stopping it",
                          file=sys.stderr, flush=True)
                    proc.terminate()
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                break
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    for t in threads:
        t.join(timeout=2)
    if failed.is_set():
        print(f"mlxrun: job failed: {reason[0]}", file=sys.stderr, flush=True)
        return proc.returncode or 1
    if interrupted.is_set():
        # mpirun drops the ranks' last lines while it shuts down; say what they did.
        print("mlxrun: stopped; the ranks saved a checkpoint at the step they agreed on: "
              "continue with --resume auto", file=sys.stderr, flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
