"""What mlxdist knows about an engine comes from its spec in `mlxdist.engine.registry`: an
engine registered there (a module plus one entry) is what the CLI offers and the wiring
builds, and no product module outside `mlxdist/engine/` decides by comparing engine names."""

import re
import sys
import types
from pathlib import Path

import pytest

from mlxdist.config import ConfigError, load_config
from mlxdist.engine import make_engine
from mlxdist.engine.registry import ENGINES, EngineSpec, engine_spec

ROOT = Path(__file__).resolve().parent.parent
# `x == "mlx"`, `"torch" != x`, `x in ("mlx", ...)`: a decision taken on an engine's name
NAME_TEST = re.compile(r"""[!=]=\s*["'](mlx|torch)["']|["'](mlx|torch)["']\s*[!=]=|\bin\s*[(\[{]\s*["'](mlx|torch)["']""")
NOT_PRODUCT = ("engine", "bench", "rig")  # the engines themselves; tools outside the product (import contracts)


def test_no_module_outside_the_engine_package_branches_on_an_engine_name():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "mlxdist").rglob("*.py"))
             if p.relative_to(ROOT / "mlxdist").parts[0] not in NOT_PRODUCT
             for i, line in enumerate(p.read_text().splitlines(), 1) if NAME_TEST.search(line)]
    assert not found, "decide from the engine's EngineSpec (mlxdist/engine/registry.py) instead:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_looks_for():
    for line in ('if engine == "mlx":', "x if 'torch' != name else y", 'engine.name in ("mlx", "torch")'):
        assert NAME_TEST.search(line), line
    for line in ('p.add_argument("--engine", choices=ENGINES, default="mlx")', 'engine: str = "torch"'):
        assert not NAME_TEST.search(line), line


@pytest.fixture
def third_engine(monkeypatch):
    """An engine that is only a module and a registration."""
    module = types.ModuleType("fake_engine_for_test")
    built = []
    module.make = lambda cfg, device, task, local_rank, micro_batch: built.append((device, local_rank)) or "engine"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    spec = EngineSpec("third", make=f"{module.__name__}:make", build_lm="", adopt="", seed="", on_cpu="", reducer="",
                      arrays="", model_files="", generator="", backends=("mpi4py",))
    monkeypatch.setitem(ENGINES, "third", spec)
    return built


def test_a_registered_engine_is_offered_and_built(third_engine):
    from mlxdist.train import parse_args

    assert parse_args(["--engine", "third"]).engine == "third"
    assert make_engine("third", load_config(None, []), device="cpu", local_rank=3) == "engine"
    assert third_engine == [("cpu", 3)]


def test_a_registered_engine_s_backends_are_what_the_wiring_allows(third_engine):
    from mlxdist.training.wiring import make_world

    with pytest.raises(ConfigError, match=r"^dist.backend=mlx-ring: the third engine sums its gradients over mpi4py; "
                                          r"use dist.backend=auto \(or mpi4py\)$"):
        make_world("third", load_config(None, ["dist.backend=mlx-ring"]))


def test_an_unregistered_engine_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"^unknown engine 'jax' \(use mlx or torch\)$"):
        engine_spec("jax")
    with pytest.raises(SystemExit):
        from mlxdist.train import parse_args

        parse_args(["--engine", "jax"])


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_function_a_spec_names_imports(name):
    """The spec names functions by "module:attribute": a module moved or renamed fails here, not in a run."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("torch")
    spec = ENGINES[name]
    for field in ("make", "build_lm", "adopt", "seed", "on_cpu", "reducer", "arrays", "model_files"):
        assert callable(spec.load(field)), f"{name}.{field}: {getattr(spec, field)}"
