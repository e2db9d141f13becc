"""Files from elsewhere pass one gate (issue 50): a your-loop checkpoint names no code that runs,
a manifest that does not list every file never verifies, `state.json` of the wrong shape is one
line naming the file and field, a compressed file that declares GiBs is refused in pieces, and
YAML with duplicate keys or an alias bomb is refused before it costs memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zstandard
from helpers import FAST, env, run_train

from mlxdist import gate
from mlxdist.config import ConfigError, load_config
from mlxdist.state import checkpoint as ckpt

# A your-loop script: saves a dataclass carry, then loads it back as a fresh process would.
LOOP = """
import json, sys
from dataclasses import dataclass
import torch
import mlxdist.torch as md

@dataclass
class Carry:
    z: torch.Tensor
    steps: int

md.init()
model = torch.nn.Linear(2, 2)
run_dir, mode = sys.argv[1], sys.argv[2]
if mode == "save":
    md.save_checkpoint(run_dir, 3, model, carry=Carry(z=torch.ones(2), steps=4), epoch=1)
else:
    got = md.load_checkpoint(run_dir, model, classes=[Carry] if mode == "welcome" else ())
    carry = got["carry"]
    print(json.dumps({"type": type(carry).__name__, "steps": carry.get("steps") if isinstance(carry, dict) else carry.steps}))
"""


def _rehash(step_dir: Path) -> None:
    """What anyone who can write the run folder can do: edit a file and re-hash the manifest."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in manifest["files"]:
        f = step_dir / name
        manifest["files"][name] = {"sha256": ckpt.file_sha256(f), "bytes": f.stat().st_size}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _loop(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return subprocess.run([sys.executable, str(script), str(tmp_path / "run"), mode], capture_output=True, text=True,
                          env=env(), timeout=120, cwd=tmp_path)


@pytest.fixture(scope="module")
def loop_checkpoint(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("loop")
    r = _loop(d, "save")
    assert r.returncode == 0, r.stderr
    return d / "run" / "checkpoints" / "step_00000003"


def _copy_loop(loop_checkpoint: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(loop_checkpoint.parent.parent, tmp_path / "run")
    (tmp_path / "loop.py").write_text(LOOP)
    return tmp_path / "run" / "checkpoints" / "step_00000003"


def test_a_saved_dataclass_comes_back_as_its_class_only_when_the_script_hands_it_in(loop_checkpoint, tmp_path):
    _copy_loop(loop_checkpoint, tmp_path)
    welcomed = _loop(tmp_path, "welcome")
    assert welcomed.returncode == 0, welcomed.stderr
    assert json.loads(welcomed.stdout.splitlines()[-1]) == {"type": "Carry", "steps": 4}
    plain = _loop(tmp_path, "plain")
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout.splitlines()[-1]) == {"type": "dict", "steps": 4}
    assert "state 'carry' was saved as the dataclass __main__:Carry; it comes back as a dict" in plain.stdout + plain.stderr
    assert "classes=[Carry]" in plain.stdout + plain.stderr


@pytest.mark.parametrize("manifest_files", ["rehashed", "empty"])
def test_a_checkpoint_naming_subprocess_run_runs_nothing(loop_checkpoint, tmp_path, manifest_files):
    """Issue 50, item 1: `"dataclass": "subprocess:run"` with `args="touch X", shell=True`."""
    step = _copy_loop(loop_checkpoint, tmp_path)
    marker = tmp_path / "ran"
    state = json.loads((step / "state.json").read_text())
    state["loop_state"]["user"]["carry"] = {"__md_tensors__": {
        "dataclass": "subprocess:run",
        "fields": {"args": {"value": f"touch {marker}"}, "shell": {"value": True}}}}
    (step / "state.json").write_text(json.dumps(state))
    if manifest_files == "rehashed":
        _rehash(step)
    else:
        manifest = json.loads((step / "manifest.json").read_text())
        manifest["files"] = {}
        (step / "manifest.json").write_text(json.dumps(manifest))
    r = _loop(tmp_path, "plain")
    assert not marker.exists()
    if manifest_files == "rehashed":  # whole by its checksums: data, a dict of the fields
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[-1])["type"] == "dict"
        assert "saved as the dataclass subprocess:run; it comes back as a dict" in r.stdout + r.stderr
    else:  # an empty manifest verifies nothing
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert "none of its 1 checkpoint(s) verifies" in r.stderr
        assert "state.json" in r.stderr


def test_a_tree_that_names_an_array_it_lacks_is_one_line(loop_checkpoint, tmp_path):
    step = _copy_loop(loop_checkpoint, tmp_path)
    state = json.loads((step / "state.json").read_text())
    state["loop_state"]["user"]["carry"] = {"__md_tensors__": {"tensor": "nowhere", "dtype": "load", "cpu": True}}
    (step / "state.json").write_text(json.dumps(state))
    _rehash(step)
    r = _loop(tmp_path, "plain")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: mlxdist.torch.load_checkpoint(") and "state 'carry' names the array 'nowhere'" in line


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("gate") / "run"
    r = run_train([*FAST, "train.steps=4", "checkpoint.every=2", f"train.out_dir={run}"])
    assert r.returncode == 0, r.stderr
    return run


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(trained, tmp_path / "run"))


def test_an_empty_manifest_never_verifies_and_resume_falls_back(trained, tmp_path):
    """Issue 50, item 2: a manifest listing no files, the weights' last 100 bytes overwritten."""
    run = _copy_run(trained, tmp_path)
    step4 = run / "checkpoints" / "step_00000004"
    manifest = json.loads((step4 / "manifest.json").read_text())
    manifest["files"] = {}
    (step4 / "manifest.json").write_text(json.dumps(manifest))
    weights = step4 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100:] = b"\xff" * 100
    weights.write_bytes(bytes(data))
    assert ckpt.verify(step4) == "the manifest does not list state.json and the model's weights"
    r = run_train([*FAST, "train.steps=6", "checkpoint.every=2", f"train.out_dir={run}", "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr + r.stdout and "step_00000002" in r.stderr + r.stdout
    assert "non-finite" not in r.stderr + r.stdout
    newest = ckpt.load_latest(run / "checkpoints")
    assert newest.meta.run.step == 6
    assert max(float(np.abs(a).max()) for a in newest.weights.values()) < 100


def test_an_unlisted_array_file_fails_verification(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    step = run / "checkpoints" / "step_00000004"
    ckpt.write_arrays(step / "sync.safetensors", {"outer": np.zeros(3, np.float32)})
    assert ckpt.verify(step) == "sync.safetensors is not in the manifest"
    (step / "sync.safetensors").unlink()
    (step / "samples.txt").write_text("a hook's own file beside the checkpoint")
    assert ckpt.verify(step) is None


@pytest.mark.parametrize(("edit", "field"), [
    (lambda s: [s], "its content"),
    (lambda s: s | {"config": "model: tiny"}, "'config'"),
    (lambda s: s | {"step": "abc"}, "'step'"),
    (lambda s: s | {"position": 10**30}, "'position'"),
    (lambda s: s | {"lr_scale": float("nan")}, "'lr_scale'"),
])
def test_state_json_of_the_wrong_shape_is_one_line_naming_the_file_and_field(trained, tmp_path, edit, field):
    run = _copy_run(trained, tmp_path)
    for step in ("step_00000002", "step_00000004"):
        d = run / "checkpoints" / step
        (d / "state.json").write_text(json.dumps(edit(json.loads((d / "state.json").read_text()))))
        _rehash(d)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "checkpoints" in p.parts}
    r = run_train([*FAST, "train.steps=6", f"train.out_dir={run}", "--resume", "auto"])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "step_00000004/state.json" in line and field in line, line
    assert {p: p.read_bytes() for p in before} == before


def test_a_small_zstd_file_that_declares_gibs_is_refused_in_pieces(tmp_path):
    """Issue 50, item 5: a 196 KB `model.safetensors.zst` that declares 6 GiB."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1536, 1 << 20], "data_offsets": [0, 6 << 30]}}).encode()
    c = zstandard.ZstdCompressor(level=19).compressobj()
    f = tmp_path / "model.safetensors.zst"
    with open(f, "wb") as out:
        out.write(c.compress(len(header).to_bytes(8, "little") + header))
        zeros = bytes(64 << 20)
        for _ in range(96):
            out.write(c.compress(zeros))
        out.write(c.flush())
    assert f.stat().st_size < 1 << 20
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ckpt.CheckpointError, match=r"decompresses to more than [\d,]+ bytes"):
        ckpt.read_arrays(f)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1_500_000  # KiB: well under 6 GiB


def test_yaml_duplicate_keys_and_alias_bombs_are_one_line(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: line 4: key 'lr' is given twice \(first on line 2\)"):
        load_config(dup)
    bomb = tmp_path / "bomb.yaml"
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]
    bomb.write_text("task:\n  args:\n" + "".join(f"    {line}\n" for line in levels))
    with pytest.raises(ConfigError, match="its aliases expand to more than"):
        load_config(bomb)
    utf = tmp_path / "latin1.yaml"
    utf.write_bytes("train:\n  out_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: YAML file is not UTF-8 text \(byte 21, line 2\)"):
        load_config(utf)


def test_a_fifo_is_refused_not_read(tmp_path):
    import os

    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)
    with pytest.raises(gate.FileRefused, match="not a regular file"):
        gate.read_json(fifo, "checkpoint state")


def test_the_cli_says_one_line_for_a_config_with_duplicate_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent("""\
        train:
          steps: 2
        train:
          steps: 3
    """))
    r = subprocess.run([sys.executable, "-m", "mlxdist.train", "--config", str(cfg), *FAST], capture_output=True,
                       text=True, env=env(), timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {cfg}: line 3: key 'train' is given twice")


def test_generate_checks_the_weights_before_building_the_model_a_config_describes(trained, tmp_path):
    """Issue 50, item 5: a checkpoint's config edited to dim 65536 and 512 layers."""
    run = _copy_run(trained, tmp_path)
    step = run / "checkpoints" / "step_00000004"
    state = json.loads((step / "state.json").read_text())
    state["config"]["model"] |= {"dim": 65536, "n_layers": 512}
    (step / "state.json").write_text(json.dumps(state))
    _rehash(step)
    r = subprocess.run([sys.executable, "-m", "mlxdist.generate", "--checkpoint", str(run), "--max-tokens", "2"],
                       capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --checkpoint {run}: its config describes a model of ") and "was it edited?" in line
    assert "Traceback" not in r.stderr and "allocate" not in r.stderr


def test_a_hostfile_slots_count_past_one_machine_is_refused(tmp_path):
    from mlxdist.launch.hosts import LaunchError, read_hostfile

    hf = tmp_path / "hosts"
    hf.write_text("studio slots=999999999\n")
    with pytest.raises(LaunchError, match=r"hostfile .*hosts:1: host 'studio': 'slots=999999999' is more ranks than one "
                                          r"machine runs \(at most 1024\)"):
        read_hostfile(hf)
    hf.write_text("studio slots=8\nmacbook\n")
    assert [(h.name, h.slots) for h in read_hostfile(hf)] == [("studio", 8), ("macbook", 1)]


def test_a_count_too_large_for_exact_arithmetic_is_one_line():
    with pytest.raises(ConfigError, match=r"train.batch_size: 10+ is larger than any count a run takes"):
        load_config(None, [f"train.batch_size={10**30}"])
    with pytest.raises(ConfigError, match=r"nodes.studio.batch_size: 16777217 is above the maximum 16777216"):
        load_config(None, ["nodes.studio.batch_size=16777217"])
