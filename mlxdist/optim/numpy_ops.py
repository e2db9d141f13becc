"""The primitives of `Optimizer.update` in numpy (references, tests)."""

from numpy import sign, sqrt, square, where

__all__ = ["sign", "sqrt", "square", "where"]
