"""Strategies plug in: one registry, one chooser from the config, each strategy's own start-up
check; and engines declare what they can do in one record (`Capabilities`) that the strategies
read."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import assert_same_weights, env, final_weights

from mlxdist.config import ConfigError, load_config
from mlxdist.control.run_plan import build_run_plan, rank_nodes
from mlxdist.engine.base import Capabilities
from mlxdist.registry import CODECS, SHARD_NAMES
from mlxdist.sync.strategy import (
    STRATEGIES,
    Strategy,
    make_strategy,
    register,
    strategy_class,
    strategy_name,
)

HERE = Path(__file__).parent
WORLD = SimpleNamespace(agreed_error=ConfigError, size=1, rank=0)


def plan_of(cfg):
    """A one-rank run plan with the config's dist.shard as resolved."""
    return build_run_plan(cfg, 0, rank_nodes(cfg, ["h"]), ["h"], [0], shard=cfg.dist.shard, n_trained=10,
                          vocab_size=None)


@pytest.mark.parametrize("overrides, name, cls", [
    ([], "data_parallel", "DataParallel"),
    (["dist.mode=diloco"], "diloco", "DiLoCoStrategy"),
    (["dist.shard=optimizer"], "zero1", "ShardedDataParallel"),
    (["dist.shard=gradients"], "zero2", "ShardedDataParallel"),
    (["dist.shard=weights"], "zero3", "FullyShardedDataParallel"),
])
def test_the_config_names_a_registered_strategy(overrides, name, cls):
    cfg = load_config(None, overrides)
    assert strategy_name(cfg) == name
    got = strategy_class(name)
    assert got.__name__ == cls and issubclass(got, Strategy)


def test_a_strategy_is_registered_once_and_an_unknown_name_lists_the_known():
    class Mine(strategy_class("data_parallel")):
        pass

    try:
        assert register("test_mine")(Mine) is Mine and strategy_class("test_mine") is Mine
        with pytest.raises(ValueError, match="strategy 'test_mine' is registered already"):
            register("test_mine")(Mine)
    finally:
        STRATEGIES.pop("test_mine", None)
    with pytest.raises(KeyError, match=f"no sync strategy named 'nope'; registered: {', '.join(sorted(STRATEGIES))}"):
        strategy_class("nope")
    for builtin in STRATEGIES:  # the doc's @register route refuses a built-in's name
        with pytest.raises(ValueError, match=f"strategy '{builtin}' is registered already"):
            register(builtin)(Mine)


def test_the_configs_choices_are_the_registries():
    """dist.mode offers every registered strategy but the sharded ones (dist.shard's), ddp for
    data parallel; a name registered later is a choice too."""
    from mlxdist.config import DistConfig, _choices

    meta = {f.name: f.metadata for f in dataclasses.fields(DistConfig)}
    modes = [("ddp" if n == "data_parallel" else n) for n in STRATEGIES if n not in SHARD_NAMES.values()]
    assert list(_choices(meta["mode"])) == modes
    assert list(_choices(meta["shard"])) == ["none", *SHARD_NAMES, "auto"]
    assert list(_choices(meta["wire_dtype"])) == list(_choices(meta["outer_wire"])) == list(CODECS)

    class Later(strategy_class("diloco")):
        pass

    try:
        register("test_later")(Later)
        assert load_config(None, ["dist.mode=test_later"]).dist.mode == "test_later"
        assert "test_later" in _choices(meta["mode"])
    finally:
        STRATEGIES.pop("test_later", None)


def test_a_mode_that_cannot_be_sharded_is_refused_with_dist_shard_never_replaced():
    """DiLoCo declares itself not `shardable`; so does any strategy that does not say otherwise
    (a local-SGD mode with dist.shard once ran as ZeRO-1)."""
    cfg = load_config(None, ["dist.shard=optimizer", "dist.mode=diloco"])
    with pytest.raises(ConfigError, match="dist.mode=diloco keeps each rank's own optimizer: set dist.shard=none"):
        strategy_name(cfg)
    with pytest.raises(ConfigError, match="dist.mode=diloco keeps each rank's own optimizer: set dist.shard=none"):
        make_strategy(cfg, WORLD, SimpleNamespace(capabilities=Capabilities("t")), None, plan_of(cfg), None)

    class Alone(Strategy):
        def step(self, engine, lr):
            raise NotImplementedError

    try:
        register("test_alone")(Alone)
        cfg = load_config(None, ["dist.shard=gradients", "dist.mode=test_alone"])
        with pytest.raises(ConfigError, match="dist.shard=gradients shards data parallel's optimizer; "
                                              "dist.mode=test_alone does not run sharded: set dist.shard=none"):
            strategy_name(cfg)
    finally:
        STRATEGIES.pop("test_alone", None)


def test_a_subclass_writes_only_the_hooks_it_changes():
    """Every hook but `step` has the data-parallel answer; DataParallel writes its exchange and
    the hooks that keep its reducer's own state (a lossy wire's residuals) in the rank's file."""
    dp = strategy_class("data_parallel")
    assert {n for n in vars(dp) if not n.startswith("_")} == {"step", "before_last_backward", "save_rank_state",
                                                              "load_state_dict", "shardable"}
    with pytest.raises(TypeError, match="abstract"):
        Strategy()


def test_mlx_engines_declare_what_they_can_do_and_sharding_reads_it():
    from user_tasks import mlx_mlp, mlx_own_optimizer, mlx_staged_mlp

    from mlxdist.engine.mlx_engine import MLXEngine

    cfg = load_config(None, ["dist.shard=gradients"])
    task = mlx_own_optimizer()
    own = MLXEngine(cfg, task=task)
    assert own.capabilities == Capabilities(task.name, own_optimizer=True, model_summary=own.capabilities.model_summary,
                                            generation=True, shards=True, adapters=True)
    with pytest.raises(ConfigError, match=r"dist.shard=gradients shards mlxdist's optimizer; this task brings its own "
                                          r"optimizer \(Task.optimizer\): drop it or set dist.shard=none"):
        make_strategy(cfg, WORLD, own, None, plan_of(cfg), None)
    plain, staged = MLXEngine(cfg, task=mlx_mlp()).capabilities, MLXEngine(cfg, task=mlx_staged_mlp()).capabilities
    assert (plain.own_optimizer, plain.staged, staged.staged, staged.loss_scaling) == (False, False, True, False)


def test_torch_engines_declare_what_they_can_do_and_sharding_reads_it():
    pytest.importorskip("torch")
    from user_tasks import torch_mlp, torch_own_optimizer

    from mlxdist.engine.torch_engine import TorchEngine

    cfg = load_config(None, ["dist.shard=optimizer"])
    assert TorchEngine(cfg, "cpu", task=torch_own_optimizer()).capabilities.own_optimizer
    plain = TorchEngine(cfg, "cpu", task=torch_mlp())
    assert (plain.capabilities.own_optimizer, plain.capabilities.loss_scaling) == (False, False)
    assert plain.capabilities.compiled == plain.compiled
    half = TorchEngine(load_config(None, ["dist.shard=optimizer", "model.dtype=float16"]), "cpu", task=torch_mlp())
    assert half.capabilities.loss_scaling
    with pytest.raises(ConfigError, match=r"scales the loss \(GradScaler\), which the sharded update does not undo"):
        make_strategy(cfg, WORLD, half, None, plan_of(cfg), None)


SCRIPT = """
import sys

import mlxdist
from mlxdist.control.step_plan import Decision
from mlxdist.sync.data_parallel import DataParallel
from mlxdist.sync.strategy import STRATEGIES
from user_tasks import mlx_mlp


class Counted(DataParallel):
    def describe(self):
        return "counted data parallel"

    def after_step(self, engine, step, samples, last):
        return [Decision("counted", f"counted step {step}: {samples} samples")]


STRATEGIES["data_parallel"] = Counted  # the name dist.mode=ddp maps to: this module's class
sys.exit(mlxdist.fit(mlx_mlp(), overrides=sys.argv[1:]))
"""


def test_a_strategy_in_a_module_of_its_own_is_chosen_and_trains(tmp_path):
    """One module and its registry entry are enough: the loop builds what the registry names for
    the config and calls its hooks; what it does not override trains as data parallel does."""
    script = tmp_path / "counted.py"
    script.write_text(SCRIPT)
    args = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.steps=2", "train.batch_size=8",
            "train.lr=1e-2", "checkpoint.every=0"]
    e = env() | {"PYTHONPATH": f"{env()['PYTHONPATH']}:{HERE}"}
    mine = subprocess.run([sys.executable, str(script), *args, f"train.out_dir={tmp_path / 'mine'}"],
                          capture_output=True, text=True, timeout=300, cwd=HERE, env=e)
    assert mine.returncode == 0, mine.stderr[-3000:]
    assert "counted data parallel" in mine.stderr
    assert "counted step 1: 8 samples" in mine.stderr and "counted step 2: 8 samples" in mine.stderr, mine.stderr
    plain = subprocess.run([sys.executable, "-m", "mlxdist.train", "task.factory=user_tasks:mlx_mlp", *args,
                            f"train.out_dir={tmp_path / 'plain'}"],
                           capture_output=True, text=True, timeout=300, cwd=HERE, env=e)
    assert plain.returncode == 0 and "counted" not in plain.stderr, plain.stderr[-3000:]
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "mine"), atol=0.0)



def test_the_rig_wrapper_declares_the_engines_record_plus_its_own_note():
    """A slowed rank's engine (training/faults.py) is read through the same record."""
    from mlxdist.training.faults import Faults, wrap

    inner = SimpleNamespace(capabilities=Capabilities("t", own_optimizer=True, notes=("engine note",)))
    wrapped = wrap(inner, 1, lambda: 0, Faults(compute_scale=3.0))
    assert wrapped.capabilities == Capabilities("t", own_optimizer=True, notes=(
        "engine note", "rig: rank 1 computes x3 slower (MLXDIST_RIG_COMPUTE_SCALE)"))
    assert wrap(inner, 1, lambda: 0, Faults()) is inner


def test_a_slowed_pipeline_rank_stretches_each_stage_call_and_computes_the_same():
    """The rig's slower GPU reaches a pipeline rank's run of stages, which runs no micro_step:
    its forward and backward are each stretched, and their results are the engine's own."""
    pytest.importorskip("mlx.core")
    import numpy as np
    from user_tasks import mlx_staged_mlp

    from mlxdist.engine.mlx_engine import MLXEngine
    from mlxdist.tasks import Batch
    from mlxdist.training.faults import Faults, SlowerRun, wrap

    class Counted(Faults):
        def stretch_compute(self, compute_s: float) -> float:
            self.calls.append(compute_s)
            return 0.0

    faults = Counted(compute_scale=2.0)
    faults.calls = []
    engine = MLXEngine(load_config(None, []), task=mlx_staged_mlp())
    slowed = wrap(engine, 1, lambda: 0, faults)
    data = {"x": np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), "y": np.ones((4, 3), np.float32)}
    batch = Batch(np.arange(4), data, 4)
    mine, plain = slowed.shard_ops().pipeline_run(0, 2), engine.shard_ops().pipeline_run(0, 2)
    assert isinstance(mine, SlowerRun) and not isinstance(plain, SlowerRun) and mine.names == plain.names
    weights, restore = plain.engine_weights()
    try:
        x = mine.input_of(batch)
        out, want = mine.forward(weights, x, batch), plain.forward(weights, x, batch)
        assert np.array_equal(np.array(out), np.array(want))
        back = mine.backward(weights, x, out, batch)
        assert back is not None and len(faults.calls) == 2 and all(s > 0 for s in faults.calls)
    finally:
        restore()
    assert wrap(engine, 1, lambda: 0, Faults()).shard_ops().pipeline_run(0, 2).__class__ is type(plain)
