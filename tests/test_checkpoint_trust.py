"""Nothing a checkpoint says is imported or called unless the user names it on the command line.

The attack: a state.json rewritten to name `task.factory: os:system` with `task.args: {command:
...}` (or a module of the attacker's beside the run), saved with a fresh sha256 manifest, as
anyone who can write the run folder can do. Every reader of checkpoints gets it: export asks
for `--task` and only compares the checkpoint's factory with it; generate, report, plan and
check_task import no task code from a checkpoint at all. A marker file says whether any code ran.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import env

from mlxdist.config import Config
from mlxdist.state import checkpoint as ckpt

STEP = "step_00000003"

# An attacker's module beside the run: it runs its code when imported.
EVIL = """
from pathlib import Path
Path({marker!r}).write_text("imported")

def make(**args):
    Path({marker!r}).write_text("called")
"""

# A user's own task: a tiny MLX model; it records the task.args it was called with.
MINE = """
import numpy as np

import mlxdist

CALLS = []


class Data:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": np.full(2, i, np.float32)}


def make(**args):
    CALLS.append(args)

    def build(ctx):
        import mlx.nn as nn

        return nn.Linear(2, 3)

    return mlxdist.Task(build=build, loss=lambda model, batch: model(batch["x"]).sum(), dataset=Data())
"""


def _save(run: Path, factory: str, args: dict, weights: dict | None = None) -> Path:
    """A checkpoint as `checkpoint.save` writes it (a whole manifest, every sha256 right)."""
    cfg = Config().to_dict()
    cfg["task"] = {"factory": factory, "args": args}
    weights = weights or {"weight": np.zeros((3, 2), np.float32), "bias": np.zeros(3, np.float32)}
    ckpt.save(run / "checkpoints", 3, weights, {}, {"step": 3, "engine": "mlx", "config": cfg})
    assert ckpt.verify(run / "checkpoints" / STEP) is None
    return run


@pytest.fixture
def hostile(tmp_path) -> tuple[Path, Path]:
    """(run, marker): the checkpoint names os:system, whose command makes the marker."""
    marker = tmp_path / "ran-os-system"
    return _save(tmp_path / "run", "os:system", {"command": f"touch {marker}"}), marker


@pytest.fixture
def evil(tmp_path) -> tuple[Path, Path, Path]:
    """(run, marker, working directory): the checkpoint names a module of the attacker's, which
    lies in the directory the command runs from (a task's module is imported from there)."""
    where = tmp_path / "cwd"
    where.mkdir()
    marker = tmp_path / "ran-evil-module"
    name = f"evil_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"  # never one this process imported before
    (where / f"{name}.py").write_text(EVIL.format(marker=str(marker)))
    return _save(where / "run", f"{name}:make", {}), marker, where


@pytest.fixture(scope="module")
def mine(tmp_path_factory) -> tuple[Path, str, dict]:
    """(working directory, factory, trained weights): a legit task run of the user's own module."""
    where = tmp_path_factory.mktemp("mine")
    name = f"mine_{os.getpid()}"
    (where / f"{name}.py").write_text(MINE)
    weights = {"weight": np.arange(6, dtype=np.float32).reshape(3, 2) / 7, "bias": np.array([1, 2, 3], np.float32)}
    _save(where / "run", f"{name}:make", {"width": 2}, weights)
    return where, f"{name}:make", weights


def _main(module: str, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """`python -m mlxdist.MODULE ARGV` as its `main` in this process, from `cwd`."""
    import importlib

    main = importlib.import_module(f"mlxdist.{module}").main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _one_line(code: int, err: str, *words: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------ export


def test_export_without_task_names_the_factory_and_imports_nothing(hostile, tmp_path):
    run, marker = hostile
    out = tmp_path / "out"
    code, _, err = _main("export", [run, "--out", out], tmp_path)
    _one_line(code, err, str(run / "checkpoints" / STEP), "trained with task.factory os:system",
              "pass --task os:system if you trust that code")
    assert not marker.exists() and not out.exists()


def test_a_factory_name_that_would_forge_lines_is_quoted(tmp_path):
    run = _save(tmp_path / "run", "os:system\nexported step_00000003 to out", {"command": "true"})
    code, _, err = _main("export", [run, "--out", tmp_path / "out"], tmp_path)
    _one_line(code, err, "task.factory 'os:system\\nexported step_00000003 to out'")


def test_export_without_task_imports_no_module_from_the_working_directory(evil, tmp_path):
    run, marker, where = evil
    factory = json.loads((run / "checkpoints" / STEP / "state.json").read_text())["config"]["task"]["factory"]
    code, _, err = _main("export", [run, "--out", tmp_path / "out"], where)
    _one_line(code, err, f"task.factory {factory}", f"--task {factory}")
    assert not marker.exists() and factory.split(":")[0] not in sys.modules


def test_export_with_another_task_names_both_and_imports_neither(hostile, evil, tmp_path):
    run, marker = hostile
    _, evil_marker, where = evil
    other = f"{next(where.glob('evil_*.py')).stem}:make"  # named by the user, yet not imported: it differs
    code, _, err = _main("export", [run, "--out", tmp_path / "out", "--task", other], where)
    _one_line(code, err, f"--task names task.factory {other}", "trained with task.factory os:system",
              "nothing was imported", "pass --task os:system")
    assert not marker.exists() and not evil_marker.exists()


def test_export_with_a_config_naming_another_factory(hostile, tmp_path):
    run, marker = hostile
    config = tmp_path / "my_task.yaml"
    config.write_text(yaml.safe_dump({"task": {"factory": "mypkg.tasks:make_task", "args": {"n": 1}}}))
    code, _, err = _main("export", [run, "--out", tmp_path / "out", "--config", config], tmp_path)
    _one_line(code, err, f"--config {config} names task.factory mypkg.tasks:make_task",
              "trained with task.factory os:system")
    assert not marker.exists()


def test_export_of_a_hostile_checkpoint_on_the_real_command_line(evil, tmp_path):
    run, marker, where = evil
    r = subprocess.run([sys.executable, "-m", "mlxdist.export", str(run), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, cwd=where, env=env())
    _one_line(r.returncode, r.stderr, "trained with task.factory evil_", "if you trust that code")
    assert not marker.exists()


def test_export_with_the_matching_task_works_with_the_checkpoints_args(mine, tmp_path):
    from safetensors.numpy import load_file

    where, factory, weights = mine
    out = tmp_path / "out"
    code, stdout, err = _main("export", ["run", "--out", out, "--task", factory], where)
    assert code == 0, err
    assert f"of task {factory}" in stdout
    got = load_file(out / "model.safetensors")
    assert got.keys() == weights.keys()
    for k, v in weights.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert sys.modules[factory.split(":")[0]].CALLS[-1] == {"width": 2}  # the checkpoint's args: only data


def test_export_with_a_config_takes_its_factory_and_prefers_its_args(mine, tmp_path):
    where, factory, _ = mine
    config = tmp_path / "my_task.yaml"
    config.write_text(yaml.safe_dump({"task": {"factory": factory, "args": {"width": 2, "here": "/mine"}}}))
    code, _, err = _main("export", ["run", "--out", tmp_path / "a", "--config", config], where)
    assert code == 0, err
    calls = sys.modules[factory.split(":")[0]].CALLS
    assert calls[-1] == {"width": 2, "here": "/mine"}  # the user's args over the checkpoint's

    config.write_text(yaml.safe_dump({"task": {"factory": factory}}))  # no task.args: the checkpoint's
    code, _, err = _main("export", ["run", "--out", tmp_path / "b", "--config", config], where)
    assert code == 0, err
    assert calls[-1] == {"width": 2}

    code, _, err = _main("export", ["run", "--out", tmp_path / "c", "--config", config, "--task", "other:make"],
                         where)
    _one_line(code, err, "--task other:make", f"task.factory {factory}", "different factories")


def test_export_of_a_language_model_run_refuses_task(tmp_path):
    cfg = Config().to_dict()
    ckpt.save(tmp_path / "run" / "checkpoints", 3, {"w": np.zeros(2, np.float32)}, {},
              {"step": 3, "engine": "mlx", "config": cfg})
    code, _, err = _main("export", [tmp_path / "run", "--out", tmp_path / "out", "--task", "os:system"], tmp_path)
    _one_line(code, err, "--task", "built-in language model", "drop it")


# ------------------------------------------------------------------ the other readers of a run


def test_generate_imports_no_task_and_says_how_to_export(hostile, evil, tmp_path):
    for run, marker, where in ((*hostile, tmp_path), evil):
        factory = json.loads((run / "checkpoints" / STEP / "state.json").read_text())["config"]["task"]["factory"]
        for source in (run, run / "checkpoints" / STEP):
            code, _, err = _main("generate", ["--checkpoint", source, "--engine", "torch", "--device", "cpu"],
                                 where)
            _one_line(code, err, f"trained task.factory={factory}, not the built-in", "generate imports no task code",
                      f"python -m mlxdist.export {run} --out DIR --task {factory}")
        assert not marker.exists()


def test_report_reads_only_the_logs(hostile):
    from mlxdist.commands.report import load_run, summarize

    run, marker = hostile
    (run / "logs").mkdir()
    (run / "logs" / "rank0.jsonl").write_text(
        "".join(json.dumps({"event": "step", "step": s, "loss": 2.0 / s, "host": "studio", "rank": 0}) + "\n"
                for s in (1, 2, 3)))
    assert "steps: 3" in summarize(load_run(run), run)
    assert not marker.exists()


@pytest.mark.parametrize("tool", ["plan", "check_task"])
def test_plan_and_check_task_take_a_config_never_a_checkpoint(tool, hostile, tmp_path):
    run, marker = hostile
    flag = ["--config"] if tool == "plan" else []
    state = run / "checkpoints" / STEP / "state.json"
    for given, what in ((run, "a run or checkpoint directory"), (run / "checkpoints" / STEP, "a run or checkpoint"),
                        (state, "a checkpoint's state.json")):
        code, _, err = _main(tool, [*flag, given], tmp_path)
        _one_line(code, err, str(given), what, "give the YAML config you trained with")
    assert not marker.exists()
