"""Every reader of the gate, fuzzed (issue 50): random and mutated bytes and structures give a
valid result or one `ConfigError` line (a hostfile's `LaunchError`, a checkpoint's
`CheckpointError`), never another exception, and never run code a file names.

Fast in CI: a fixed seed (derandomized) and a small example budget per reader. The longer
profile, by hand:

    HYPOTHESIS_PROFILE=long python -m pytest -q -n 0 tests/test_fuzz_gate.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mlxdist import gate
from mlxdist.config import ConfigError, load_config
from mlxdist.state import checkpoint as ckpt

settings.register_profile("ci", max_examples=60, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("long", max_examples=3000, derandomize=False, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ONE_LINE = (ConfigError, ckpt.CheckpointError)

# A module that says so when imported or called: a reader that runs code a file names trips it.
SENTINEL = "fuzz_sentinel_module"


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sentinel")
    marker = d / "ran"
    (d / f"{SENTINEL}.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
                                      f"def boom(*a, **k):\n    Path({str(marker)!r}).write_text('called')\n")
    sys.path.insert(0, str(d))
    yield marker
    sys.path.remove(str(d))
    assert not marker.exists(), "a reader imported or called code a file named"
    assert SENTINEL not in sys.modules


def _one_line(e: BaseException) -> None:
    assert isinstance(e, ONE_LINE), f"{type(e).__name__}: {e}"
    assert "\n" not in str(e).strip(), str(e)


# -- plain data as files hold it ----------------------------------------------------------------

names = st.sampled_from(["step", "position", "lr_scale", "config", "files", "run_id", "sha256", "bytes", "hosts",
                         "loop_state", "user", "dataclass", "fields", "tensor", "dtype", "value", "dict", "list",
                         "__md_tensors__", "__md_rows__", f"{SENTINEL}:boom", "os:system", "subprocess:run"])
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=20) | names)
trees = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(names | st.text(max_size=5),
                                                                                         kids, max_size=4),
                     max_leaves=30)


def _mutations(data: bytes) -> st.SearchStrategy[bytes]:
    """`data` with a byte flipped, cut short, a run replaced, or bytes inserted."""
    n = len(data)
    flip = st.tuples(st.integers(0, n - 1), st.integers(0, 255)).map(lambda t: data[:t[0]] + bytes([t[1]]) + data[t[0] + 1:])
    cut = st.integers(0, n).map(lambda i: data[:i])
    splice = st.tuples(st.integers(0, n), st.binary(max_size=40)).map(lambda t: data[:t[0]] + t[1] + data[t[0]:])
    return flip | cut | splice | st.binary(max_size=200)


# -- YAML and configs ---------------------------------------------------------------------------

CONFIG = b"""train:
  steps: 3
  lr: 3.0e-4
  out_dir: runs/x
model:
  preset: tiny
nodes:
  studio: {batch_size: 5}
  default: &d {batch_size: 3}
task:
  args: {a: *d, b: [1, 2]}
"""


@given(data=_mutations(CONFIG))
def test_a_config_file_is_a_config_or_one_line(tmp_path, data):
    f = tmp_path / "c.yaml"
    f.write_bytes(data)
    try:
        load_config(f)
    except Exception as e:  # noqa: BLE001 - the property: nothing but the one line
        _one_line(e)


@given(text=st.text(alphabet=st.sampled_from(list("ab:&*[]{},- \n!'\"<>|?%@#0123\t")), max_size=120))
def test_yaml_text_is_plain_data_or_one_line(text):
    try:
        value = gate.load_yaml(text, "f.yaml")
    except Exception as e:  # noqa: BLE001
        _one_line(e)
        return
    _plain(value)


def _plain(v) -> None:
    """YAML's plain data: scalars, lists, and mappings whose keys are scalars (no objects)."""
    import datetime

    if isinstance(v, list):
        for x in v:
            _plain(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            assert k is None or isinstance(k, (bool, int, float, str, datetime.date)), repr(k)
            _plain(x)
    else:
        assert v is None or isinstance(v, (bool, int, float, str, bytes, datetime.date)), repr(v)


# -- JSON against schemas -------------------------------------------------------------------------

@given(value=trees)
def test_state_json_is_checked_or_one_line(tmp_path, value):
    (tmp_path / "state.json").write_text(json.dumps(value))
    try:
        state = ckpt.read_state(tmp_path)
    except Exception as e:  # noqa: BLE001
        _one_line(e)
        return
    assert isinstance(state, dict) and isinstance(state["step"], int)
    ckpt.CheckpointMeta.from_dict(state)  # what the trainer builds of it


@given(data=st.binary(max_size=300) | st.text(max_size=100).map(str.encode))
def test_json_bytes_are_json_or_one_line(tmp_path, data):
    f = tmp_path / "x.json"
    f.write_bytes(data)
    try:
        gate.read_json(f, "file", gate.Tree())
    except Exception as e:  # noqa: BLE001
        _one_line(e)


# -- checkpoints ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    state = ckpt.CheckpointMeta(config={"model": {"preset": "tiny"}}).to_dict() | {"step": 2}
    return ckpt.save(root, 2, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"m.w": np.zeros((2, 3), np.float32)},
                     state, extra={"task": {"state/x": np.ones(2, np.float32)}})


def _fresh_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / f"copy{len(list(tmp_path.iterdir()))}" / src.name
    shutil.copytree(src, dst)
    ckpt._WHOLE.clear()
    return dst


@given(which=st.sampled_from(["manifest.json", "state.json", "model.safetensors", "task.safetensors"]),
       data=st.data(), rehash=st.booleans())
def test_a_mutated_checkpoint_loads_or_is_one_line(checkpoint, tmp_path, sentinel, which, data, rehash):
    d = _fresh_copy(checkpoint, tmp_path)
    original = (d / which).read_bytes()
    mutated = data.draw(_mutations(original))
    assume(mutated != original)
    (d / which).write_bytes(mutated)
    if rehash and which != "manifest.json":  # someone who edits a file and its checksum
        manifest = json.loads((d / "manifest.json").read_text())
        manifest["files"][which] = {"sha256": ckpt.file_sha256(d / which), "bytes": len(mutated)}
        (d / "manifest.json").write_text(json.dumps(manifest))
    problem = ckpt.verify(d)
    assert problem is None or isinstance(problem, str)
    if problem is not None:
        assert not rehash or which == "manifest.json", problem
        return
    try:
        loaded = ckpt.load(d, verified=True)
    except Exception as e:  # noqa: BLE001
        _one_line(e)
        return
    assert all(isinstance(a, np.ndarray) for a in loaded.weights.values())


@given(manifest=trees)
def test_any_manifest_verifies_only_if_it_lists_every_file(checkpoint, tmp_path, manifest):
    d = _fresh_copy(checkpoint, tmp_path)
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.verify(d) is not None  # no tree of names can list the right checksums


@given(data=st.binary(max_size=400))
def test_compressed_bytes_decompress_within_the_cap_or_one_line(tmp_path, data):
    import zstandard

    f = tmp_path / "model.safetensors.zst"
    f.write_bytes(zstandard.ZstdCompressor().compress(data) if data[:1] == b"z" else data)
    try:
        ckpt.read_arrays(f)
    except Exception as e:  # noqa: BLE001
        _one_line(e)


# -- a your-loop checkpoint's state tree ---------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank():
    with pytest.MonkeyPatch.context() as mp:
        for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "MLXDIST_CONFIG"):
            mp.delenv(var, raising=False)
        import mlxdist.torch as md

        md.init(device="cpu")
        yield md


@given(tree=trees)
def test_a_your_loop_state_tree_is_data_or_one_line(sentinel, one_rank, tree):
    import torch

    md = one_rank
    unpack = md._Unpacker("fuzz", {"state/x": np.ones(2, np.float32)}, {})
    try:
        value = unpack.state("carry", {"__md_tensors__": tree})
    except Exception as e:  # noqa: BLE001
        _one_line(e)
        return
    assert not isinstance(value, type) and not callable(value) or isinstance(value, torch.Tensor)


# -- hostfiles ------------------------------------------------------------------------------------

@given(data=_mutations(b"studio.local slots=2\n# a comment\nmacbook max_slots=1\n10.0.0.3\n"))
def test_a_hostfile_is_hosts_or_one_line(tmp_path, data):
    from mlxdist.launch.hosts import LaunchError, read_hostfile

    f = tmp_path / "hosts"
    f.write_bytes(data)
    try:
        hosts = read_hostfile(f)
    except LaunchError as e:
        assert "\n" not in str(e).strip()
        return
    assert all(1 <= h.slots <= 1024 and not h.name.startswith("-") for h in hosts)


@given(value=trees)
def test_an_mlx_json_hostfile_is_hosts_or_one_line(tmp_path, value):
    from mlxdist.cluster.jaccl import read_mlx_hostfile

    f = tmp_path / "hosts.json"
    f.write_text(json.dumps(value))
    try:
        read_mlx_hostfile(f)
    except ValueError as e:  # ConfigError is one; the module's own lines are ValueErrors
        assert "\n" not in str(e).strip()


@given(value=trees)
def test_a_rank_state_info_is_used_or_said_missing(tmp_path, value):
    from mlxdist.state import rank_state

    d = tmp_path / "step_00000002"
    d.mkdir(exist_ok=True)
    (d / "rank0.json").write_text(json.dumps(value))
    (d / "rank0.safetensors").write_bytes(b"not arrays")
    with pytest.raises(rank_state.RankStateMissing):
        rank_state.load(tmp_path, 2, 0, 1, ["h"])
