"""The safetensors package as our codec: what it must not change (files written by the
hand-written encoder it replaced still load, a resume from one included) and what it must
not get wrong (strided arrays, 0-d arrays, empty files, metadata)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import zstandard
from helpers import FAST, assert_same_weights, final_weights, run_train
from safetensors import safe_open

from mlxdist.state import checkpoint as ckpt
from mlxdist.state import rank_state

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1"

# The encoder this project wrote checkpoints with until the safetensors package replaced it,
# kept verbatim so that tests can make old-format files of any content.
_OLD_CODES = {"<f4": "F32", "<f2": "F16", "<i4": "I32", "<i8": "I64", "<f8": "F64"}


def old_to_safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": metadata or {}}
    offset, blobs = 0, []
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        blob = a.tobytes()
        header[name] = {"dtype": _OLD_CODES[a.dtype.str], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def to_old_format(path: Path) -> None:
    """Rewrite a checkpoint directory as the old code wrote it: every array file as
    `NAME.safetensors.zst` from the old encoder, and a manifest to match."""
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    files = {}
    for name in ("model", "optimizer", "sync"):
        for f in (path / f"{name}.safetensors", path / f"{name}.safetensors.zst"):
            if f.is_file():
                arrays = ckpt.read_arrays(f)
                f.unlink()
                old = path / f"{name}.safetensors.zst"
                old.write_bytes(zstandard.ZstdCompressor(level=3).compress(old_to_safetensors(arrays)))
                files[old.name] = {"sha256": ckpt.file_sha256(old), "bytes": old.stat().st_size}
    files["state.json"] = manifest["files"]["state.json"]
    manifest["files"] = files
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest, indent=1))


def test_committed_old_checkpoint_loads():
    """tests/fixtures/checkpoint_v1 was written by the old code itself (see its README)."""
    path = FIXTURE / "checkpoints" / "step_00000007"
    assert ckpt.verify(path) is None
    got = ckpt.load(path)
    w = got.weights
    assert np.array_equal(w["embed.weight"], (np.arange(12, dtype=np.float32).reshape(4, 3) / 7).astype(np.float32))
    assert w["half"].dtype == np.float16 and w["half"].tolist() == [0.5, -2.0, 65504.0]
    assert w["empty"].shape == (0, 3) and w["empty"].dtype == np.float32
    assert w["layers.0.scale"].tolist() == [1.5]  # the old encoder stored a 0-d array as shape [1]
    assert got.optimizer["step"].dtype == np.int64 and got.optimizer["step"].tolist() == [7]
    assert np.array_equal(got.optimizer["v.embed.weight"], np.full((4, 3), 1e-8, np.float32))
    assert got.sync["momentum.0"].dtype == np.float64 and got.sync["momentum.0"].tolist() == [-1, -0.5, 0, 0.5, 1]
    assert got.sync["cursor"].dtype == np.int32 and got.state["step"] == 7
    assert ckpt.load_latest(FIXTURE / "checkpoints").path == path


def test_committed_old_rank_state_and_metadata_load():
    arrays, opt_step = rank_state.load(FIXTURE / "rank_state", 7, 0, 1, ["h0"])
    assert opt_step == 7 and arrays["rank.samples"].tolist() == [3, 4]
    assert arrays["rank.residual.0"].tolist() == [[0.125, -0.5]]
    with safe_open(str(FIXTURE / "meta.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt", "note": "naïve ✓"}
        assert f.get_tensor("b").tolist() == [0, 1, 2] and f.get_tensor("a").tolist() == [2.0]


def test_old_bytes_decode_and_new_bytes_follow_the_same_spec():
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((5, 3)).astype(np.float32), "h": np.arange(4, dtype=np.float16),
              "i": np.arange(3, dtype=np.int32), "l": np.array([2**40], np.int64), "d": np.array([0.1, 0.2]),
              "e": np.zeros((0, 2), np.float32)}
    for name, a in ckpt.from_safetensors(old_to_safetensors(arrays, {"k": "v"})).items():
        assert a.dtype == arrays[name].dtype and np.array_equal(a, arrays[name])
    raw = ckpt.to_safetensors(arrays, {"k": "v"})
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and raw[8 + n - 1 : 8 + n] in (b" ", b"}")
    header = json.loads(raw[8 : 8 + n])
    assert header.pop("__metadata__") == {"k": "v"}
    body = raw[8 + n :]
    for name, info in header.items():  # what the old decoder did, entry by entry
        b, e = info["data_offsets"]
        a = np.frombuffer(body[b:e], dtype=arrays[name].dtype).reshape(info["shape"])
        assert np.array_equal(a, arrays[name])
    # The old encoder's output for one float32 array is byte for byte the package's, metadata aside.
    one = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    assert ckpt.to_safetensors(one, {"a": "b"}) == old_to_safetensors(one, {"a": "b"})


def test_strided_zero_d_and_empty_arrays_round_trip(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {"t": base.T, "s": base[::2, 1::2], "f": np.asfortranarray(base), "z": np.array(2.5, np.float32),
              "be": np.arange(3, dtype=">f4"), "empty": np.zeros((3, 0), np.float32), "u16": np.arange(3, dtype=np.uint16)}
    for got in (ckpt.from_safetensors(ckpt.to_safetensors(arrays)), _via_file(tmp_path, arrays, None),
                _via_file(tmp_path, arrays, 3)):
        for name, a in arrays.items():
            assert got[name].shape == a.shape and np.array_equal(got[name], a), name
        assert got["z"].ndim == 0 and got["be"].dtype == np.float32
        got["t"][0, 0] = -1  # writable, and not a view of the file
    assert ckpt.from_safetensors(ckpt.to_safetensors({})) == {}
    assert _via_file(tmp_path, {}, None) == {} and _via_file(tmp_path, {}, 3) == {}


def _via_file(tmp_path: Path, arrays: dict, level: int | None) -> dict:
    path = tmp_path / ckpt.array_file("x", level)
    ckpt.write_arrays(path, arrays, level)
    return ckpt.read_arrays(path)


def test_unsupported_dtype_and_unreadable_file_are_checkpoint_errors(tmp_path):
    for level in (None, 3):
        with pytest.raises(ckpt.CheckpointError, match="dtype"):
            ckpt.write_arrays(tmp_path / ckpt.array_file("o", level), {"o": np.array([object()], dtype=object)}, level)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 64)  # e.g. another tool's file that merely has our name
    with pytest.raises(ckpt.CheckpointError, match="unreadable"):
        ckpt.read_arrays(bad)


def test_mixed_old_and_new_checkpoints_in_one_directory(tmp_path):
    w = {"a": np.ones(3, np.float32)}
    ckpt.save(tmp_path, 1, w, {"m.a": w["a"]}, {"step": 1})
    to_old_format(tmp_path / "step_00000001")
    ckpt.save(tmp_path, 2, {"a": w["a"] * 2}, {"m.a": w["a"]}, {"step": 2})
    assert (tmp_path / "step_00000001" / "model.safetensors.zst").is_file()
    assert (tmp_path / "step_00000002" / "model.safetensors").is_file()
    assert [ckpt.load(p).weights["a"].tolist() for p in ckpt.list_checkpoints(tmp_path)] == [[1] * 3, [2] * 3]
    assert ckpt.apply_retention(tmp_path, keep_last=1, keep_best=False) == [tmp_path / "step_00000001"]


def test_resume_from_old_format_checkpoint_equals_uninterrupted(tmp_path):
    """A run resumed from a checkpoint in the old layout (written by the old encoder, weights
    zstd-compressed) ends with the weights of a run that was never interrupted."""
    common = [*FAST, "train.steps=8", "checkpoint.every=4"]
    full, part = tmp_path / "full", tmp_path / "part"
    r = run_train([*common, f"train.out_dir={full}"])
    assert r.returncode == 0, r.stderr
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_00000008")
    to_old_format(part / "checkpoints" / "step_00000004")
    assert not (part / "checkpoints" / "step_00000004" / "model.safetensors").exists()
    r = run_train([*common, f"train.out_dir={part}", "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    assert f"resumed from {part}/checkpoints/step_00000004" in r.stderr
    assert (part / "checkpoints" / "step_00000008" / "model.safetensors").is_file()
    assert_same_weights(final_weights(full), final_weights(part), atol=1e-6)


def test_rank_state_round_trip_keeps_0d_and_dtypes(tmp_path):
    info = rank_state.RankStateInfo(step=3, rank=1, world_size=2, hosts=["a", "b"], optimizer_step=9)
    arrays = {"rank.samples": np.array([1, 2], np.int64), "rank.residual.0": np.arange(6, dtype=np.float32)[::2],
              "scalar": np.array(4.0, np.float32)}
    rank_state.save(tmp_path, info, arrays, keep=1)
    got, opt_step = rank_state.load(tmp_path, 3, 1, 2, ["a", "b"])
    assert opt_step == 9 and got["scalar"].shape == () and got["rank.residual.0"].tolist() == [0, 2, 4]
    assert got["rank.samples"].dtype == np.int64
