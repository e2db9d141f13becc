"""An exponential moving average of the model (`train.ema`), the copy many recipes evaluate.

It averages what the optimizer trains and the model's floating-point buffers (BatchNorm
statistics, as timm's ModelEma does); counters such as `num_batches_tracked` are taken as they
are. Data parallel keeps every rank's weights equal, so every rank keeps the same average
without exchanging it: evaluation, which runs on all ranks, swaps it in locally. It is saved
as `ema.safetensors` beside the raw weights and restored from rank 0 on resume, so a resumed
run's average is the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ..cluster.world import World
from ..engine.base import Engine, set_model


class EMA:
    def __init__(self, decay: float, world: World):
        self.decay, self.world = decay, world
        self.arrays: dict[str, np.ndarray] | None = None

    @staticmethod
    def _model(engine: Engine) -> dict[str, np.ndarray]:
        state = engine.model_state.get_state() if engine.model_state.has_state() else {}
        return engine.get_weights() | {n: a for n, a in state.items() if np.issubdtype(a.dtype, np.floating)}

    def start(self, engine: Engine, saved: dict[str, np.ndarray] | None) -> str | None:
        """Rank 0's saved average on every rank, or the model as it starts. Returns a note when a
        checkpoint's average lacks trained weights (it was written without `train.ema`)."""
        saved = self.world.bcast(saved if self.world.is_main else None)
        self.arrays = {n: a.astype(np.float32, copy=True) for n, a in self._model(engine).items()}
        if saved is None:
            return None
        missing = sorted(set(engine.trained_names) - set(saved))
        self.arrays |= {n: np.array(a, dtype=np.float32) for n, a in saved.items() if n in self.arrays}
        if not missing:
            return None
        return (f"train.ema: the checkpoint's average lacks {len(missing)} trained weight(s) ({missing[0]}"
                f"{' ...' if len(missing) > 1 else ''}; saved without train.ema?): they start from the restored weights")

    def update(self, engine: Engine) -> None:
        d = self.decay
        for name, value in self._model(engine).items():
            avg = self.arrays.get(name)
            if avg is None:  # a buffer that changed for the first time (MLX names it only then)
                self.arrays[name] = value.astype(np.float32, copy=True)
                continue
            avg *= d
            avg += (1.0 - d) * value

    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        return {"ema": dict(self.arrays or {})}

    @contextmanager
    def applied(self, engine: Engine) -> Iterator[None]:
        """The average in the model for the duration (evaluation, hooks); the raw weights after."""
        raw = self._model(engine)
        set_model(engine, self.arrays)
        try:
            yield
        finally:
            set_model(engine, raw)
