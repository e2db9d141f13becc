"""Engines do the math of one rank's step; the loop in train.py is shared by both."""

from __future__ import annotations

from .base import Engine, StepStats


def make_engine(name: str, args, cfg, device: str = "auto", world=None, collective=None) -> Engine:
    """Build the engine the CLI asked for; each import is lazy so neither framework is required.

    `world` and `collective` are the MLX engine's view of the other ranks; the PyTorch
    engine is single-node."""
    if name == "mlx":
        from .mlx_engine import MLXEngine

        return MLXEngine(args, cfg, world, collective)
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(args, cfg, device)
    raise ValueError(f"unknown engine '{name}' (use mlx or torch)")


__all__ = ["Engine", "StepStats", "make_engine"]
