"""A strategy, a codec and an optimizer from outside the package (tests/plugins/my_pieces.py),
each one class and one registration, trained through `python -m mlxdist.train` with config keys
and no edit anywhere in mlxdist: the registries are the truth (docs/architecture.md's "how to
add each piece" is what this does)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import FAST, assert_same_weights, env, final_weights, run_train

from mlxdist.config import ConfigError, load_config

PLUGINS = Path(__file__).parent / "plugins"
sys.path.insert(0, str(PLUGINS))  # the in-process tests import it as a run's ranks do
PATH = {"PYTHONPATH": f"{env()['PYTHONPATH']}{os.pathsep}{PLUGINS}"}
# Plain SGD-family updates, no clipping (a norm over one rank's gradients is not the cluster's),
# a constant learning rate after warmup: the arithmetic local SGD with H=1 shares with data parallel.
BASE = [*FAST, "plugins=[my_pieces]", "train.steps=4", "train.batch_size=8", "train.grad_clip=0",
        "train.lr=0.05", "train.schedule=constant", "checkpoint.every=0", "dist.sync_weights_every=0"]


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs" / "rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "step"]


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three two-rank runs: data parallel and local SGD (H=1) with the plugin's optimizer, and data
    parallel over the plugin's codec."""
    root = tmp_path_factory.mktemp("plugins")
    out = {}
    for name, extra in (("dp", ["train.optimizer=sgd_nesterov"]),
                        ("local", ["train.optimizer=sgd_nesterov", "dist.mode=local_sgd", "dist.inner_steps=1"]),
                        ("topk", ["dist.wire_dtype=topk:0.25", "train.lr=3e-3", "train.steps=6"])):
        r = run_train([*BASE, *extra, f"train.out_dir={root / name}"], np_=2, extra_env=PATH)
        out[name] = (_ok(r), root / name)
    return out


def test_a_plugin_optimizer_trains_and_local_sgd_with_h_1_is_data_parallel(runs):
    (dp, dp_dir), (local, local_dir) = runs["dp"], runs["local"]
    assert "optimizer SGD (Nesterov)" in dp.stderr and "optimizer SGD (Nesterov)" in local.stderr
    assert "local SGD: weights averaged by rows every 1 steps" in local.stderr, local.stderr[-3000:]
    losses = [s["loss"] for s in _steps(dp_dir)]
    assert losses[-1] < losses[0], losses
    ckpt = final_weights(dp_dir)
    assert_same_weights(ckpt, final_weights(local_dir), atol=2e-6)


def test_a_plugin_codec_carries_data_parallels_gradients(runs):
    r, run_dir = runs["topk"]
    steps = _steps(run_dir)
    assert steps[-1]["loss"] < steps[0]["loss"], [s["loss"] for s in steps]
    n = sum(v.size for v in final_weights(run_dir).values())
    assert steps[0]["sync_bytes"] == 8 * math.ceil(0.25 * n)  # k positions and k values, one bucket


def test_what_a_plugin_strategy_declares_is_refused_by_the_config_and_the_chooser():
    from mlxdist.sync.strategy import strategy_name

    cfg = load_config(None, ["plugins=my_pieces", "dist.mode=local_sgd", "dist.shard=optimizer"])
    with pytest.raises(ConfigError, match="dist.mode=local_sgd keeps each rank's own optimizer: set dist.shard=none"):
        strategy_name(cfg)  # never replaced by ZeRO-1
    for keys, says in ((["dist.wire_dtype=topk:0.5"], "dist.mode=local_sgd sends no gradients"),
                       (["train.ema=0.9"], "with dist.mode=local_sgd the ranks hold different weights"),
                       (["dist.sync_every_s=5"], "set dist.mode=diloco (now local_sgd)"),
                       (["dist.wire_dtype=topk:2"], "dist.wire_dtype=topk:2: the density 2 must lie in")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(None, ["plugins=my_pieces", "dist.mode=local_sgd", *keys])


def test_plugins_are_imported_from_the_config_and_never_from_a_saved_one():
    from mlxdist.config import config_from_dict

    with pytest.raises(ConfigError, match=r"plugins: cannot import 'no_such_pieces' \(ModuleNotFoundError"):
        load_config(None, ["plugins=no_such_pieces"])
    saved = {"plugins": "no_such_pieces", "dist": {"mode": "someone_elses", "wire_dtype": "theirs:1"}}
    cfg = config_from_dict(saved)  # data: nothing imported, the names kept
    assert (cfg.plugins, cfg.dist.mode, cfg.dist.wire_dtype) == ("no_such_pieces", "someone_elses", "theirs:1")
