import json

import numpy as np
import pytest

from mlxdist.state import checkpoint as ckpt


def _weights(seed):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


def test_roundtrip_and_manifest(tmp_path):
    w = _weights(0)
    path = ckpt.save(tmp_path, 5, w, {"m.b": np.ones(5, np.float32)}, {"step": 5, "config": {"x": 1}})
    assert path.name == "step_00000005"
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors", "state.json"}
    got = ckpt.load(path)
    assert all(np.array_equal(got.weights[k], w[k]) for k in w)
    assert got.state["step"] == 5 and got.optimizer["m.b"].tolist() == [1.0] * 5
    assert not list(tmp_path.glob(".tmp*")), "temporary directory left behind"


def test_safetensors_layout_is_standard():
    raw = ckpt.to_safetensors({"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert header["x"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert np.frombuffer(raw[8 + n :], np.float32).tolist() == list(range(6))


def test_weights_open_with_any_safetensors_reader(tmp_path):
    """The array files are plain safetensors: memory-mapped by safe_open, read by MLX, no mlxdist."""
    import mlx.core as mx
    from safetensors import safe_open

    w = _weights(1)
    path = ckpt.save(tmp_path, 1, w, {}, {"step": 1}, sync={"momentum.0": np.zeros(2, np.float32)})
    with safe_open(str(path / "model.safetensors"), framework="np") as f:
        assert sorted(f.keys()) == sorted(w) and np.array_equal(f.get_tensor("b"), w["b"])
    assert np.array_equal(np.array(mx.load(str(path / "model.safetensors"))["a.weight"]), w["a.weight"])
    assert ckpt.load(path).sync["momentum.0"].tolist() == [0, 0]
    assert {f.name for f in path.iterdir()} == {"model.safetensors", "optimizer.safetensors", "sync.safetensors",
                                                "state.json", "manifest.json"}
    # The package creates its files 0600; ours follow the umask like the JSON beside them.
    assert (path / "model.safetensors").stat().st_mode == (path / "state.json").stat().st_mode


def test_corrupt_newest_falls_back_with_warning(tmp_path):
    for step in (1, 2, 3):
        ckpt.save(tmp_path, step, _weights(step), {}, {"step": step})
    newest = tmp_path / "step_00000003" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    warnings = []
    got = ckpt.load_latest(tmp_path, warn=warnings.append)
    assert got.state["step"] == 2
    assert len(warnings) == 1 and "step_00000003" in warnings[0] and "sha256" in warnings[0]
    assert newest.exists(), "a corrupt checkpoint must never be deleted"
    with pytest.raises(ckpt.CheckpointError, match="sha256"):
        ckpt.load(tmp_path / "step_00000003")


def test_unfinished_write_is_skipped(tmp_path):
    ckpt.save(tmp_path, 1, _weights(1), {}, {"step": 1})
    p = ckpt.save(tmp_path, 2, _weights(2), {}, {"step": 2})
    (p / "manifest.json").unlink()  # as if the process died before the manifest
    assert ckpt.load_latest(tmp_path, warn=lambda m: None).state["step"] == 1


def test_retention_keeps_last_and_best(tmp_path):
    losses = {1: 0.5, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.95}
    for step, loss in losses.items():
        ckpt.save(tmp_path, step, _weights(step), {}, {"step": step, "eval_loss": loss})
        ckpt.apply_retention(tmp_path, keep_last=2, keep_best=True)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000004", "step_00000005"]
