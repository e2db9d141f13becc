"""The primitives of `Optimizer.update` in MLX (the engine compiles the update with them)."""

from mlx.core import sign, sqrt, square, where

__all__ = ["sign", "sqrt", "square", "where"]
