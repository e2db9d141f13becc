"""Where a pipeline cuts the layer stack: one contiguous run of stages per rank, in rank order.

A step of a pipeline lasts about as long as its slowest stage times the micro-batches (plus the
fill and drain), so the cut minimises the slowest rank's time, each rank's time being its run's
cost divided by its speed, subject to each rank's memory: a run's bytes must fit the rank's
budget. A half-speed Mac then gets about a third of the layers of an equal pair (the last rank,
which recomputes nothing, a third more: `LAST_RUN`), and a MacBook with a small budget no more
than it holds. Dynamic programming over contiguous cuts (ranks x
stages^2: a few thousand steps for a 100-layer model on 8 Macs): exact, pure, no framework.

Costs and bytes are per stage as the strategy counts them (`sync/pipeline.py`): the embedding
and the head are stages of their own, counted on the rank that runs them; a weight two runs
read (tied embeddings) is counted in both, since both hold it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from ..problems import ConfigError

# A 1F1B pipeline's last rank computes its loss and gradients in one pass (forward and backward:
# about 3 forwards' work); every other rank runs its forward, then recomputes it in backward (4).
# Measured: 12 stages of the small preset on 2 ranks, 5 + 7 stepped 10% faster than 6 + 6.
LAST_RUN = 0.75


def cut_stages(costs: Sequence[float], sizes: Sequence[float], speeds: Sequence[float],
               budgets: Sequence[float], last: float = 1.0) -> list[tuple[int, int]]:
    """[a_r, b_r) of the stages for each rank r (contiguous, in order, none empty), minimising
    max_r sum(costs[a_r:b_r]) / speeds[r] with sum(sizes[a_r:b_r]) <= budgets[r] (a budget of 0
    or less: unknown, no limit), the last rank's sum times `last` (a pipeline's: `LAST_RUN`).
    Ties go to the cut whose earlier ranks run fewer stages.
    ConfigError (one line) when there are more ranks than stages or no cut fits."""
    n, p = len(costs), len(speeds)
    if len(sizes) != n or len(budgets) != p:
        raise ValueError(f"cut_stages: {n} costs, {len(sizes)} sizes, {p} speeds, {len(budgets)} budgets")
    if p == 1:
        last = 1.0
    if p > n:
        raise ConfigError(f"dist.mode=pipeline on {p} ranks: the model has {n} stages, fewer than the ranks; "
                          f"run it on at most {n} ranks")
    if any(s <= 0 or not math.isfinite(s) for s in speeds):
        raise ValueError(f"cut_stages: speeds must be positive and finite: {list(speeds)}")
    cost = [0.0]
    size = [0.0]
    for c, s in zip(costs, sizes, strict=True):
        cost.append(cost[-1] + float(c))
        size.append(size[-1] + float(s))

    def fits(r: int, i: int, j: int) -> bool:
        return budgets[r] <= 0 or size[j] - size[i] <= budgets[r] * (1 + 1e-12)

    inf = math.inf
    # best[r][j]: the least slowest-time of ranks 0..r running stages [0, j); back[r][j]: where r starts.
    best = [[inf] * (n + 1) for _ in range(p)]
    back = [[-1] * (n + 1) for _ in range(p)]
    for j in range(1, n - p + 2):
        if fits(0, 0, j):
            best[0][j] = (cost[j] - cost[0]) / speeds[0]
            back[0][j] = 0
    for r in range(1, p):
        for j in range(r + 1, n - (p - 1 - r) + 1):
            for i in range(r, j):
                if best[r - 1][i] == inf or not fits(r, i, j):
                    continue
                t = max(best[r - 1][i], (cost[j] - cost[i]) * (last if r == p - 1 else 1.0) / speeds[r])
                if t < best[r][j] * (1 - 1e-12):  # strictly better: ties keep the earliest start
                    best[r][j], back[r][j] = t, i
    if best[p - 1][n] == inf:
        need = size[n] - size[0]
        have = sum(b for b in budgets if b > 0) if all(b > 0 for b in budgets) else inf
        raise ConfigError(f"dist.mode=pipeline: no cut of the model's {n} stages ({need / 2**30:.3g} GiB in all) fits "
                          f"the ranks' memory budgets ({', '.join(f'{b / 2**30:.3g}' for b in budgets)} GiB"
                          f"{f', {have / 2**30:.3g} GiB together' if have < inf else ''}); raise memory_target, "
                          "add a Mac, or set dist.pipeline_cut")
    cuts, j = [], n
    for r in range(p - 1, -1, -1):
        i = back[r][j]
        cuts.append((i, j))
        j = i
    return cuts[::-1]


def stage_loads(elements: Sequence[int], state_bytes: int) -> tuple[list[float], list[float]]:
    """Each stage's cost and bytes from its parameters' elements: the cost is the elements (a
    matmul's multiply-adds per row; an estimate, which counts an embedding's lookup as a matmul),
    the bytes fp32 weights and gradients and the optimizer's state (`state_bytes` per element).
    Activations are not counted yet (a stage in flight keeps one boundary activation per
    micro-batch waiting for its backward)."""
    return [float(e) for e in elements], [float((8 + state_bytes) * e) for e in elements]


def lm_stage_elements(cfg) -> list[int] | None:
    """The built-in LM's stages' parameter elements as its `stages()` cuts it (the embedding,
    each block, the head: the final norm and the output matrix, which is the embedding again
    when tied: the last rank holds a copy), from `model.preset` and its overrides alone; None
    for a task or a pretrained `model.path` (their stages are known once built)."""
    if cfg.task.factory or cfg.model.path:
        return None
    from ..models.presets import resolve

    a = resolve(cfg.model)
    hd = a.head_dim
    block = a.dim * a.n_heads * hd * 2 + a.dim * a.n_kv_heads * hd * 2 + 3 * a.dim * a.ffn_dim + 2 * a.dim
    return [a.vocab_size * a.dim, *[block] * a.n_layers, a.dim + a.vocab_size * a.dim]


def cut_lines(elements: Sequence[int], state_bytes: int, hosts: Sequence[str], budgets: Sequence[float],
              speeds: Sequence[float] | None = None) -> list[str]:
    """What `python -m mlxdist.plan` says of a pipeline on these ranks: each rank's stages and
    bytes against its budget and its share of the step's compute, or the one line of why no cut
    fits."""
    speeds = list(speeds or [1.0] * len(hosts))
    costs, nbytes = stage_loads(elements, state_bytes)
    try:
        cuts = cut_stages(costs, nbytes, speeds, budgets, LAST_RUN)
    except ConfigError as e:
        return [f"pipeline (dist.mode=pipeline): {e}"]
    unit, div = ("GiB", 2**30) if max(budgets, default=0) >= 2**30 else ("MiB", 2**20)
    times = stage_time(costs, speeds, cuts, LAST_RUN)
    whole = sum(costs) * LAST_RUN / max(speeds)  # one process: forward and backward, nothing recomputed
    parts = [f"rank {r} ({h}) stages {a}-{b - 1}: {sum(nbytes[a:b]) / div:.1f} of {budgets[r] / div:.1f} {unit}"
             for r, ((a, b), h) in enumerate(zip(cuts, hosts, strict=True))]
    return [f"pipeline (dist.mode=pipeline, {len(elements)} stages: embedding, blocks, head): " + "; ".join(parts),
            f"  slowest stage {max(times) / whole:.0%} of one process's compute a micro-batch (weights, gradients "
            "and optimizer state counted; activations not yet)"]


def stage_time(costs: Sequence[float], speeds: Sequence[float], cuts: Sequence[tuple[int, int]],
               last: float = 1.0) -> list[float]:
    """Each rank's time for its run under `cuts` (cost / speed; the last rank's times `last`),
    in rank order."""
    return [sum(costs[a:b]) / s * (last if r == len(cuts) - 1 and r else 1.0)
            for r, ((a, b), s) in enumerate(zip(cuts, speeds, strict=True))]


def parse_cut(text: str, stages: int, ranks: int) -> list[tuple[int, int]]:
    """`dist.pipeline_cut` ("2,4": stages per rank) as [a_r, b_r) runs; one line when it is not a
    cut of `stages` stages into `ranks` non-empty runs."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"dist.pipeline_cut={text}: give each rank's number of stages, comma-separated "
                          "(e.g. 2,4)") from None
    if len(counts) != ranks or any(c < 1 for c in counts) or sum(counts) != stages:
        raise ConfigError(f"dist.pipeline_cut={text}: needs {ranks} positive counts (one per rank) adding up to "
                          f"the model's {stages} stages")
    cuts, a = [], 0
    for c in counts:
        cuts.append((a, a + c))
        a += c
    return cuts


def stage_costs(seconds: list[list[float]]) -> list[float]:
    """One cost per stage from every rank's timings: each rank's as shares of its own forward
    (a slower rank's are as good), averaged over ranks."""
    shares = [[t / max(sum(ts), 1e-12) for t in ts] for ts in seconds]
    return [statistics.fmean(col) for col in zip(*shares, strict=True)]


def stage_costs_line(costs: list[float], seconds: list[list[float]]) -> str:
    """What the start says of measured stage costs: the first, middle and last stages' shares."""
    n, whole = len(costs), statistics.median(sum(ts) for ts in seconds)
    middle = costs[1:-1]
    mid = (f", stages 1-{n - 2} {min(middle):.1%}-{max(middle):.1%} each" if len(middle) > 1 else
           f", stage 1 {middle[0]:.1%}" if middle else "")
    return (f"stage costs measured at start (a forward pass of one sample on every rank, {whole * 1e3:.3g} ms): "
            f"stage 0 {costs[0]:.1%}{mid}, stage {n - 1} {costs[-1]:.1%} of it; the cut weighs these "
            "(dist.measure_stages=false: parameter counts)")

