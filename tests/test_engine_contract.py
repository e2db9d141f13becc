"""The engine contract (`mlxdist/engine/base.py`): every engine has the core members of `Engine`,
and its `Capabilities` say which optional interfaces it offers (generation, sharding, staged
steps, adapters, overlap), so callers read the record instead of probing the engine."""

import inspect
from pathlib import Path

import numpy as np
import pytest
from user_tasks import mlx_mlp, mlx_staged_mlp, torch_mlp

from mlxdist.config import load_config
from mlxdist.engine.base import (
    Adapters,
    Capabilities,
    Engine,
    Generation,
    GradientFeed,
    Memory,
    ModelState,
    Overlap,
    Sharding,
    StagedOps,
)
from mlxdist.engine.memory import MemoryReading
from mlxdist.engine.registry import ENGINES

ROOT = Path(__file__).resolve().parent.parent
# What every engine has: a newcomer's list, changed on purpose only.
CORE = {"name", "model", "device", "capabilities", "optimizer", "trained_names", "model_state", "memory",
        "micro_step", "take_gradients", "apply_gradients", "discard_gradients", "eval_loss",
        "get_weights", "set_weights", "get_optimizer_state", "set_optimizer_state", "weight_checksum",
        "gradient_sizes", "describe"}
# Each optional interface and the flag of `Capabilities` that declares it.
OPTIONAL = {"generation": Generation, "shards": Sharding, "adapters": Adapters, "overlap": Overlap}


def members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def methods(protocol) -> set[str]:
    return {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def test_the_core_is_what_the_contract_lists():
    assert members(Engine) == CORE


def _mlx_engines():
    pytest.importorskip("mlx.core")
    from mlxdist.engine.mlx_engine import MLXEngine

    cfg = load_config(None, [])
    return [MLXEngine(cfg, task=mlx_mlp()), MLXEngine(cfg, task=mlx_staged_mlp())]


def _torch_engines():
    pytest.importorskip("torch")
    from mlxdist.engine.torch_engine import TorchEngine

    return [TorchEngine(load_config(None, []), "cpu", task=torch_mlp())]


@pytest.fixture(params=["mlx", "torch"])
def engines(request):
    return _mlx_engines() if request.param == "mlx" else _torch_engines()


def test_every_engine_has_the_core_and_its_groups(engines):
    for engine in engines:
        missing = sorted(n for n in CORE if not hasattr(engine, n))
        assert not missing, f"{engine.name}: {missing}"
        for n in methods(Engine):
            assert callable(getattr(engine, n)), f"{engine.name}.{n}"
        assert isinstance(engine.capabilities, Capabilities)
        for group, protocol in ((engine.model_state, ModelState), (engine.memory, Memory)):
            assert all(callable(getattr(group, n, None)) for n in methods(protocol)), (engine.name, protocol.__name__)
        assert isinstance(engine.memory.reading(), MemoryReading)
        assert len(engine.gradient_sizes()) == len(engine.trained_names)
        assert engine.describe()


def test_capabilities_declare_exactly_the_interfaces_an_engine_offers(engines):
    for engine in engines:
        caps = engine.capabilities
        for flag, protocol in OPTIONAL.items():
            assert getattr(caps, flag) == isinstance(engine, protocol), f"{engine.name}: capabilities.{flag}"
        assert caps.shards == ENGINES[engine.name].shards  # what the registry says before one is built
        if caps.overlap:
            assert all(callable(getattr(engine.gradients, n)) for n in methods(GradientFeed))
        if caps.shards:
            ops = engine.shard_ops()
            assert list(ops.names) == list(engine.trained_names)
            staged = ops.stage_names()
            assert (staged is not None) == caps.staged == callable(getattr(engine.model, "stages", None))
            if caps.staged:
                assert all(hasattr(ops, n) for n in methods(StagedOps)), engine.name
                assert not ops.released


def test_an_engine_s_optional_interfaces_work_where_declared():
    """Generation on both engines' built-in LM; the flags' interfaces answer as documented."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("torch")
    from mlxdist.engine import make_engine

    cfg = load_config(None, ["model.preset=tiny", "data.seq_len=16"])
    for name in ENGINES:
        engine = make_engine(name, cfg, device="cpu")
        assert engine.capabilities.generation
        assert engine.logits(np.zeros((1, 4), np.int32)).shape[:2] == (1, 4)
        assert len(engine.sample([1, 2, 3], 3, seed=1)) == 3
        assert engine.save_adapter(Path("unused")) is None  # the whole model trained: no adapter
        assert not engine.model_state.has_state()


def test_the_docs_name_the_core_and_each_capability():
    """docs/architecture.md ("An engine") and base.py's docstring list what this test checks."""
    import mlxdist.engine.base as base

    doc, arch = inspect.getdoc(base), (ROOT / "docs" / "architecture.md").read_text()
    section = arch[arch.index("**An engine**"):arch.index("**An optimizer**")]
    for name in sorted(CORE | {f"capabilities.{f}" for f in (*OPTIONAL, "staged")}):
        assert name in doc, f"engine/base.py's docstring does not name {name}"
        assert f"`{name}`" in section or f"`{name}(" in section, f"docs/architecture.md's engine recipe lacks {name}"
