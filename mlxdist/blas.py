"""Linux only: swap mlx-cpu's bundled reference BLAS for a fast one (1024^2 fp32 matmul on this
project's 2-core box: ~3 GFLOP/s reference, ~200-280 with OpenBLAS or MKL).

Which one, in order (`MLXDIST_BLAS=auto`, the default):

1. a system OpenBLAS (`apt-get install libopenblas0-pthread`);
2. Intel MKL from PyPI (`mkl`, a dependency of mlxdist on Linux x86_64): its `libmkl_rt`
   exports the standard `cblas_*` symbols MLX's CPU backend calls (the PyPI OpenBLAS builds
   rename theirs, so they cannot stand in). There is no such wheel for aarch64 Linux: there
   the system OpenBLAS is the only fast route;
3. mlx-cpu's bundled reference BLAS, and the banner says how to get a fast one.

`MLXDIST_BLAS=openblas|mkl|reference` forces one (`MLXDIST_NO_OPENBLAS=1`, the older switch,
means `reference`). The dynamic loader reads LD_PRELOAD only at process start, so the process
re-executes itself once with the library preloaded, and with BLAS/OpenMP thread counts that
share the host's cores among the MPI ranks on it (`thread_env`). On macOS nothing happens:
MLX uses Metal and Accelerate there.

The decisions are pure functions of their parameters (`choose`, `thread_env`, `plan_env`,
`describe`); `ensure_blas` and `status` feed them this process's facts.
"""

from __future__ import annotations

import glob
import os
import platform as _platform
import site
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
CANDIDATES = OPENBLAS_CANDIDATES  # the old name
REQUESTS = ("auto", "openblas", "mkl", "reference")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
NAMES = {"openblas": "system OpenBLAS", "mkl": "Intel MKL (pip package mkl)"}
_OWN_VAR = {"openblas": "OPENBLAS_NUM_THREADS", "mkl": "MKL_NUM_THREADS"}
_MARK = "MLXDIST_BLAS_CHECKED"  # the pid that already re-executed (execve keeps the pid)
_THREADS_MARK = "MLXDIST_BLAS_THREADS"  # NAME=VALUE pairs this module set, not the user


@dataclass(frozen=True)
class Choice:
    """The BLAS this process should preload: kind is openblas, mkl, reference or platform."""

    kind: str
    path: str | None = None
    note: str = ""


# -- the decision (pure) -------------------------------------------------------------------


def request_from(environ: Mapping[str, str]) -> str:
    """MLXDIST_BLAS, lower-cased; MLXDIST_NO_OPENBLAS=1 (the older switch) means reference."""
    req = environ.get("MLXDIST_BLAS", "").strip().lower()
    if not req and environ.get("MLXDIST_NO_OPENBLAS"):
        return "reference"
    return req or "auto"


def _hint(machine: str) -> str:
    if machine in ("x86_64", "amd64"):
        return "pip install mkl (a dependency of mlxdist here) or apt-get install libopenblas0-pthread"
    return (f"no pip BLAS for Linux {machine} (Intel's mkl wheel is x86_64 only): "
            "apt-get install libopenblas0-pthread")


def choose(request: str, platform: str, machine: str, openblas: str | None, mkl: str | None) -> Choice:
    """The BLAS to preload. `openblas`/`mkl`: the library paths found (None: absent)."""
    if platform != "linux":
        return Choice("platform", note="platform default (Accelerate/Metal on macOS)")
    note = ""
    if request not in REQUESTS:
        note = f"MLXDIST_BLAS={request!r} not understood ({'|'.join(REQUESTS)}), used auto; "
        request = "auto"
    if request == "reference":
        return Choice("reference", note=note + "MLXDIST_BLAS=reference")
    if request in ("auto", "openblas") and openblas:
        return Choice("openblas", openblas, note)
    if request in ("auto", "mkl") and mkl:
        return Choice("mkl", mkl, note)
    if request == "openblas":
        note += "MLXDIST_BLAS=openblas but no system OpenBLAS found; "
    elif request == "mkl":
        note += "MLXDIST_BLAS=mkl but " + ("no libmkl_rt found; " if machine in ("x86_64", "amd64")
                                          else f"there is no mkl wheel for {machine}; ")
    return Choice("reference", note=note + _hint(machine))


def local_ranks(environ: Mapping[str, str]) -> int:
    """Ranks of this job on this host (Open MPI, then MPICH/Hydra); 1 outside MPI."""
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        try:
            return max(1, int(environ[name]))
        except (KeyError, ValueError):
            continue
    return 1


def _auto_set(environ: Mapping[str, str]) -> dict[str, str]:
    pairs = (p.split("=", 1) for p in environ.get(_THREADS_MARK, "").split(",") if "=" in p)
    return dict(pairs)


def user_threads(environ: Mapping[str, str]) -> dict[str, str]:
    """Thread variables the user set (not the ones this module set in a parent process)."""
    auto = _auto_set(environ)
    return {v: environ[v] for v in THREAD_VARS if v in environ and auto.get(v) != environ[v]}


def thread_env(environ: Mapping[str, str], cores: int, ranks: int, kind: str) -> dict[str, str]:
    """OMP/MKL/OPENBLAS_NUM_THREADS for one rank: max(1, cores // ranks on this host), so ranks
    sharing a machine do not each start one thread per core. A value the user set is kept, and
    the unset ones follow it (the chosen library's own variable first, then OMP_NUM_THREADS):
    OPENBLAS_NUM_THREADS=1 alone also means one MKL thread. Returns the three variables and
    the mark naming those set here, which a child process (another rank count) may redo."""
    user = user_threads(environ)
    if user:
        order = (_OWN_VAR.get(kind, ""), "OMP_NUM_THREADS", *THREAD_VARS)
        n = next(user[v] for v in order if v in user)
    else:
        n = str(max(1, cores // max(1, ranks)))
    out = {v: user.get(v, n) for v in THREAD_VARS}
    out[_THREADS_MARK] = ",".join(f"{v}={out[v]}" for v in THREAD_VARS if v not in user)
    return out


def _split_preload(preload: str) -> list[str]:
    return [p for p in preload.replace(":", " ").split() if p]


def preloaded_kind(path: str) -> str | None:
    """openblas or mkl when `path` names one of the libraries this module preloads."""
    name = os.path.basename(path)
    if name.startswith("libopenblas"):  # not numpy's libscipy_openblas (renamed symbols)
        return "openblas"
    if name.startswith("libmkl_rt"):
        return "mkl"
    return None


def active_preload(preload: str) -> tuple[str, str] | None:
    """(kind, path) of the BLAS in LD_PRELOAD that wins symbol lookup (the first listed)."""
    for p in _split_preload(preload):
        kind = preloaded_kind(p)
        if kind:
            return kind, p
    return None


def openblas_coretype(corename: str | None, cpu_flags: Iterable[str]) -> str | None:
    """OPENBLAS_CORETYPE to force, or None. A DYNAMIC_ARCH OpenBLAS that does not know the CPU
    model falls back to its generic Prescott (SSE3) kernels: Debian's 0.3.21 does so on this
    project's Xeons (cpu model 207) and runs a 1024^2 sgemm at 45-60 GFLOP/s (10-20 on a busy
    box) instead of 200-280 with its AVX-512 kernels. Only that fallback is overridden, from the CPU's own flags."""
    if (corename or "").lower() != "prescott":
        return None
    flags = set(cpu_flags)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def plan_env(environ: Mapping[str, str], choice: Choice, cores: int,
             openblas_core: str | None = None) -> dict[str, str] | None:
    """The environment to re-execute with, or None when this one is already right. A BLAS
    already in LD_PRELOAD (by hand, or inherited from a parent) is kept, not doubled.
    `openblas_core`: an OPENBLAS_CORETYPE to set (see `openblas_coretype`) unless the user set one."""
    if choice.kind not in ("openblas", "mkl"):
        return None
    env = dict(environ)
    current = active_preload(env.get("LD_PRELOAD", ""))
    kind = current[0] if current else choice.kind
    if current is None:
        env["LD_PRELOAD"] = ":".join(p for p in (choice.path, env.get("LD_PRELOAD", "")) if p)
    env.update(thread_env(environ, cores, local_ranks(environ), kind))
    if kind == "openblas" and openblas_core and "OPENBLAS_CORETYPE" not in environ:
        env["OPENBLAS_CORETYPE"] = openblas_core
    return None if env == dict(environ) else env


def describe(platform: str, machine: str, environ: Mapping[str, str], choice: Choice,
             mapped: Iterable[str] | None, cores: int, core: str | None = None) -> str:
    """The banner's line. `mapped`: files mapped into this process (None: unknown), which
    tells a preload that really happened from one the loader refused; `core`: the kernels
    OpenBLAS picked (openblas_get_corename)."""
    if platform != "linux":
        return f"BLAS: {choice.note or 'platform default (Accelerate/Metal on macOS)'}"
    active = active_preload(environ.get("LD_PRELOAD", ""))
    if active is not None:
        kind, path = active
        real = {os.path.realpath(p) for p in set(mapped)} if mapped is not None else None
        if real is None or os.path.realpath(path) in real:
            threads = next((environ[v] for v in (_OWN_VAR[kind], "OMP_NUM_THREADS") if environ.get(v)),
                           str(cores))
            route = " (no pip BLAS for this machine)" if kind == "openblas" and machine == "aarch64" else ""
            kernels = f", {core} kernels" if core and kind == "openblas" else ""
            return f"BLAS: {NAMES[kind]} preloaded{route} ({path}), {threads} thread(s){kernels}"
        return (f"BLAS: mlx-cpu reference BLAS (slow): LD_PRELOAD names {path} but it is not "
                f"loaded; {_hint(machine)}")
    if choice.kind == "reference" and choice.note == "MLXDIST_BLAS=reference":
        return "BLAS: mlx-cpu reference BLAS (MLXDIST_BLAS=reference)"
    return f"BLAS: mlx-cpu reference BLAS (slow); {choice.note or _hint(machine)}"


# -- this process's facts ------------------------------------------------------------------


def find_openblas(candidates: Sequence[str] = OPENBLAS_CANDIDATES) -> str | None:
    for path in candidates:
        if Path(path).exists():
            return path
    return None


def mkl_prefixes() -> list[str]:
    """Where pip puts a wheel's data files (the mkl wheel's lib/): the venv or the Python
    prefix, and the user base for `pip install --user`."""
    return [sys.prefix, site.getuserbase()]


def find_mkl(prefixes: Sequence[str] | None = None) -> str | None:
    """<prefix>/lib/libmkl_rt.so.N from the PyPI mkl wheel (the newest N when several)."""
    for prefix in prefixes if prefixes is not None else mkl_prefixes():
        found = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")),
                       key=lambda p: (p.count("."), p))
        if found:
            return found[-1]
    return None


def machine() -> str:
    return _platform.machine()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def current_choice(environ: Mapping[str, str] | None = None) -> Choice:
    environ = os.environ if environ is None else environ
    req = request_from(environ)
    if sys.platform != "linux":
        return choose(req, sys.platform, machine(), None, None)
    openblas = find_openblas() if req in ("auto", "openblas") else None
    mkl = find_mkl() if req in ("auto", "mkl") and openblas is None else None
    return choose(req, sys.platform, machine(), openblas, mkl)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def openblas_corename(path: str) -> str | None:
    """The kernels a DYNAMIC_ARCH OpenBLAS picks on this CPU (loads it: call before a re-exec,
    or when it is preloaded anyway)."""
    import ctypes

    try:
        fn = ctypes.CDLL(path).openblas_get_corename
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    name = fn()
    return name.decode() if name else None


def _mapped_files() -> list[str] | None:
    try:
        with open("/proc/self/maps") as f:
            return [line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6]
    except OSError:
        return None


def status() -> str:
    """One line for the startup banner saying which BLAS the MLX CPU backend uses."""
    mapped = _mapped_files()
    active = active_preload(os.environ.get("LD_PRELOAD", "")) if sys.platform == "linux" else None
    core = None
    if active and active[0] == "openblas" and mapped is not None and any(
            os.path.basename(p).startswith("libopenblas") for p in mapped):
        core = openblas_corename(active[1])  # already loaded: no new library comes in
    return describe(sys.platform, machine(), os.environ, current_choice(), mapped, cores(), core)


def late_note() -> str | None:
    """Why the fast BLAS could not be preloaded when MLX came first (`mlxdist.fit`), or None."""
    if sys.platform != "linux" or "mlx" not in sys.modules or active_preload(os.environ.get("LD_PRELOAD", "")):
        return None
    choice = current_choice()
    if choice.kind not in ("openblas", "mkl"):
        return None
    return (f"BLAS: mlx was imported before mlxdist.fit(), too late to preload {choice.kind} ({choice.path}), so "
            "the CPU backend uses the slow reference BLAS; import mlx inside your build/loss functions, or start "
            f"with LD_PRELOAD={choice.path}")


def reexec_env() -> dict[str, str] | None:
    """The environment `ensure_blas` would re-exec this process with, or None when it would
    not (not Linux, already done, MLX already imported, nothing to change)."""
    if sys.platform != "linux" or os.environ.get(_MARK) == str(os.getpid()):
        return None
    if "mlx" in sys.modules or "mpi4py.MPI" in sys.modules:
        return None  # too late to re-exec safely
    choice = current_choice()
    core = None
    if choice.kind == "openblas" and "OPENBLAS_CORETYPE" not in os.environ:
        active = active_preload(os.environ.get("LD_PRELOAD", "")) or ("openblas", choice.path)
        if active[0] == "openblas":
            core = openblas_coretype(openblas_corename(active[1]), cpu_flags())
    env = plan_env(os.environ, choice, cores(), core)
    if env is not None:
        env[_MARK] = str(os.getpid())
    return env


def ensure_blas(argv: list[str] | None = None) -> None:
    """Re-exec once with the chosen BLAS preloaded and thread counts set, when that changes
    anything; call it before anything imports MLX (or mpi4py)."""
    env = reexec_env()
    if env is None:
        return
    args = argv if argv is not None else [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(args[0], args, env)


ensure_openblas = ensure_blas  # the old name, still called by the CLIs
