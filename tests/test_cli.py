"""The command lines people meet first: help that lists every key, --print-config, console
scripts, and launchers other than mpirun (mlx.launch) caught or supported."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import FAST, env, final_weights, run_train

from mlxdist import registry
from mlxdist.cluster.world import LaunchError, mlx_launch_backend, refuse_mlx_launch
from mlxdist.config import Config, describe_keys, load_config
from mlxdist.engine.registry import ENGINES
from mlxdist.optim import OPTIMIZERS

BIN = Path(sys.executable).parent


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "args" else [f"{prefix}{k}"]
    return out


def test_help_lists_every_key_with_its_default():
    out = subprocess.run([sys.executable, "-m", "mlxdist.train", "--help"], env=env(), capture_output=True,
                         text=True, timeout=60).stdout
    keys = _leaves(Config().to_dict())
    assert len(keys) > 80
    for key in keys:
        assert f"  {key} = " in out, key
    assert "  train.lr = 0.003   (0.0..10.0)" in out
    # choices read from the registries (mlxdist/registry.py, optim.OPTIMIZERS), as the config does
    assert f"  dist.mode = ddp   ({'|'.join(registry.mode_names())}; " in out
    assert f"  dist.shard = none   ({'|'.join(registry.shard_names())}; " in out
    assert f"  dist.wire_dtype = float32   ({'|'.join(registry.CODECS)}; " in out
    assert f"  train.optimizer = adamw   ({'|'.join(OPTIMIZERS)}; " in out
    assert "--engine {" + ",".join(ENGINES) + "}" in out
    assert "nodes.HOST.batch_size = null   (1..16777216; this host's micro-batch in samples (unset: train.batch_size))" \
        in out
    listed = {ln.split(" = ")[0].strip() for ln in describe_keys() if " = " in ln}
    assert listed == (set(keys) - {"nodes"}) | {"nodes.HOST.batch_size", "nodes.HOST.memory_target", "nodes.HOST.speed"}


def test_print_config_is_the_resolved_config_and_loads_back(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("train:\n  steps: 42\nnodes:\n  studio: {batch_size: 24}\n")
    r = subprocess.run([sys.executable, "-m", "mlxdist.train", "--config", str(cfg_file), "train.lr=1e-4",
                        "--print-config"], env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed["train"]["steps"] == 42 and printed["train"]["lr"] == 1e-4
    assert printed["nodes"]["studio"]["batch_size"] == 24
    (tmp_path / "back.yaml").write_text(r.stdout)
    assert load_config(tmp_path / "back.yaml").to_dict() == load_config(cfg_file, ["train.lr=1e-4"]).to_dict()
    bad = subprocess.run([sys.executable, "-m", "mlxdist.train", "--print-config", "train.stepz=3"], env=env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "did you mean 'train.steps'" in bad.stderr


CLIS = ["mlxdist.train:parse_args", "mlxdist.generate:main", "mlxdist.export:main", "mlxdist.report:main",
        "mlxdist.check_task:main", "mlxdist.prepare:main", "mlxdist.launch.launcher:main",
        "mlxdist.scrape_config:main",
        *[f"mlxdist.bench.{b}:main" for b in ("allreduce", "balance", "diloco", "load", "finetune",
                                                "torchddp", "generate", "checkpoint_io")],
        "mlxdist.bench.overhead:overhead"]


@pytest.mark.parametrize("target", CLIS)
def test_every_flag_has_help(target, monkeypatch):
    """Each command's parser, caught as it parses `--help`: every option says what it does."""
    module, func = target.split(":")
    parsers: list[argparse.ArgumentParser] = []

    def caught(self, *a, **k):
        parsers.append(self)
        raise SystemExit(0)

    for name in ("parse_args", "parse_known_args", "parse_intermixed_args"):
        monkeypatch.setattr(argparse.ArgumentParser, name, caught)
    with pytest.raises(SystemExit):
        getattr(importlib.import_module(module), func)(["--help"])
    assert parsers, target
    for action in parsers[0]._actions:  # SUPPRESS: internal worker flags, hidden on purpose
        assert action.help, f"{target}: {action.option_strings or action.dest}"


ROOT_NAMES = {"train": "commands", "plan": "commands", "export": "commands", "generate": "commands",
              "report": "commands", "check_task": "commands", "prepare": "commands", "scrape_config": "commands",
              "lightning": "integrations", "hf": "integrations"}


@pytest.mark.parametrize("name", sorted(ROOT_NAMES))
def test_root_names_are_the_moved_modules_themselves(name):
    """`mlxdist.train` and the rest stay importable for users, as one module with its new home,
    not a copy: a monkeypatch or a private name reaches the same object either way."""
    root = importlib.import_module(f"mlxdist.{name}")
    home = importlib.import_module(f"mlxdist.{ROOT_NAMES[name]}.{name}")
    assert root is home and home.__name__ == f"mlxdist.{ROOT_NAMES[name]}.{name}"


def test_python_m_runs_the_command_through_its_root_name(tmp_path):
    hosts = tmp_path / "h.hosts"
    hosts.write_text("studio slots=2\n")
    r = subprocess.run([sys.executable, "-m", "mlxdist.scrape_config", "--hostfile", str(hosts), "--port", "9400"],
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "studio:9400" in r.stdout and "studio:9401" in r.stdout


def test_check_task_stays_callable_under_both_names():
    import mlxdist
    import mlxdist.check_task
    from mlxdist.commands import check_task

    assert callable(mlxdist.check_task) and mlxdist.check_task is check_task


@pytest.mark.parametrize("script", ["mlxrun", "mlxdist-train", "mlxdist-generate", "mlxdist-export",
                                    "mlxdist-report", "mlxdist-bench", "mlxdist-check-task"])
def test_console_scripts_are_installed_and_answer_help(script):
    path = BIN / script
    assert path.exists(), f"{path}: reinstall with pip install -e '.[dev]'"
    r = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage:" in r.stdout.lower(), r.stderr


# What mlx.launch exports per backend (mlx/_distributed_utils/launch.py).
def test_mlx_launch_variables_are_recognised(tmp_path):
    two = tmp_path / "ring.json"
    two.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5000"]]))
    one = tmp_path / "one.json"
    one.write_text("")
    assert mlx_launch_backend({"MLX_RANK": "1", "MLX_HOSTFILE": str(two)}) == "ring"
    assert mlx_launch_backend({"MLX_RANK": "0", "MLX_JACCL_COORDINATOR": "10.0.0.1:32323"}) == "jaccl"
    assert mlx_launch_backend({"MLX_RANK": "0", "MLX_WORLD_SIZE": "2", "NCCL_PORT": "12345"}) == "nccl"
    assert mlx_launch_backend({"MLX_RANK": "0", "MLX_HOSTFILE": str(one)}) is None  # one process: fine alone
    assert mlx_launch_backend({"MLX_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}) is None  # --backend mpi
    assert mlx_launch_backend({}) is None
    with pytest.raises(LaunchError, match=r"mlx.launch with its ring backend \(MLX_RANK=1\).*--backend mpi"):
        refuse_mlx_launch({"MLX_RANK": "1", "MLX_HOSTFILE": str(two)})


def _mlx_launch(tmp_path: Path, backend: list[str], args: list[str]) -> subprocess.CompletedProcess:
    e = env()
    e["PATH"] = f"{BIN}{os.pathsep}{e['PATH']}"  # mlx.launch looks up mpirun and python on PATH
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    launcher = shutil.which("mlx.launch", path=e["PATH"])
    if launcher is None:
        pytest.skip("mlx.launch not installed (it comes with mlx)")
    return subprocess.run([launcher, *backend, "--hosts", "127.0.0.1", "-n", "2", "--",
                           sys.executable, "-m", "mlxdist.train", *args], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.cluster
def test_mlx_launch_ring_stops_every_rank_with_one_line(tmp_path):
    r = _mlx_launch(tmp_path, [], [*FAST, "train.steps=3"])
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    # mlx.launch ends the other process once one exits, so one or both say it.
    assert lines and all("mlx.launch with its ring backend" in ln for ln in lines), r.stdout + r.stderr
    assert "exited with code 2" in r.stdout + r.stderr
    assert not (tmp_path / "runs").exists()  # nobody trained alone


@pytest.mark.cluster
def test_mlx_launch_mpi_backend_trains_two_ranks_as_one(tmp_path):
    """`mlx.launch --backend mpi` runs mpirun: 2 ranks of 4+4 reach the weights of 1 rank of 8."""
    r = _mlx_launch(tmp_path, ["--backend", "mpi"], [*FAST, "train.steps=4", "train.batch_size=4",
                                                     "train.out_dir=two"])
    assert r.returncode == 0 and "mlxdist: 2 rank(s)" in r.stdout + r.stderr, r.stdout + r.stderr
    one = run_train([*FAST, "train.steps=4", "train.batch_size=8", f"train.out_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr
    a, b = final_weights(tmp_path / "two"), final_weights(tmp_path / "one")
    assert max(float(abs(a[k] - b[k]).max()) for k in a) < 1e-5
