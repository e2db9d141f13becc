"""mlx-jaccl bootstrap: hostfiles from mlx.distributed_config, the device matrix, the
environment, and the one-line reason it cannot run (which is the case on this Linux box)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from mlxdist.cluster import jaccl
from mlxdist.cluster.jaccl import (
    RankFacts,
    check,
    device_matrix,
    jaccl_env,
    missing,
    read_mlx_hostfile,
)
from tests.helpers import env, mpirun_path

# What `mlx.distributed_config --backend jaccl` writes for three Macs cabled in a mesh
# (format of mlx 0.32.4's Hostfile.to_json).
SAMPLE = {
    "backend": "jaccl",
    "envs": ["MLX_METAL_FAST_SYNCH=1"],
    "hosts": [
        {"ssh": "studio.local", "ips": ["192.168.1.10"], "rdma": [None, "rdma_en3", "rdma_en4"]},
        {"ssh": "mbp.local", "ips": ["192.168.1.11"], "rdma": ["rdma_en2", None, "rdma_en3"]},
        {"ssh": "mini.local", "ips": ["192.168.1.12"], "rdma": ["rdma_en5", ["rdma_en2", "rdma_en4"], None]},
    ],
}


def mac(host: str, ip: str = "", devices=("rdma_en2",), macos="26.2", built=True) -> RankFacts:
    return RankFacts(host=host, ip=ip, macos=macos, jaccl_built=built, devices=list(devices))


def test_reads_distributed_config_hostfile_like_mlx_does(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(SAMPLE, indent=4))
    hf = read_mlx_hostfile(path)
    assert [(h.host, h.ips) for h in hf.hosts] == [("studio.local", ["192.168.1.10"]), ("mbp.local", ["192.168.1.11"]),
                                                    ("mini.local", ["192.168.1.12"])]
    assert hf.backend == "jaccl" and hf.envs == ["MLX_METAL_FAST_SYNCH=1"]
    common = pytest.importorskip("mlx._distributed_utils.common")
    theirs = common.Hostfile.from_file(path)
    assert [(h.ssh_hostname, h.ips, h.rdma) for h in theirs.hosts] == [tuple(h) for h in hf.hosts]
    assert jaccl.is_mlx_hostfile(path)
    assert jaccl.to_openmpi_hostfile(hf) == "studio.local slots=1\nmbp.local slots=1\nmini.local slots=1\n"


def test_reads_bare_list_and_ring_hostfiles(tmp_path):
    path = tmp_path / "ring.json"
    path.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "a", "ips": ["10.0.0.1"]},
                                {"ssh": "b"}]))
    hf = read_mlx_hostfile(path)
    assert [(h.host, h.ips, h.rdma) for h in hf.hosts] == [("a", ["10.0.0.1"], []), ("a", ["10.0.0.1"], []),
                                                           ("b", [], [])]
    assert jaccl.to_openmpi_hostfile(hf) == "a slots=2\nb slots=1\n"
    plain = tmp_path / "openmpi.hosts"
    plain.write_text("studio slots=1\n")
    assert not jaccl.is_mlx_hostfile(plain)


@pytest.mark.parametrize("text,message", [
    ("{not json", "not valid JSON"),
    ('{"hosts": []}', "lists no hosts"),
    ('[{"ips": ["1.2.3.4"]}]', "host 0 has no 'ssh' name"),
    ('[{"ssh": "a", "ips": "1.2.3.4"}]', "host 0 \\(a\\): 'ips' must be a list"),
    ('{"hosts": [{"ssh": "a"}], "envs": ["NOEQUALS"]}', "'envs' must be a list of NAME=VALUE"),
    # The ranks apply envs themselves (init_jaccl): a file must not preload a library into them.
    ('{"hosts": [{"ssh": "a"}], "envs": ["MLX_X=1", "LD_PRELOAD=/tmp/x.so"]}',
     "'envs' sets 'LD_PRELOAD'; a hostfile may carry MLX_\\* settings only"),
])
def test_bad_hostfile_gives_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        read_mlx_hostfile(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not found"):
        read_mlx_hostfile(tmp_path / "nope.json")


def test_device_matrix_follows_rank_order_not_file_order(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(SAMPLE))
    hf = read_mlx_hostfile(path)
    # mpirun placed the mini first, then the studio, then the MacBook; hostnames without .local.
    facts = [mac("mini"), mac("studio"), mac("mbp")]
    m = device_matrix(facts, hf)
    assert m == [[None, "rdma_en5", ["rdma_en2", "rdma_en4"]],
                 ["rdma_en4", None, "rdma_en3"],
                 ["rdma_en3", "rdma_en2", None]]
    # In file order it is exactly the file's matrix, what mlx.launch would write.
    assert device_matrix([mac("studio.local"), mac("mbp.local"), mac("mini.local")], hf) == \
        [h["rdma"] for h in SAMPLE["hosts"]]


def test_device_matrix_errors_name_the_hosts():
    hf = jaccl.MlxHostfile([jaccl.MlxHost("a", [], [None, "rdma_en2"]), jaccl.MlxHost("b", [], [None, None])])
    with pytest.raises(ValueError, match="no RDMA device from b to a"):
        device_matrix([mac("a"), mac("b")], hf, source="hostfile h.json")
    with pytest.raises(ValueError, match="rank on host c has no entry"):
        device_matrix([mac("a"), mac("c")], hf)
    with pytest.raises(ValueError, match="lists 2 hosts but the job has 3 ranks"):
        device_matrix([mac("a"), mac("b"), mac("c")], hf)
    with pytest.raises(ValueError, match="needs the device matrix: run mlx.distributed_config"):
        device_matrix([mac("a"), mac("b"), mac("c")])
    # Two Macs, one cable: no hostfile needed.
    assert device_matrix([mac("a", devices=["rdma_en3"]), mac("b", devices=["rdma_en5"])]) == \
        [[None, "rdma_en3"], ["rdma_en5", None]]


def test_env_points_everyone_at_rank_zero():
    facts = [mac("studio", "192.168.1.10"), mac("mbp", "192.168.1.11")]
    m = device_matrix(facts)
    e = jaccl_env(facts, m, 1, 40123, "/tmp/devs.json")
    assert e == {"MLX_RANK": "1", "MLX_JACCL_COORDINATOR": "192.168.1.10:40123", "MLX_IBV_DEVICES": "/tmp/devs.json"}
    with pytest.raises(ValueError, match="rank 0 \\(studio\\) has no IP"):
        jaccl_env([mac("studio"), mac("mbp")], m, 0, 1, "x")


@pytest.mark.parametrize("facts,expected", [
    (mac("mbp", macos=None), "host mbp is not a Mac"),
    (mac("mbp", macos="15.6.1"), "host mbp runs macOS 15.6.1; RDMA over Thunderbolt needs macOS 26.2"),
    (mac("mbp", macos="26.1"), "needs macOS 26.2"),
    (mac("mbp", built=False), "this MLX build has no jaccl backend"),
    (mac("mbp", devices=[]), "shows no rdma_\\* devices"),
])
def test_missing_says_what_in_one_line(facts, expected):
    line = missing(facts)
    assert line is not None and "\n" not in line
    assert line.startswith("dist.backend=mlx-jaccl: host mbp")
    assert re.search(expected, line)


def test_ready_mac_passes_and_check_reports_first_rank_in_order():
    assert missing(mac("studio", macos="26.2")) is None and missing(mac("studio", macos="27.0.1")) is None
    assert check([mac("a"), mac("b", macos="15.0"), mac("c", built=False)]).startswith("dist.backend=mlx-jaccl: host b ")
    assert check([mac("a"), mac("b")]) is None


def test_an_mlx_without_jaccl_is_force_reinstalled():
    """A Mac upgraded to 26.2 after installing keeps the mlx wheel without jaccl, under the same
    version number: `pip install -U mlx` does nothing, so the line says what does."""
    line = missing(mac("studio", macos="26.2", built=False))
    assert "pip install --force-reinstall --no-cache-dir mlx mlx-metal" in line
    assert jaccl.JACCL_REINSTALL == "pip install --force-reinstall --no-cache-dir mlx mlx-metal"
    assert "pip install -U mlx keeps it" in line and "\n" not in line


def test_jaccl_reads_the_real_macos_version_not_the_sdk_compatibility_one():
    # Python built against an older SDK is told 16.0 on macOS 26.2; sw_vers says 26.2.
    real = jaccl.macos_version("darwin", "16.0", "26.2\n")
    assert real == "26.2" and missing(mac("studio", macos=real)) is None
    assert "needs macOS 26.2" in missing(mac("studio", macos=jaccl.macos_version("darwin", "26.1", "26.1\n")))
    seen = {}

    def run(argv, **kw):
        seen.update(argv=argv, compat=kw["env"].get("SYSTEM_VERSION_COMPAT"))
        return subprocess.CompletedProcess(argv, 0, "26.2\n", "")

    assert jaccl.read_sw_vers("darwin", run) == "26.2\n"
    assert seen == {"argv": ["sw_vers", "-productVersion"], "compat": "0"}
    assert jaccl.read_sw_vers("linux", run) is None

    def missing_tool(argv, **kw):
        raise FileNotFoundError(argv[0])

    assert jaccl.read_sw_vers("darwin", missing_tool) is None
    assert jaccl.macos_version("darwin", "16.0", jaccl.read_sw_vers("darwin", missing_tool)) == "16.0"


def test_this_machine_reports_what_is_missing():
    mx = pytest.importorskip("mlx.core")
    facts = jaccl.local_facts("127.0.0.1")
    assert facts.jaccl_built == mx.distributed.is_available(backend="jaccl")
    assert facts.macos == jaccl.this_macos()
    if sys.platform != "darwin":
        assert missing(facts).startswith(f"dist.backend=mlx-jaccl: host {facts.host} is not a Mac")


SCRIPT = """
from mlxdist.cluster.world import init_world
from mlxdist.cluster import jaccl
w = init_world()
try:
    jaccl.bootstrap(w, "127.0.0.1")
except RuntimeError as e:
    print(f"rank {w.rank}: {e}", flush=True)
"""


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal path, which a Mac with RDMA would not take")
def test_bootstrap_under_mpirun_refuses_with_the_same_line_on_every_rank():
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH",
           sys.executable, "-c", SCRIPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(x for x in out.stdout.splitlines() if x.startswith("rank "))
    assert len(lines) == 2
    assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1]
    assert "is not a Mac" in lines[0]


def test_a_binary_file_is_not_an_mlx_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"\xff\xfe\x00{binary")
    assert not jaccl.is_mlx_hostfile(path)
    path.write_bytes(b"  \n[{\"ssh\": \"a\"}]")
    assert jaccl.is_mlx_hostfile(path)
