import subprocess
import sys

import pytest
from helpers import env

from mlxdist.config import ConfigError, config_from_args, load_config, parse_override


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 0.001\nmodel:\n  preset: small\n")
    cfg = load_config(f, ["train.lr=3e-4", "data.seq_len=64", "dist.backend=mlx-ring"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.model.preset == "small"
    assert cfg.data.seq_len == 64
    assert cfg.dist.backend == "mlx-ring"


def test_override_parsing_types():
    assert parse_override("train.steps=10") == {"train": {"steps": 10}}
    assert parse_override("train.global_batch=null") == {"train": {"global_batch": None}}
    cfg = load_config(None, ["checkpoint.resume=none", "train.global_batch=none", "data.path=null"])
    assert cfg.checkpoint.resume == "none" and cfg.train.global_batch is None and cfg.data.path is None


@pytest.mark.parametrize("text, message", [
    ("train:\n  lrr: 1\n", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("train:\n  steps: ten\n", "train.steps: expected int, got 'ten'"),
    ("train:\n  lr: -1\n", "train.lr: -1.0 is below the minimum 0.0"),
    ("model:\n  preset: huge\n", "model.preset: 'huge' is not one of"),
    ("data:\n  seq_len: 16\n  overlap: 16\n", "data.overlap: 16 must be below data.seq_len"),
    ("trian: {}\n", "unknown key 'trian' (did you mean 'train'?)"),
    ("nodes:\n  studio: {batch_size: 0}\n", "nodes.studio.batch_size: 0 is below the minimum 1"),
])
def test_bad_config_names_key_and_file(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(f) in str(e.value)
    assert message in str(e.value)


def test_node_matching():
    cfg = load_config(None, ["nodes={studio: {batch_size: 32}, 'mac*': {batch_size: 16}, rank2: {batch_size: 4}}"])
    assert cfg.node_for("studio.local").batch_size == 32
    assert cfg.node_for("macbook-air").batch_size == 16
    assert cfg.node_for("studio", rank=2).batch_size == 4
    assert cfg.node_for("other").batch_size == cfg.train.batch_size


def test_a_node_entry_without_a_batch_size_keeps_the_runs_micro_batch():
    """`nodes: {macbook: {speed: 0.5}}` says how fast a Mac is, not that its micro-batch changes
    (it once became 16 whatever train.batch_size said)."""
    cfg = load_config(None, ["train.batch_size=1", "nodes={macbook: {speed: 0.5}, rank0: {memory_target: 0.5}}"])
    slow, first = cfg.node_for("macbook", rank=1), cfg.node_for("studio", rank=0)
    assert (slow.batch_size, slow.speed) == (1, 0.5) and (first.batch_size, first.memory_target) == (1, 0.5)
    assert cfg.node_for("macbook").memory_target == cfg.control.memory_target
    with pytest.raises(ConfigError, match="batch_size"):
        load_config(None, ["nodes={macbook: {batch_size: 0}}"])


def test_mac_host_names_match_lower_case_patterns():
    # macOS names a Mac `Owners-Model.local`, capitalised; people write `studio`, `macbook*`.
    cfg = load_config(None, ["nodes={studio: {batch_size: 32}, 'macbook*': {batch_size: 8}}",
                             "train.batch_size=4"])
    assert cfg.node_for("Studio.local").batch_size == 32
    assert cfg.node_for("Johns-MacBook-Pro.local").batch_size == 8
    assert cfg.node_for("MacBook-Air").batch_size == 8
    assert cfg.node_for("Johns-Mac-Studio.local", rank=3).batch_size == 32  # a word of the name
    assert cfg.node_key("Johns-Mac-mini.local") is None
    words = load_config(None, ["nodes={studio: {batch_size: 32}, macbook: {batch_size: 8}}"])
    assert words.node_for("Johns-MacBook-Pro.local").batch_size == 8
    assert cfg.unmatched_nodes_warning(["Studio.local", "Johns-MacBook-Pro.local"]) is None
    warning = cfg.unmatched_nodes_warning(["Studio.local", "Johns-Mac-mini.local", "Johns-Mac-mini.local"])
    assert warning == ("nodes: host 'Johns-Mac-mini.local' matched no entry (studio, macbook*); it runs "
                       "with train.batch_size=4. Add a key: its short name, a word of it, a glob such "
                       "as 'macbook*', or 'default'")
    assert load_config(None, []).unmatched_nodes_warning(["Johns-Mac-mini.local"]) is None  # no nodes:


def test_node_match_order():
    cfg = load_config(None, ["nodes={Default: {batch_size: 2}, 'mac*': {batch_size: 3}, "
                             "mac-mini: {batch_size: 5}, RANK1: {batch_size: 7}}"])
    assert cfg.node_key("Johns-Mac-mini.local", rank=1) == "RANK1"  # rankN first
    assert cfg.node_key("Mac-mini.local") == "mac-mini"              # exact before glob
    assert cfg.node_key("Johns-Mac-mini.local") == "mac-mini"        # words, exactly, before globs
    assert cfg.node_key("Johns-Mac-Pro.local") == "mac*"             # words as a glob
    assert cfg.node_key("macstudio") == "mac*"                       # the short name as a glob first
    assert cfg.node_key("studio") == "Default" and cfg.node_for("studio").batch_size == 2
    assert cfg.unmatched_nodes_warning(["studio", "x"]) is None      # `default` is a match


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  stepz: 3\n")
    r = subprocess.run([sys.executable, "-m", "mlxdist.train", "--config", str(f)], capture_output=True,
                       text=True, env=env(), timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown key 'train.stepz'" in lines[0] and str(f) in lines[0]
    r = subprocess.run([sys.executable, "-m", "mlxdist.train", "--config", str(tmp_path / "nope.yaml")],
                       capture_output=True, text=True, env=env(), timeout=60)
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_config_from_train_args_passes_over_other_options(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 9\n")
    cfg = config_from_args(["--engine", "torch", "train.lr=1e-3", "--config", str(f), "--device=cpu",
                            "--resume", "auto", "checkpoint.every=4"])
    assert (cfg.train.steps, cfg.train.lr, cfg.checkpoint.every, cfg.checkpoint.resume) == (9, 1e-3, 4, "auto")
    with pytest.raises(ConfigError, match="train.stepz"):
        config_from_args(["train.stepz=1", "--engine", "mlx"])
    with pytest.raises(ConfigError, match="--config: expected a value"):
        config_from_args(["--config"])


def test_cli_overrides_and_options_mix():
    from mlxdist.commands.train import parse_args

    a = parse_args(["train.steps=3", "--resume", "auto", "train.lr=1e-3", "--engine", "torch"])
    assert a.overrides == ["train.steps=3", "train.lr=1e-3"] and a.resume == "auto" and a.engine == "torch"


def test_a_loaded_config_is_never_written():
    """Every component reads the one config: a write raises with what to do instead, on the
    sections and on the tree; a variant is built (dataclasses.replace), the original unchanged."""
    import dataclasses

    cfg = load_config(None, ["train.steps=7", "train.report_to=[]"])
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"TrainConfig.steps is read-only.*dataclasses.replace"):
        cfg.train.steps = 8
    with pytest.raises(dataclasses.FrozenInstanceError, match="Config.dist is read-only"):
        cfg.dist = cfg.dist
    with pytest.raises(dataclasses.FrozenInstanceError, match="DistConfig.shard is read-only"):
        del cfg.dist.shard
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
    assert (cfg.train.steps, longer.train.steps) == (7, 8) and longer.explicit == cfg.explicit
    assert cfg.train.report_to == "none"  # normalised while loading, before the config is handed out


def test_what_loading_noticed_is_declared_not_a_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  checkpoint_every: 2\ntrain:\n  steps: 3\n")
    cfg = load_config(p, ["nodes.studio.batch_size=4"])
    assert cfg.explicit == {"model.checkpoint_every", "train.steps", "nodes"}
    assert len(cfg.warnings) == 1 and "'model.checkpoint_every' is deprecated" in cfg.warnings[0]
    assert "warnings" not in cfg.to_dict() and "explicit" not in cfg.to_dict()
    with pytest.raises(ConfigError, match="unknown key 'warnings'"):
        load_config(None, ["warnings=[x]"])


def test_node_for_fills_both_fallbacks():
    cfg = load_config(None, ["nodes.studio.batch_size=32", "nodes.studio.memory_target=0.5",
                             "nodes.air.batch_size=4", "control.memory_target=0.7", "train.batch_size=6"])
    assert (cfg.node_for("studio").batch_size, cfg.node_for("studio").memory_target) == (32, 0.5)
    assert (cfg.node_for("air").batch_size, cfg.node_for("air").memory_target) == (4, 0.7)
    assert (cfg.node_for("other").batch_size, cfg.node_for("other").memory_target) == (6, 0.7)
