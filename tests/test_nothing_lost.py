"""Nothing on disk is lost to a run that cannot verify, NaN or a full disk (issue 41):
`--resume auto` over checkpoints of which none verifies is refused and changes nothing; a
broken checkpoint is moved aside, never replaced; an interrupted save's temporary folder is
removed at the next start; non-finite config values are refused; a run whose updates stay
non-finite stops with its last finite checkpoint as the newest; retention that cannot delete
warns and goes on; a full disk names the step and the path."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, env, run_train, train_command

from mlxdist.config import CheckpointConfig, ConfigError, load_config
from mlxdist.control.health import HealthMonitor
from mlxdist.state import checkpoint as ckpt
from mlxdist.state.checkpointer import Checkpointer


def _listing(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("six") / "run"
    args = [*FAST, "train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=3", f"train.out_dir={run}"]
    r = run_train(args)
    assert r.returncode == 0, r.stderr
    assert _names(run) == ["step_00000002", "step_00000004", "step_00000006"]
    return run, args[:-1]


def _copy(run: Path, dst: Path) -> Path:
    return Path(shutil.copytree(run, dst, copy_function=shutil.copy2))


def test_resume_auto_over_checkpoints_none_of_which_verifies_is_refused(six_steps, tmp_path):
    run = _copy(six_steps[0], tmp_path / "run")
    for step in (2, 4, 6):
        (run / "checkpoints" / f"step_{step:08d}" / "manifest.json").unlink()
    before = _listing(run)
    r = run_train([*six_steps[1], f"train.out_dir={run}", "train.steps=8", "--resume", "auto"])
    assert r.returncode == 2, r.stderr
    assert "starting fresh" not in r.stderr and "Traceback" not in r.stderr
    assert f"error: train.out_dir {run}: --resume auto found 3 checkpoint(s) and none verifies" in r.stderr
    for step in (2, 4, 6):
        assert f"checkpoints/step_{step:08d}: no manifest" in r.stderr
    assert "--resume PATH" in r.stderr and "--overwrite" in r.stderr
    assert _listing(run) == before, "the refused run changed the folder"
    # What the refusal offers: the user names one after looking, and it resumes from there.
    r = run_train([*six_steps[1], f"train.out_dir={run}", "train.steps=8",
                   "--resume", str(run / "checkpoints" / "step_00000006")])
    assert r.returncode == 0, r.stderr
    assert "has no manifest, so its files cannot be verified" in r.stderr and "(step 6" in r.stderr
    assert ckpt.verify(run / "checkpoints" / "step_00000008") is None


def test_a_broken_checkpoint_is_moved_aside_not_replaced(six_steps, tmp_path):
    run = _copy(six_steps[0], tmp_path / "run")
    broken = run / "checkpoints" / "step_00000006"
    data = bytearray((broken / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (broken / "model.safetensors").write_bytes(bytes(data))
    kept = _listing(broken)
    # An interrupted save of this run (kill -9 mid-write) left its temporary folder behind.
    tmp = run / "checkpoints" / ".tmp_step_00000008_4242"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"\0" * 4096)
    r = run_train([*six_steps[1], f"train.out_dir={run}", "train.steps=8", "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    assert "checkpoints/step_00000006 fails verification (model.safetensors fails its sha256 check); moved aside " \
           "to checkpoints/unverified_step_00000006" in r.stderr, r.stderr
    assert "(step 4" in r.stderr
    assert "removed checkpoints/.tmp_step_00000008_4242, left by an interrupted save (0.0 MB)" in r.stderr
    assert not tmp.exists()
    aside = run / "checkpoints" / "unverified_step_00000006"
    assert _listing(aside) == kept, "the broken checkpoint's files changed"
    # The run wrote its own step 6 and 8 beside it; retention never touches the one moved aside.
    assert ckpt.verify(broken) is None and ckpt.verify(run / "checkpoints" / "step_00000008") is None
    assert "unverified_step_00000006" in _names(run)


def test_a_save_over_a_broken_copy_of_the_same_step_moves_it_aside(tmp_path):
    c = Checkpointer(CheckpointConfig(keep_last=3, keep_best=False), tmp_path)
    c.lineage = {"r"}
    parts = {"run": _Part({"step": 5, "run_id": "r"}), "model": _Part({"model": {"w": np.ones(2, np.float32)}})}
    first = c.save(5, parts).path
    (first / "manifest.json").unlink()
    again = c.save(5, parts)
    assert ckpt.verify(again.path) is None
    assert (tmp_path / "checkpoints" / "unverified_step_00000005" / "model.safetensors").is_file()
    assert any("moved aside to unverified_step_00000005" in n for n in again.notes), again.notes


class _Part:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


# ----- non-finite ------------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["train.lr=.nan", "dist.stall_timeout_s=.nan", "train.grad_clip=.inf",
                                      "train.lr=nan", "control.memory_target=-.inf"])
def test_non_finite_config_values_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: .* is not a finite number"):
        load_config(None, [override])


def test_non_finite_config_value_is_one_line_and_exit_2(tmp_path):
    r = run_train([*FAST, "train.steps=2", "train.lr=.nan", f"train.out_dir={tmp_path}"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: defaults + overrides: train.lr: nan is not a finite number; "
                                             "give a number from 0.0 "
                                             "to 10.0"]
    assert not (tmp_path / "checkpoints").exists()


def test_health_gives_up_after_k_skipped_updates_in_a_row_across_rollbacks():
    h = HealthMonitor(max_bad_steps=2, max_nonfinite_steps=5)
    verdicts = [h.observe(s, float("nan"), 1.0) for s in range(1, 6)]
    assert [v.rollback for v in verdicts] == [False, True, False, True, False]
    assert [v.give_up for v in verdicts] == [False, False, False, False, True]
    h.observe(6, 1.0, 1.0)  # one finite step resets the count
    assert not h.observe(7, float("inf"), 1.0).give_up and h.nonfinite_streak == 1
    restored = HealthMonitor(max_nonfinite_steps=5)
    restored.load_state_dict(h.state_dict())
    assert restored.nonfinite_streak == 1


@pytest.mark.parametrize("np_,mode,stop,kept", [
    (0, [], 6, [2, 4]),
    (2, [], 6, [2, 4]),
    # DiLoCo's ranks exchange control numbers every control.balance_interval (5) steps: the wish from step 6
    # is held until step 10, though steps 7-10 were finite again (their weights too: step 8 was saved).
    (2, ["dist.mode=diloco", "dist.inner_steps=4"], 10, [4, 6, 8])])
def test_a_run_whose_updates_stay_non_finite_stops_with_its_last_finite_checkpoint(tmp_path, np_, mode, stop, kept):
    run = tmp_path / "run"
    r = run_train([*FAST, "train.steps=12", "checkpoint.every=2", "control.max_bad_steps=10",
                   "control.max_nonfinite_steps=3", "train.batch_size=4", f"train.out_dir={run}", *mode], np_=np_,
                  extra_env={"MLXDIST_INJECT_NAN": "3,4,5"})
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    # The injected steps count completed steps: the updates of steps 4, 5 and 6 are skipped.
    assert errors[0].startswith(f"error: step {stop}: 3 updates in a row skipped for a non-finite loss or "
                                "gradients on rank 0"), errors[0]
    assert f"the last checkpoint is {run}/checkpoints/step_{kept[-1]:08d}" in errors[0]
    assert "control.max_nonfinite_steps=3" in errors[0]
    assert _names(run) == [f"step_{s:08d}" for s in kept]  # no save of the state it stopped in
    assert ckpt.verify(run / "checkpoints" / f"step_{kept[-1]:08d}") is None
    assert "MPI_ABORT" not in r.stderr  # every rank stopped together


def test_non_finite_weights_are_never_written_as_a_checkpoint(tmp_path):
    good = ckpt.save(tmp_path, 1, {"w": np.ones(3, np.float32)}, {}, {"step": 1})
    w = {"a": np.ones(4, np.float32), "b": np.array([1.0, np.nan], np.float32)}
    with pytest.raises(ckpt.NonFiniteError, match=r"step 2: weight 'b' holds NaN or infinity, so no checkpoint"):
        ckpt.save(tmp_path, 2, w, {}, {"step": 2})
    with pytest.raises(ckpt.NonFiniteError, match="EMA weight 'a'"):
        ckpt.save(tmp_path, 2, {"a": np.ones(2, np.float32)}, {}, {"step": 2},
                  extra={"ema": {"a": np.array([np.inf, 0], np.float32)}})
    assert [p.name for p in tmp_path.iterdir()] == [good.name]
    assert ckpt.first_nonfinite({"i": np.array([1, 2], np.int64), "f": np.zeros(0, np.float32)}) is None


# ----- retention and a full disk ------------------------------------------------------------------


def test_retention_that_cannot_delete_warns_once_and_training_goes_on(tmp_path):
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr to make a checkpoint undeletable")
    folder = tmp_path / "checkpoints"
    old = ckpt.save(folder, 1, {"w": np.ones(2, np.float32)}, {}, {"step": 1, "run_id": "r"})
    if subprocess.run(["chattr", "+i", str(old)], capture_output=True).returncode != 0:
        pytest.skip(f"chattr +i is not supported on {tmp_path}'s file system")
    try:
        c = Checkpointer(CheckpointConfig(keep_last=1, keep_best=False), tmp_path)
        c.lineage = {"r"}
        notes = []
        for step in (2, 3):
            parts = {"run": _Part({"step": step, "run_id": "r"}), "model": _Part({"model": {"w": np.ones(2)}})}
            notes += c.save(step, parts).notes
        assert len(notes) == 1, notes
        assert notes[0].startswith(f"warning: retention (checkpoint.keep_last=1) cannot delete {old}: Operation "
                                   "not permitted; it is kept and training goes on")
        assert sorted(p.name for p in folder.iterdir()) == ["step_00000001", "step_00000003"]
    finally:
        subprocess.run(["chattr", "-i", str(old)])


def test_a_full_disk_names_the_step_and_the_path_and_keeps_the_last_checkpoint(tmp_path):
    """The run folder on a small tmpfs in a mount namespace of its own (gone with the process)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a small tmpfs")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m failed: {probe.stderr.decode().strip()}")
    run, saved = tmp_path / "disk" / "run", tmp_path / "after"
    run.parent.mkdir()
    # tiny preset: a checkpoint is ~8.9 MB; 14 MB holds one and the logs, not two.
    cmd = " ".join(f"'{a}'" for a in train_command([*FAST, "train.steps=6", "checkpoint.every=2",
                                                    "checkpoint.keep_last=3", f"train.out_dir={run}"]))
    script = (f"mount -t tmpfs -o size=14m tmpfs '{run.parent}' && {{ {cmd}; echo rc=$?; }}; "
              f"cp -a '{run}' '{saved}'")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env(),
                       timeout=300)
    assert "rc=1" in r.stdout, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith(f"error: checkpoint of step 4 could not be written to {run}/checkpoints: "
                                "No space left on device"), errors[0]
    assert "the earlier checkpoints there are unchanged" in errors[0] and "--resume auto" in errors[0]
    names = sorted(p.name for p in (saved / "checkpoints").iterdir())
    assert names == ["step_00000002"], names  # no partial temporary folder left behind
    assert ckpt.verify(saved / "checkpoints" / "step_00000002") is None


def test_your_loop_does_not_start_over_on_checkpoints_none_of_which_verifies(tmp_path):
    """`md.load_checkpoint` returned None (start fresh) where no checkpoint verified; the loop
    then wrote its new steps over them."""
    import mlx.core as mx
    import mlx.nn as nn

    import mlxdist.mlx as md

    md.init()
    model = nn.Linear(3, 2)
    mx.eval(model.parameters())
    path = md.save_checkpoint(tmp_path, 2, model, keep_last=3, epoch=1)
    assert md.load_checkpoint(tmp_path, model)["step"] == 2
    (path / "manifest.json").unlink()
    before = _listing(tmp_path)
    with pytest.raises(ConfigError, match=r"none of its 1 checkpoint\(s\) verifies \(step_00000002: no manifest"):
        md.load_checkpoint(tmp_path, model)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.5])
def test_your_loop_stall_timeout_must_be_finite(value):
    import mlxdist.torch as md

    with pytest.raises(ConfigError, match=r"init\(stall_timeout=.*\): give a finite number of seconds >= 1"):
        md.init(stall_timeout=value)
