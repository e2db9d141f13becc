"""One run per `train.out_dir`: a fresh run into a folder that holds another run's checkpoints
is refused before it changes anything (issue 32: it used to start over silently, and retention
then deleted the new run's newest checkpoint and kept the old run's higher steps), `--resume
auto` continues that run, `--overwrite` replaces it; retention only ever touches its own run's
checkpoints; and every run ends with the line that says what to do next."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, run_train

from mlxdist.config import CheckpointConfig, config_from_args, load_config
from mlxdist.markers import RESTARTS_ENV
from mlxdist.state import checkpoint as ckpt
from mlxdist.state.checkpointer import Checkpointer
from mlxdist.training.next_steps import next_line, spelling


def _listing(root: Path) -> dict[str, str]:
    """Every path under `root` with its sha256 (directories: "dir"), and its mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else f"{hashlib.sha256(p.read_bytes()).hexdigest()} {p.stat().st_mtime_ns}"
    return out


def _steps(run_dir: Path) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in ckpt.list_checkpoints(run_dir / "checkpoints")]


def _logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "logs" / "rank0.jsonl").read_text().splitlines()
    return [e["step"] for e in map(json.loads, lines) if e["event"] == "step"]


@pytest.fixture(scope="module")
def old_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished run of 6 steps with checkpoints at 3 and 6 (the old run in the folder)."""
    run = tmp_path_factory.mktemp("old") / "run"
    args = [*FAST, "train.steps=6", "checkpoint.every=3", "checkpoint.keep_last=2", f"train.out_dir={run}"]
    r = run_train(args)
    assert r.returncode == 0, r.stderr
    assert _steps(run) == [3, 6]
    return run, args


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, copy_function=shutil.copy2)
    return dst


def test_fresh_run_into_a_used_folder_is_refused_and_changes_nothing(old_run, tmp_path):
    run = _copy(old_run[0], tmp_path / "run")
    before = _listing(run)
    # The user's command again, shorter, into the same folder, without --resume.
    r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}"])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # refused before the banner: one line, nothing else
    line = lines[0]
    assert line.startswith(f"error: train.out_dir {run} holds another run's checkpoints (checkpoints/: steps 3, 6)")
    assert "--resume auto" in line and "new train.out_dir" in line and "--overwrite" in line
    assert _listing(run) == before, "the refused run changed the folder"


def test_resume_auto_continues_the_run_in_the_folder(old_run, tmp_path):
    run = _copy(old_run[0], tmp_path / "run")
    first_id = ckpt.run_id_of(run / "checkpoints" / "step_00000006")
    assert first_id
    r = run_train([*old_run[1][:-1], f"train.out_dir={run}", "train.steps=8", "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    assert f"resumed from {run}/checkpoints/step_00000006" in r.stderr
    assert _steps(run) == [6, 8]  # keep_last=2 of the same run
    assert ckpt.run_id_of(run / "checkpoints" / "step_00000008") == first_id  # one run, one id


def test_overwrite_replaces_the_old_run(old_run, tmp_path):
    run = _copy(old_run[0], tmp_path / "run")
    old_id = ckpt.run_id_of(run / "checkpoints" / "step_00000006")
    r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}", "--overwrite"])
    assert r.returncode == 0, r.stderr
    assert f"overwrite: removed the previous run's checkpoints, logs from {run} (checkpoints/: steps 3, 6)" \
        in r.stderr
    assert _steps(run) == [2] and _logged_steps(run) == [1, 2]
    assert ckpt.run_id_of(run / "checkpoints" / "step_00000002") not in (None, old_id)
    # launch/mlxrun reads the trainer's arguments the same way.
    cfg = config_from_args(["--overwrite", "train.steps=3", "--resume", "none"])
    assert cfg.checkpoint.overwrite and cfg.train.steps == 3 and cfg.checkpoint.resume == "none"
    # The key form, as mlxdist.fit and configs spell it; into a folder without another run it is a no-op.
    r = run_train([*FAST, "train.steps=1", f"train.out_dir={tmp_path / 'new'}", "checkpoint.overwrite=true"])
    assert r.returncode == 0 and "overwrite:" not in r.stderr, r.stderr


def test_an_elastic_restart_is_not_refused(old_run, tmp_path):
    """`launch/mlxrun --elastic` restarts with `--resume none` when no host holds a whole copy; its
    first job claimed the folder already, so the restart goes on."""
    run = _copy(old_run[0], tmp_path / "run")
    r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}", "--resume", "none"],
                  extra_env={RESTARTS_ENV: "1"})
    assert r.returncode == 0, r.stderr


def test_resume_from_a_checkpoint_of_another_run_into_a_used_folder_is_refused(old_run, tmp_path):
    run = _copy(old_run[0], tmp_path / "run")
    other = _copy(old_run[0], tmp_path / "other")
    r = run_train([*FAST, "train.steps=3", f"train.out_dir={tmp_path / 'fresh'}"])
    assert r.returncode == 0, r.stderr
    before = _listing(run)
    r = run_train([*FAST, "train.steps=8", f"train.out_dir={run}", "--resume",
                   str(tmp_path / "fresh" / "checkpoints" / "step_00000003")])
    assert r.returncode == 2 and "holds checkpoints of a run other than" in r.stderr, r.stderr
    assert _listing(run) == before
    # From a checkpoint of the run in the folder itself (a copy of it is the same run): fine.
    r = run_train([*old_run[1][:-1], f"train.out_dir={run}", "train.steps=7", "--resume",
                   str(other / "checkpoints" / "step_00000003")])
    assert r.returncode == 0, r.stderr


# ----- retention with two runs in one folder ---------------------------------------------------


def _save(directory: Path, step: int, run_id: str | None) -> Path:
    w = {"w": np.full(3, step, np.float32)}
    state = {"step": step} | ({"run_id": run_id} if run_id else {})
    return ckpt.save(directory, step, w, {}, state)


class _Part:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_retention_keeps_the_other_runs_checkpoints_and_this_runs_newest(tmp_path):
    folder = tmp_path / "checkpoints"
    _save(folder, 150, "old")
    _save(folder, 200, "old")
    c = Checkpointer(CheckpointConfig(keep_last=1, keep_best=False), tmp_path)
    c.lineage = {"new"}
    for step in (50, 60):
        c.save(step, {"run": _Part({"step": step, "run_id": "new"}), "model": _Part({"model": {"w": np.ones(2)}})})
    # The old run's higher steps stay; of this run, its newest (keep_last=1).
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step_00000060", "step_00000150", "step_00000200"]
    # Rollback and drift repair go back to this run's newest, not to the old run's step 200.
    assert c.latest(lambda m: None).meta.run.step == 60


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    """A run resumed from an older step of its own: the new save is below the old branch's steps."""
    for step in (100, 200):
        _save(tmp_path, step, "r")
    newest = _save(tmp_path, 150, "r")
    _save(tmp_path, 120, None)  # from before run ids: someone else's for all we know
    removed = ckpt.apply_retention(tmp_path, keep_last=1, keep_best=False, run_ids={"r"}, newest=newest)
    assert removed == [tmp_path / "step_00000100"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000120", "step_00000150", "step_00000200"]


# ----- the line a run ends with ----------------------------------------------------------------


def test_a_run_ends_with_the_next_commands_for_its_own_folder(tmp_path):
    run = tmp_path / "my run"
    r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}"])
    assert r.returncode == 0, r.stderr
    nexts = [ln for ln in r.stderr.splitlines() if ln.startswith("next: ")]
    assert len(nexts) == 1, r.stderr
    line = nexts[0]
    assert f"sample  python -m mlxdist.generate --checkpoint '{run}'" in line
    assert f"resume  python -m mlxdist.train {' '.join(FAST)} 'train.out_dir={run}' --resume auto train.steps=4" \
        in line, line
    assert "two Macs  launch/mlxrun --hostfile hostfiles/studio+macbook.hosts" in line
    assert r.stderr.strip().splitlines()[-1] == line  # the last thing a plain run says


def test_next_line_for_the_first_command_and_for_other_launches():
    default = load_config(None, [])
    line = next_line(default, world_size=1, builtin_lm=True, stopped_by_signal=False,
                     argv=["/x/mlxdist/train.py"])
    assert line == ('next: sample  python -m mlxdist.generate --checkpoint runs/default --prompt "def " | '
                    f"resume  python -m mlxdist.train --resume auto train.steps={2 * default.train.steps} | "
                    "two Macs  launch/mlxrun --hostfile hostfiles/studio+macbook.hosts -- train.out_dir=runs/two-macs")
    # The resume drops what it sets itself; a stopped run resumes to the same target.
    cfg = load_config(None, ["train.out_dir=runs/x", "train.steps=50"])
    line = next_line(cfg, world_size=1, builtin_lm=True, stopped_by_signal=True,
                     argv=["/x/mlxdist/train.py", "--config", "c.yaml", "train.steps=50", "--resume=none",
                           "--overwrite", "train.out_dir=runs/x"])
    assert "resume  python -m mlxdist.train --config c.yaml train.out_dir=runs/x --resume auto |" in line
    # Several ranks: the launch command is the user's; a task of the user's has no sampler here.
    line = next_line(cfg, world_size=2, builtin_lm=False, stopped_by_signal=False,
                     argv=["/x/mlxdist/train.py", "train.steps=50"])
    assert line == "next: resume  the same command + --resume auto train.steps=100"
    line = next_line(cfg, world_size=1, builtin_lm=False, stopped_by_signal=False, argv=["my_train.py"])
    assert line.startswith("next: resume  the same command + checkpoint.resume=auto train.steps=100 | two Macs")
    # The refusal names what this process understands: flags, or the keys a mlxdist.fit script takes.
    assert spelling(["/x/mlxdist/train.py"]) == ("--resume auto", "--overwrite")
    assert spelling(["my_train.py"]) == ("checkpoint.resume=auto", "checkpoint.overwrite=true")


@pytest.mark.cluster
def test_on_two_ranks_rank_0_says_it_once(tmp_path):
    """Every rank refuses together (exit 2, no rank left waiting), and rank 0 alone says why;
    a finished run's next line comes once, and points to the launch command."""
    run = tmp_path / "run"
    r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}"], np_=2)
    assert r.returncode == 0, r.stderr
    nexts = [ln for ln in r.stderr.splitlines() if ln.startswith("next: ")]
    assert nexts == [f"next: sample  python -m mlxdist.generate --checkpoint {run} | "
                     "resume  the same command + --resume auto train.steps=4"], r.stderr
    before = _listing(run)
    r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}"], np_=2)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "holds another run's checkpoints" in errors[0], r.stderr
    assert _listing(run) == before
