"""Which BLAS MLX's CPU backend gets (system OpenBLAS > pip MKL > reference), with how many
threads, and that the re-exec really preloads it (banner and matmul rate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import env

from mlxdist import blas
from mlxdist.blas import Choice, choose, describe, find_mkl, find_openblas, plan_env, thread_env

OB = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
MKL = "/venv/lib/libmkl_rt.so.3"


@pytest.mark.parametrize(("request_", "platform", "machine", "openblas", "mkl", "kind", "path"), [
    ("auto", "linux", "x86_64", OB, MKL, "openblas", OB),          # system lib first
    ("auto", "linux", "x86_64", None, MKL, "mkl", MKL),            # then the pip one
    ("auto", "linux", "x86_64", None, None, "reference", None),    # then the reference BLAS
    ("mkl", "linux", "x86_64", OB, MKL, "mkl", MKL),               # forced
    ("openblas", "linux", "x86_64", None, MKL, "reference", None),  # forced, absent: no silent MKL
    ("reference", "linux", "x86_64", OB, MKL, "reference", None),
    ("auto", "linux", "aarch64", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0", None, "openblas",
     "/usr/lib/aarch64-linux-gnu/libopenblas.so.0"),
    ("auto", "linux", "aarch64", None, None, "reference", None),
    ("mkl", "linux", "aarch64", None, None, "reference", None),
    ("auto", "darwin", "arm64", None, None, "platform", None),
    ("fast please", "linux", "x86_64", None, MKL, "mkl", MKL),     # not understood: auto, said so
])
def test_choice(request_, platform, machine, openblas, mkl, kind, path):
    c = choose(request_, platform, machine, openblas, mkl)
    assert (c.kind, c.path) == (kind, path)
    if request_ == "fast please":
        assert "not understood" in c.note


def test_reference_hints_name_the_route_for_the_machine():
    x86 = choose("auto", "linux", "x86_64", None, None).note
    assert "pip install mkl" in x86 and "libopenblas0-pthread" in x86
    arm = choose("auto", "linux", "aarch64", None, None).note
    assert "x86_64 only" in arm and "apt-get install libopenblas0-pthread" in arm and "pip install" not in arm
    assert "no mkl wheel for aarch64" in choose("mkl", "linux", "aarch64", None, None).note
    assert "no system OpenBLAS" in choose("openblas", "linux", "x86_64", None, MKL).note


@pytest.mark.parametrize(("environ", "req"), [
    ({}, "auto"), ({"MLXDIST_BLAS": "MKL"}, "mkl"), ({"MLXDIST_NO_OPENBLAS": "1"}, "reference"),
    ({"MLXDIST_NO_OPENBLAS": "1", "MLXDIST_BLAS": "mkl"}, "mkl"),
])
def test_request_from_env(environ, req):
    assert blas.request_from(environ) == req


def test_finders_look_where_told(tmp_path):
    assert find_openblas([str(tmp_path / "nope.so.0")]) is None
    (tmp_path / "libopenblas.so.0").write_bytes(b"")
    assert find_openblas([str(tmp_path / "nope.so.0"), str(tmp_path / "libopenblas.so.0")]) == str(
        tmp_path / "libopenblas.so.0")
    venv, user = tmp_path / "venv", tmp_path / "user"
    (venv / "lib").mkdir(parents=True)
    (user / "lib").mkdir(parents=True)
    assert find_mkl([str(venv), str(user)]) is None
    for name in ("libmkl_rt.so", "libmkl_rt.so.2", "libmkl_rt.so.3"):
        (user / "lib" / name).write_bytes(b"")
    assert find_mkl([str(venv), str(user)]) == str(user / "lib" / "libmkl_rt.so.3")
    (venv / "lib" / "libmkl_rt.so.3").write_bytes(b"")
    assert find_mkl([str(venv), str(user)]) == str(venv / "lib" / "libmkl_rt.so.3")  # the venv first


@pytest.mark.parametrize(("cores", "ranks", "n"), [(2, 1, "2"), (2, 2, "1"), (2, 3, "1"), (16, 4, "4"),
                                                   (16, 3, "5"), (1, 1, "1"), (8, 0, "8")])
def test_threads_share_the_cores_among_local_ranks(cores, ranks, n):
    out = thread_env({}, cores, ranks, "mkl")
    assert {v: out[v] for v in blas.THREAD_VARS} == dict.fromkeys(blas.THREAD_VARS, n)


def test_threads_the_user_set_are_kept_and_followed():
    # The tests' OPENBLAS_NUM_THREADS=1 also means one MKL/OpenMP thread.
    assert thread_env({"OPENBLAS_NUM_THREADS": "1"}, 16, 1, "mkl") == {
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "MLXDIST_BLAS_THREADS": "OMP_NUM_THREADS=1,MKL_NUM_THREADS=1"}
    # The chosen library's own variable leads, then OMP_NUM_THREADS.
    both = {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}
    assert thread_env(both, 16, 1, "mkl")["OPENBLAS_NUM_THREADS"] == "5"
    assert thread_env(both, 16, 1, "openblas")["OPENBLAS_NUM_THREADS"] == "3"
    assert thread_env(both, 16, 1, "openblas")["MKL_NUM_THREADS"] == "5"


def test_threads_set_by_a_parent_are_redone_for_a_rank():
    parent = thread_env({}, 8, 1, "mkl")  # a single process set 8 threads ...
    rank = {**parent, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}  # ... then started 4 ranks here
    assert thread_env(rank, 8, blas.local_ranks(rank), "mkl")["MKL_NUM_THREADS"] == "2"
    # A value changed by hand after that is the user's again.
    assert thread_env({**rank, "MKL_NUM_THREADS": "3"}, 8, 4, "mkl")["OMP_NUM_THREADS"] == "3"


def test_local_ranks_from_mpi_env():
    assert blas.local_ranks({}) == 1
    assert blas.local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3
    assert blas.local_ranks({"MPI_LOCALNRANKS": "2"}) == 2
    assert blas.local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "x"}) == 1


def test_plan_env_preloads_once_and_then_leaves_it():
    mkl = Choice("mkl", MKL)
    first = plan_env({"LD_PRELOAD": "/x/libfoo.so"}, mkl, cores=4)
    assert first is not None and first["LD_PRELOAD"] == f"{MKL}:/x/libfoo.so"
    assert first["MKL_NUM_THREADS"] == "4"
    assert plan_env(first, mkl, cores=4) is None  # converged: no second re-exec
    # Under mpirun with 2 ranks here, the inherited settings are redone.
    rank = plan_env({**first, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, mkl, cores=4)
    assert rank is not None and rank["MKL_NUM_THREADS"] == "2" and rank["LD_PRELOAD"] == first["LD_PRELOAD"]
    # A BLAS preloaded by hand is kept, not doubled.
    hand = plan_env({"LD_PRELOAD": OB}, mkl, cores=4)
    assert hand is not None and hand["LD_PRELOAD"] == OB and hand["OPENBLAS_NUM_THREADS"] == "4"
    assert plan_env({}, Choice("reference"), cores=4) is None
    assert plan_env({}, Choice("platform"), cores=4) is None


def test_banner_names_what_is_loaded():
    ref = choose("auto", "linux", "x86_64", None, None)
    env_mkl = {"LD_PRELOAD": MKL, "MKL_NUM_THREADS": "2"}
    # Preloaded by hand (the complaint in the issue: it said "reference BLAS (slow)").
    assert describe("linux", "x86_64", env_mkl, ref, [MKL], 8) == (
        f"BLAS: Intel MKL (pip package mkl) preloaded ({MKL}), 2 thread(s)")
    assert "not loaded" in describe("linux", "x86_64", env_mkl, ref, ["/lib/libc.so.6"], 8)
    assert describe("linux", "x86_64", {}, ref, [], 8).startswith("BLAS: mlx-cpu reference BLAS (slow); pip install mkl")
    arm_ob = "/usr/lib/aarch64-linux-gnu/libopenblas.so.0"
    line = describe("linux", "aarch64", {"LD_PRELOAD": arm_ob}, Choice("openblas", arm_ob), None, 4)
    assert "system OpenBLAS preloaded (no pip BLAS for this machine)" in line and "4 thread(s)" in line
    assert describe("linux", "x86_64", {}, choose("reference", "linux", "x86_64", OB, MKL), [], 2) == (
        "BLAS: mlx-cpu reference BLAS (MLXDIST_BLAS=reference)")
    assert describe("darwin", "arm64", {}, choose("auto", "darwin", "arm64", None, None), None, 8).startswith(
        "BLAS: platform default")


def test_old_names_still_work():
    assert blas.ensure_openblas is blas.ensure_blas and callable(blas.status)


def test_the_test_process_itself_runs_with_the_fast_blas():
    """tests/conftest.py re-execs pytest with the preload, so in-process MLX tests do not
    crawl on the reference BLAS (and compute what the product's processes compute)."""
    import mlx.core as mx

    choice = blas.current_choice()
    if choice.kind not in ("openblas", "mkl"):
        pytest.skip(f"no OpenBLAS/MKL on this machine ({choice.note}): apt-get install libopenblas0-pthread")
    assert blas.active_preload(os.environ.get("LD_PRELOAD", "")) is not None, os.environ.get("LD_PRELOAD")
    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))
    assert "preloaded" in blas.status(), blas.status()


# -- the real thing, in subprocesses ---------------------------------------------------------

PROBE = """
import json, os, sys, time
from mlxdist.blas import ensure_openblas, status
ensure_openblas()
import mlx.core as mx
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b, a @ b)
best = 1e9
for _ in range(int(sys.argv[1])):
    t = time.perf_counter(); mx.eval(a @ b); best = min(best, time.perf_counter() - t)
print(json.dumps({"status": status(), "gflops": 2 * 1024 ** 3 / best / 1e9,
                  "threads": os.environ.get("MKL_NUM_THREADS")}))
"""


def _probe(request: str, reps: int, **extra: str) -> dict:
    e = {**env(), "MLXDIST_BLAS": request, **extra}
    for v in (*blas.THREAD_VARS, "LD_PRELOAD", "MLXDIST_BLAS_THREADS", "MLXDIST_NO_OPENBLAS"):
        if v not in extra:
            e.pop(v, None)
    r = subprocess.run([sys.executable, "-c", PROBE, str(reps)], env=e, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


_FAST = [pytest.param("openblas", marks=pytest.mark.skipif(
             sys.platform != "linux" or find_openblas() is None, reason="no system OpenBLAS")),
         pytest.param("mkl", marks=pytest.mark.skipif(
             sys.platform != "linux" or find_mkl() is None, reason="no pip mkl in this environment"))]


@pytest.mark.parametrize("kind", _FAST)
def test_preload_really_happens(kind):
    """The re-exec preloads the library (the banner reads /proc/self/maps), and a 1024^2 fp32
    matmul runs far above the reference BLAS's rate (~5 GFLOP/s here; ~130-250 with a fast one).
    Best-of timings, and a ratio against the reference measured now, so a busy box does not fail it."""
    fast = _probe(kind, 5)
    assert f"BLAS: {blas.NAMES[kind]} preloaded" in fast["status"], fast
    ref = _probe("reference", 2)
    assert ref["status"] == "BLAS: mlx-cpu reference BLAS (MLXDIST_BLAS=reference)"
    assert fast["gflops"] > 4 * ref["gflops"], (fast, ref)


@pytest.mark.parametrize("kind", _FAST)
def test_ranks_on_one_host_share_the_cores(kind):
    out = _probe(kind, 1, OMPI_COMM_WORLD_LOCAL_SIZE=str(blas.cores() * 2))
    assert out["threads"] == "1" and "1 thread(s)" in out["status"]


AVX512 = {"sse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


@pytest.mark.parametrize(("corename", "flags", "forced"), [
    ("Prescott", AVX512, "SkylakeX"),            # unknown CPU model: OpenBLAS's SSE3 fallback
    ("Prescott", {"sse3", "avx", "avx2", "fma"}, "Haswell"),
    ("Prescott", {"sse3"}, None),                 # really an old CPU
    ("SkylakeX", AVX512, None),                   # detected: leave it
    ("Zen", {"avx2", "fma"}, None),
    (None, AVX512, None),
])
def test_openblas_generic_fallback_is_overridden(corename, flags, forced):
    assert blas.openblas_coretype(corename, flags) == forced


def test_plan_env_forces_the_openblas_kernels_unless_the_user_did():
    ob = Choice("openblas", OB)
    assert plan_env({}, ob, 2, "SkylakeX")["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert plan_env({}, ob, 2, None).get("OPENBLAS_CORETYPE") is None
    assert plan_env({"OPENBLAS_CORETYPE": "Haswell"}, ob, 2, "SkylakeX")["OPENBLAS_CORETYPE"] == "Haswell"
    assert "OPENBLAS_CORETYPE" not in plan_env({}, Choice("mkl", MKL), 2, "SkylakeX")
    line = describe("linux", "x86_64", {"LD_PRELOAD": OB}, ob, None, 2, core="SkylakeX")
    assert line.endswith("2 thread(s), SkylakeX kernels")
