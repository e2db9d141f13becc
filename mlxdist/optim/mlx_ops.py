"""The primitives of `Optimizer.update` in MLX: `numpy_ops`'s definitions over `mlx.core` (the
engine compiles the update with them)."""

import mlx.core as mx

from .numpy_ops import bind

globals().update(bind(mx))
