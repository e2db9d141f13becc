"""Every engine, described once: what the rest of mlxdist needs to know about it, by name.

Callers read an engine's `EngineSpec` instead of comparing its name, so adding an engine is
its module plus one entry in `ENGINES`. The spec names the functions it stands for as
"module:attribute" strings, imported only when used: this module imports no framework and no
other part of mlxdist, so anything (the CLI, tasks, the wiring) may read it, and a torch-only
install never loads MLX.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineSpec:
    name: str
    make: str  # (cfg, device, task, local_rank, micro_batch) -> Engine
    build_lm: str  # (cfg, device, args) -> BuiltModel: the built-in LM (a preset, or a pretrained base)
    adopt: str  # (module, device, task name) -> a task's own module as models.build.built_from_task takes it
    seed: str  # (seed) -> None: the framework's random generator
    on_cpu: str  # () -> None: the framework computes on the CPU from now on (planning, export)
    reducer: str  # (transport, cfg.dist, wire) -> the data-parallel sum of its gradients
    arrays: str  # its gradient arrays as the compressed wire (sync/compressed.py) reads and writes them
    model_files: str  # a task's model as `mlxdist.export --task` writes and checks it (model_files.py)
    generator: str  # how `mlxdist.generate` runs a pretrained model: "mlx-lm" or "transformers"
    backends: tuple[str, ...] = ()  # the data-plane backends it sums over; empty: any dist.backend
    shards: bool = True  # shards optimizer state and gradients (engine.shard_ops)
    # dist.shard=auto may pick a sharded mode for it. The plan's transients are fitted to MLX's
    # peaks; torch's differ (its AdamW runs per parameter group), so there the choice is an estimate's.
    auto_shard: bool = True
    sync_batchnorm: bool = False  # train.sync_batchnorm can patch its models
    openblas: bool = False  # on Linux the process re-execs with OpenBLAS preloaded before the framework loads
    pipeline: str = ""  # (engine, first, last) -> one pipeline stage's math (dist.mode=pipeline); empty: none yet

    def load(self, field: str) -> Callable[..., Any]:
        """The function a field names, imported now."""
        module, _, attr = getattr(self, field).partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


ENGINES: dict[str, EngineSpec] = {
    "mlx": EngineSpec(
        "mlx", make="mlxdist.engine.mlx_engine:make", build_lm="mlxdist.engine.mlx_engine:build_lm",
        adopt="mlxdist.models.build:adopt_mlx", seed="mlxdist.engine.mlx_engine:seed",
        on_cpu="mlxdist.engine.mlx_engine:on_cpu", reducer="mlxdist.sync.grad:GradSync.configured",
        arrays="mlxdist.sync.compressed:MlxArrays", model_files="mlxdist.engine.model_files:MLXModelFiles",
        generator="mlx-lm", openblas=True, pipeline="mlxdist.engine.mlx_pipeline:MlxStage"),
    "torch": EngineSpec(
        "torch", make="mlxdist.engine.torch_engine:make", build_lm="mlxdist.engine.torch_engine:build_lm",
        adopt="mlxdist.models.build:adopt_torch", seed="mlxdist.engine.torch_engine:seed",
        on_cpu="mlxdist.engine.torch_engine:on_cpu", reducer="mlxdist.sync.torch_grad:TorchGradSync.configured",
        arrays="mlxdist.sync.compressed:TorchArrays", model_files="mlxdist.engine.model_files:TorchModelFiles",
        generator="transformers", backends=("mpi4py",), sync_batchnorm=True,
        pipeline="mlxdist.engine.torch_pipeline:TorchStage"),
}


def engine_spec(name: str) -> EngineSpec:
    """The spec of the engine the CLI (or `mlxdist.fit`) named; one line naming the choices if none."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine '{name}' (use {' or '.join(ENGINES)})") from None
