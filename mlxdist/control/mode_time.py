"""A step's predicted time under data parallel, ZeRO-3 and a pipeline on the same hosts, so
`python -m mlxdist.plan` can say which to use over the link you have.

Why a model and not a measurement: the plan runs before any Mac has trained, and the choice
turns on two numbers the user knows or can measure once, the link's rate and each Mac's
sustained training FLOP/s. The model is the one the measured runs follow
(docs/bigger-than-one-mac.md): compute is 6 x parameters x tokens spread as each mode spreads
it; data parallel all-reduces the gradients (2 (p-1)/p of them over the busiest link), ZeRO-3
moves the weights twice and the gradients once (3 (p-1)/p), not overlapped; a pipeline runs
m micro-batches through p stages in (m + p - 1) slots of its slowest stage, each boundary
activation and its gradient crossing a link once per micro-batch, hidden behind compute but for
the fill and drain.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..problems import ConfigError

_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(|bit|kbit|mbit|gbit|tbit)\s*", re.IGNORECASE)
_BITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_link(text: str, where: str = "--link") -> float:
    """`1gbit`, `100mbit`, `40gbit` -> bits per second."""
    m = _RATE.fullmatch(text)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"{where}: cannot read '{text}' as a link rate (e.g. 1gbit, 100mbit, 40gbit)")
    return float(m.group(1)) * _BITS[m.group(2).lower()]


def parse_tflops(text: str, hosts: int, where: str = "--tflops") -> list[float]:
    """One number for every host, or one per host in rank order."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{where}: give each Mac's training TFLOP/s, one number or one per rank (e.g. 8,4)") from None
    if len(values) == 1:
        values *= hosts
    if len(values) != hosts or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ConfigError(f"{where}={text}: needs one positive number, or {hosts} (one per rank)")
    return values


@dataclass
class StepTime:
    mode: str
    compute_s: float
    exchange_s: float
    exchange_bytes: float  # over the busiest link, a step

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exchange_s


def predict(n_params: int, elements: Sequence[int], cuts: Sequence[tuple[int, int]], samples: Sequence[int],
            micro: Sequence[int], seq_len: int, dim: int, link_bps: float,
            flops: Sequence[float]) -> list[StepTime]:
    """Data parallel, ZeRO-1/2, ZeRO-3 and the pipeline's step on ranks sharing `samples` of a step (their
    micro-batches of `micro`), fp32 on the wire; `elements` are the pipeline's stages' parameter
    counts, `cuts` each rank's run of them, `flops` each rank's FLOP/s."""
    p = len(samples)
    ring = (p - 1) / p
    compute = max(6 * n_params * s * seq_len / f for s, f in zip(samples, flops, strict=True))
    dp_bytes, z3_bytes = 2 * ring * 4 * n_params, 3 * ring * 4 * n_params
    out = [StepTime("data parallel", compute, dp_bytes * 8 / link_bps, dp_bytes),
           StepTime("ZeRO-1/2", compute, dp_bytes * 8 / link_bps, dp_bytes),  # reduce-scatter + all-gather
           StepTime("ZeRO-3", compute, z3_bytes * 8 / link_bps, z3_bytes)]
    m = sum(math.ceil(s / max(k, 1)) for s, k in zip(samples, micro, strict=True))
    tokens = sum(samples) * seq_len / m  # a micro-batch's, on average
    stage = max(6 * sum(elements[a:b]) * tokens / f for (a, b), f in zip(cuts, flops, strict=True))
    hop = 4 * tokens * dim * 8 / link_bps  # one boundary activation (or its gradient) over a link
    slots = (m + p - 1) * max(stage, 2 * hop)
    out.append(StepTime("pipeline", slots, 2 * (p - 1) * hop, 2 * m * 4 * tokens * dim))
    return out


def advice_lines(times: Sequence[StepTime], fits: dict[str, bool], link: str) -> list[str]:
    """The predicted steps, fastest first among those that fit, and which to use."""
    lines = [f"predicted step at {link} (given --tflops; fp32 wire; the pipeline's compute with its fill and drain):"]
    for t in times:
        lines.append(f"  {t.mode:<14} {t.total_s:9.3g} s  = compute {t.compute_s:.3g} s + exchange {t.exchange_s:.3g} s"
                     f" ({t.exchange_bytes / 1e6:.4g} MB over the busiest link){'' if fits[t.mode] else '  does not fit'}")
    ok = sorted((t for t in times if fits[t.mode]), key=lambda t: t.total_s)
    if not ok:
        return lines
    best = ok[0]
    others = ", ".join(f"{t.mode} {t.total_s / best.total_s:.2f}x" for t in ok[1:])
    lines.append(f"use: {best.mode}" + (f" (the others that fit take {others} as long)" if others else ""))
    return lines
