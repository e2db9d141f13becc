"""Fault injection for tests, read from the environment: the only way a test can make a
real multi-process run drift, blow up, or run out of memory on cue.

It wraps the engine from outside (`wrap`), and only when one of these variables is set;
the loop and the engine contract know nothing of it.

  MLXDIST_INJECT_DRIFT=RANK:STEP   perturb RANK's weights after STEP (once)
  MLXDIST_INJECT_NAN=S1,S2,...     non-finite loss at those steps (each fires once)
  MLXDIST_INJECT_OOM=RANK:STEP     RANK's first micro-batch of STEP raises MemoryError (once)
  MLXDIST_RIG_COMPUTE_SCALE=X      this process computes X times slower (X >= 1); set per host
                                   by `simcluster slow HOST --compute X`, never in production
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace


def _rank_step(name: str) -> tuple[int, int]:
    spec = os.environ.get(name)
    if not spec:
        return -1, -1
    rank, step = spec.split(":")
    return int(rank), int(step)


COMPUTE_SCALE_VAR = "MLXDIST_RIG_COMPUTE_SCALE"


def compute_scale_from_env() -> float:
    """The rig's stand-in for a slower GPU: 1.0 (no slowdown) unless the variable is set.

    A bad value is an error rather than 1.0: a benchmark that silently ran unslowed
    would report a balancer that had nothing to balance.
    """
    spec = os.environ.get(COMPUTE_SCALE_VAR, "").strip()
    if not spec:
        return 1.0
    try:
        scale = float(spec)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale >= 1.0):
        raise ValueError(f"{COMPUTE_SCALE_VAR}={spec!r} must be a number >= 1 "
                         "(set it with `simcluster slow HOST --compute X`, or unset it)")
    return scale


@dataclass
class Faults:
    drift: tuple[int, int] = (-1, -1)
    oom: tuple[int, int] = (-1, -1)
    nan_steps: set[int] = field(default_factory=set)
    compute_scale: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.nan_steps) or self.drift[0] >= 0 or self.oom[0] >= 0 or self.compute_scale != 1.0

    @classmethod
    def from_env(cls) -> Faults:
        nan = os.environ.get("MLXDIST_INJECT_NAN", "")
        return cls(_rank_step("MLXDIST_INJECT_DRIFT"), _rank_step("MLXDIST_INJECT_OOM"),
                   {int(s) for s in nan.split(",") if s.strip()}, compute_scale_from_env())

    def stretch_compute(self, compute_s: float) -> float:
        """Sleep so this rank's compute takes `compute_scale` times as long; returns the
        seconds slept.

        Sleeping, not spinning: a slower Mac has a slower GPU, while its CPU stays free to
        drive the network, which a CPU quota (the harsher rig mode) does not model.
        """
        extra = (self.compute_scale - 1.0) * compute_s
        if extra > 0:
            time.sleep(extra)
        return max(extra, 0.0)

    def take_nan(self, step: int) -> bool:
        if step in self.nan_steps:
            self.nan_steps.discard(step)
            return True
        return False

    def take_oom(self, rank: int, step: int) -> bool:
        if self.oom == (rank, step):
            self.oom = (-1, -1)
            return True
        return False

    def drift_now(self, rank: int, step: int) -> bool:
        """Once: a drift repair that restores a checkpoint replays the step."""
        if self.drift == (rank, step):
            self.drift = (-1, -1)
            return True
        return False


def wrap(engine, rank: int, step: Callable[[], int], faults: Faults | None = None):
    """`engine` itself when no fault is asked for; otherwise an engine that misbehaves on cue.
    `step()` is the loop's count of completed steps."""
    faults = faults or Faults.from_env()
    return FaultyEngine(engine, faults, rank, step) if faults.active else engine


class FaultyEngine:
    """The engine, plus the faults of `Faults` at the steps they name. Everything it does not
    override passes through."""

    def __init__(self, engine, faults: Faults, rank: int, step: Callable[[], int]):
        self._engine, self._faults, self._rank, self._step = engine, faults, rank, step
        self.capabilities = replace(engine.capabilities, notes=(*engine.capabilities.notes, *(
            [f"rig: rank {rank} computes x{faults.compute_scale:g} slower ({COMPUTE_SCALE_VAR})"]
            if faults.compute_scale != 1.0 else [])))

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def micro_step(self, batch) -> None:
        self._maybe_oom()
        t0 = time.perf_counter()
        self._engine.micro_step(batch)
        self._faults.stretch_compute(time.perf_counter() - t0)  # rig only: a slower GPU, counted as compute

    def _maybe_oom(self) -> None:
        if self._faults.take_oom(self._rank, self._step()):
            raise MemoryError("injected out-of-memory (MLXDIST_INJECT_OOM)")

    def shard_ops(self):
        """The engine's shard operations, run through this wrapper (ZeRO-3's staged step too, and
        a pipeline rank's run of stages, slower with the compute scale)."""
        ops = self._engine.shard_ops()
        ops.engine = self
        if self._faults.compute_scale != 1.0 and hasattr(ops, "pipeline_run"):
            run = ops.pipeline_run
            ops.pipeline_run = lambda first, last: SlowerRun(run(first, last), self._faults)
        return ops

    def staged_step(self, batch, fetch, hand) -> None:
        self._maybe_oom()
        self._engine.staged_step(batch, fetch, hand)

    def eval_loss(self, batch, metrics=None):
        t0 = time.perf_counter()
        out = self._engine.eval_loss(batch, metrics)
        self._faults.stretch_compute(time.perf_counter() - t0)  # the slower GPU evaluates slower too
        return out

    def take_gradients(self):
        got = self._engine.take_gradients()
        if self._faults.take_nan(self._step()):
            got.loss_sum = float("nan")
        return got

    def weight_checksum(self) -> int:
        # The drift lands after the update that completed its step and the checksum the
        # self-check remembered then, so the check sees a rank whose weights changed since.
        if self._faults.drift[0] == self._rank and self._step() >= self._faults.drift[1] \
                and self._faults.drift_now(self._rank, self._faults.drift[1]):
            weights = self._engine.get_weights()
            first = sorted(weights)[0]
            weights[first] = weights[first] + 1e-3
            self._engine.set_weights(weights)
        return self._engine.weight_checksum()


class SlowerRun:
    """A pipeline rank's run of stages (`engine.staged.PipelineRun`) whose every forward and
    backward takes `compute_scale` times as long: the slower GPU of `stretch_compute`, in the
    calls a pipeline computes in (it runs no `micro_step`)."""

    def __init__(self, run, faults: Faults):
        self._run, self._faults = run, faults

    def __getattr__(self, name: str):
        return getattr(self._run, name)

    def _stretched(self, name: str, *args, **kwargs):
        t0 = time.perf_counter()
        out = getattr(self._run, name)(*args, **kwargs)
        self._faults.stretch_compute(time.perf_counter() - t0)
        return out

    def forward(self, *args, **kwargs):
        return self._stretched("forward", *args, **kwargs)

    def forward_eval(self, *args, **kwargs):
        return self._stretched("forward_eval", *args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._stretched("backward", *args, **kwargs)

    def loss_backward(self, *args, **kwargs):
        return self._stretched("loss_backward", *args, **kwargs)

    def forward_loss(self, *args, **kwargs):
        return self._stretched("forward_loss", *args, **kwargs)
