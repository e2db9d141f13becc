"""What each rank would hold under each `dist.shard` mode, and the one `auto` picks.

Pure arithmetic (no MLX, no torch, no MPI), so `python -m mlxdist.plan` prints it without
training and the trainer resolves `dist.shard=auto` from all-gathered numbers, every rank
reaching the same choice without another message.

The estimate is of a rank's peak in MLX's memory (what the step events' `memory_peak_bytes`
report and the batch controller holds against the limit). A step has three high points, and
the estimate is the highest:

    peak = weights + adamw + max(activations, whole gradients, grads + update)

N trained parameters, f = the rank's shard fraction (its `shard_sizes[r] / N`), c = 2 the
bf16/fp16 compute copy the forward pass casts (0 for float32). The table is AdamW's (8 bytes
of state a parameter: m, v); `train.optimizer` with S bytes (`mlxdist.optim`: Lion 4, one
moment) holds S N (f) in that column, and its update makes S instead of 8 of new state:

    mode         weights       adamw (m, v)   grads (at the update)      update
    none         (4 + c) N     8 N            4 N  (+ 4 N on 2+ ranks)    12 N
    optimizer    (4 + c) N     8 N f          4 N + 4 N f                max(17 N f, 4 N + N f)
    gradients    (4 + c) N     8 N f          4 N f                      max(17 N f, 4 N + N f)
    weights      4 N f + (4+c) G  8 N f       4 N f                      13 N f

- backward: the activations it keeps (below); the gradients it makes take their place as it
  goes, so they do not add (measured: the peak's floor was weights + adamw). It ends holding
  the whole gradient tree, 4 N, under data parallel, ZeRO-1 and ZeRO-2: MLX builds it whole,
  ZeRO-2 lets go of it only while it is reduce-scattered (ZeRO-3 holds one stage's, 4 G).
- the update, data parallel: the reducer's summed copy of the gradients beside the engine's
  (2+ ranks), and the compiled AdamW's new p, m, v beside the old ones (12 N).
- the update, sharded: the reduced shard g (4 N f; ZeRO-1 still holds the whole tree too),
  then the shard's weights p (4 N f), the weight-decay mask (1 byte, N f) and the new p, m, v
  (12 N f) beside the old: 17 N f; then the all-gathered weights are set while the old ones
  are still held (4 N more, and p and the mask: N f), which is the higher of the two once a
  rank's shard is under about a quarter.
- ZeRO-3 gathers one stage of G parameters at a time (the built-in LM: a block, or the
  vocab x dim embedding or head, whichever is larger; a task: its largest parameter tensor) in
  fp32 beside its compute copy (c), holds that stage's fp32 gradient (4 G) until it is
  reduce-scattered, and keeps only the stages' inputs for backward (activations as with
  `model.grad_checkpoint_every=1`: one block's whole set live while it is recomputed). The
  update is ZeRO-2's on the shard, with no all-gather after it. "whole": every rank builds the
  whole model at start and cuts its slice (4 N; counted beside the shards, a little high: at
  start they are not cut yet); the checkpoint writer (rank 0) gathers the whole weights
  and moments to save them (12 N). A resume hands every rank the whole moments too (12 N):
  not counted.

Measured (MLX 0.32 on the CPU, `memory_peak_bytes` of steps 2-4; presets tiny, small and base,
1 to 6 ranks on one host, seq_len 32 to 512, batches 1 to 64): 40 runs, each within 6% of this
estimate (`python -m mlxdist.bench shard`'s 125M `base` on 2 ranks: data parallel 4012 MB
measured, 4008 estimated, was 2038 before the update's temporaries were counted; ZeRO-1 2818,
2818; ZeRO-2 2317, 2317; ZeRO-3 1816 measured, 1858 estimated, at 3 ranks 1211 and 1253: high
by the one gathered block counted beside the update; where activations set ZeRO-3's peak, tiny at
8 x 512 tokens, 222 MB measured against 200 estimated: 10% low, and small at 4 x 256 within 3%).
In units of N, float32: data parallel 28 N on one rank and 32 N on
two or more; ZeRO-1 8 N + 29 N f; ZeRO-2 4 N + 29 N f; at 6 ranks ZeRO-1 14.2 N and ZeRO-2
10.2 N (the all-gather's point). bfloat16 (small, 2 checks): within 1% at the update, 4% low
with large activations.

Not seen by this estimate (it counts MLX's arrays only): numpy buffers outside MLX, which use
the machine's memory but not Metal's working set: the sharded modes' all-gather buffer (4 N,
kept between steps), the reduce-scatter's result (4 N f) and one `dist.bucket_mb` send buffer,
the checkpoint writer's gathered moments (8 N, at a save), the mpi4py ring's buffers; MLX's
cache of freed buffers (`memory_active_bytes` excludes it, the process's resident size does
not); the first step's lazily allocated moments; micro-batch accumulation (`train.accum` > 1:
the summed gradients, 4 N, beside the next micro-batch's backward); and any other engine
(torch keeps its own allocator and optimizer temporaries).

Activations (the built-in LM, `lm_activation_bytes_per_sample`): per token, in compute-dtype
elements, ACT_EMBED_ELEMENTS x dim outside the blocks, and per block ACT_DIM_ELEMENTS x dim +
ACT_FFN_ELEMENTS x ffn_dim + the attention's ACT_SCORE_ELEMENTS x n_heads x seq_len (the
softmax kept for the backward pass: a seq x seq matrix per head) + seq_len; plus LOGIT_BYTES x
vocab (fp32 logits, log-softmax and gradients). Fitted to 13 measurements of how the peak
grows with tokens (MLX's CPU backend, float32; presets tiny and small with dim, ffn_dim,
n_heads, n_layers, vocab_size and seq_len varied), each within 4%; `base` and a dim-1024
model, not in the fit, within 3%. Metal's fused attention may keep no seq x seq matrix: there
the estimate errs high.

Each mode's line is its strategy's (`Strategy.memory(need)`, the table's row for that mode, in
`sync/`): this module keeps what every line shares (`RankNeed`, `Bytes`, the split, the
activations, the printing) and is handed the lines (`sync.strategy.memory_lines()`), since
a policy here imports no strategy (they use the cluster).

Shards are proportional to each rank's budget (`proportional_split` of the N elements by
memory x memory_target), so a 128 GB Studio holds more of the optimizer state than a 16 GB
MacBook. `auto` is the least sharding (none < optimizer < gradients < weights) whose every
rank fits its budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..optim import OPTIMIZERS, make_optimizer
from .split import shard_bounds

MODES = ("none", "optimizer", "gradients", "weights")
MODE_NAMES = {"none": "data parallel", "optimizer": "ZeRO-1", "gradients": "ZeRO-2", "weights": "ZeRO-3"}
COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30

# Activations the built-in LM's backward keeps, per token, in compute-dtype elements (fitted:
# see the module's docstring). Outside the blocks: the embedding's output, the final norm and
# the tied head's input, with their gradients' buffers (36 x dim, measured). Per block: the
# norms' inputs and outputs, q, k, v and their rotated copies, the attention output and the
# residual sums (7 x dim); the SwiGLU's gate, up, sigmoid, silu(gate) and product (5.5 x ffn);
# the attention's softmax (1.15 x n_heads x seq) and its mask (1 x seq). Then 16 bytes x vocab:
# the fp32 logits, their log-softmax and its gradient.
ACT_EMBED_ELEMENTS = 36
ACT_DIM_ELEMENTS = 7
ACT_FFN_ELEMENTS = 5.5
ACT_SCORE_ELEMENTS = 1.15
ACT_SEQ_ELEMENTS = 1
LOGIT_BYTES = 16


@dataclass(frozen=True)
class Bytes:
    """What one rank holds under one mode (see the module's table); `activations` None: not
    estimated. `gradients` are those held at the update, `update` the update's temporaries,
    `whole_gradients` what the backward ends holding."""

    weights: int
    gradients: int
    optimizer: int
    activations: int | None
    update: int = 0
    whole_gradients: int = 0
    whole_model: int = 0  # ZeRO-3: the whole model gathered for evaluation and checkpoints

    @property
    def total(self) -> int:
        """The step's peak: the highest of backward's and the update's high points (and
        ZeRO-3's whole-model phases)."""
        return self.weights + self.optimizer + max(self.activations or 0, self.whole_gradients,
                                                   self.gradients + self.update, self.whole_model)


@dataclass(frozen=True)
class RankNeed:
    """What one rank's line of the plan is computed from, for a strategy's `memory` (the
    module's table): N trained parameters, the rank's shard of the sharded state, ..."""

    mode: str  # the dist.shard mode the line is for
    n: int  # trained parameters
    shard: int  # this rank's elements of every sharded state: ceil(N f)
    copy: int  # bytes a parameter of the compute copy the forward casts (0 for float32)
    state_bytes: int  # the optimizer's state a parameter (AdamW 8, Lion 4)
    activations: int | None  # the micro-batch's, backward's; None: not estimated
    staged_activations: int | None  # the micro-batch's when only the stages' inputs are kept (ZeRO-3)
    gather: int  # parameters of the largest stage (ZeRO-3's unit of gathering), at most n
    ranks: int  # in the run
    writer: bool  # this rank gathers the whole model and moments to save a checkpoint


MemoryLine = Callable[[RankNeed], Bytes]


def estimate(n_params: int, mode: str, shard_fraction: float, micro_batch: int,
             activation_bytes_per_sample: int | None, dtype: str = "float32", *, memory: Mapping[str, MemoryLine],
             gather_params: int = 0, ranks: int = 1, staged_activation_bytes_per_sample: int | None = None,
             writer: bool = False, state_bytes: int = 8) -> Bytes:
    """Bytes one rank holds training `n_params` parameters under `mode`, as `memory[mode]` (its
    strategy's line: `sync.strategy.memory_lines()`) counts them, owning `shard_fraction` of
    every sharded state, at `micro_batch` samples, in a run of `ranks` ranks. ZeRO-3 keeps only
    the stages' inputs (`staged_activation_bytes_per_sample`, default the others'); a checkpoint
    `writer` gathers the moments too when it saves. `state_bytes`: the optimizer's state per
    parameter (AdamW 8, Lion 4)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if not 0.0 <= shard_fraction <= 1.0:
        raise ValueError(f"shard_fraction {shard_fraction} is not within 0..1")
    if mode not in memory:
        raise ValueError(f"no memory line for dist.shard={mode}: pass sync.strategy.memory_lines()")
    act = None if activation_bytes_per_sample is None else micro_batch * activation_bytes_per_sample
    staged = None if staged_activation_bytes_per_sample is None else micro_batch * staged_activation_bytes_per_sample
    copy = 0 if dtype == "float32" else COMPUTE_BYTES[dtype]
    return memory[mode](RankNeed(mode, n_params, math.ceil(n_params * shard_fraction), copy, state_bytes, act,
                                 staged, min(gather_params, n_params), ranks, writer))


def choose_mode(needs: dict[str, Sequence[int]], budgets: Sequence[int]) -> str | None:
    """The least sharding whose every rank's bytes (`needs[mode][rank]`) fit its budget;
    None when not even `weights` fits."""
    for mode in MODES:
        if mode in needs and all(b <= cap for b, cap in zip(needs[mode], budgets, strict=True)):
            return mode
    return None


@dataclass(frozen=True)
class RankMemory:
    """One rank: its host, the memory limit the trainer measures against, `memory_target`
    (`nodes.HOST.memory_target`, else `control.memory_target`) and its micro-batch."""

    rank: int
    host: str
    memory: int
    target: float
    micro_batch: int

    @property
    def budget(self) -> int:
        return int(self.memory * self.target)

    @property
    def label(self) -> str:
        return f"rank {self.rank} ({self.host})"


@dataclass(frozen=True)
class LMFacts:
    """The built-in LM's numbers, from its preset alone (no framework)."""

    n_params: int
    activation_bytes_per_sample: int
    gather_params: int  # one transformer block: ZeRO-3's unit of gathering
    staged_activation_bytes_per_sample: int  # ZeRO-3 keeps the blocks' inputs (recomputing each block)


def lm_activation_bytes_per_sample(dim: int, n_layers: int, n_heads: int, ffn_dim: int, vocab_size: int,
                                   seq_len: int, dtype: str, grad_checkpoint_every: int = 0) -> int:
    """Activation bytes one sample of `seq_len` tokens keeps for the backward pass: see
    ACT_DIM_ELEMENTS (k and v, whatever `n_kv_heads`, are within its 7 x dim: no separate term
    showed in the measurements). With `model.grad_checkpoint_every=k`, every k-th block (0, k,
    2k, ...) keeps only its input and recomputes the rest; one block's full set is live again
    while it is recomputed."""
    per_layer = (ACT_DIM_ELEMENTS * dim + ACT_FFN_ELEMENTS * ffn_dim
                 + (ACT_SCORE_ELEMENTS * n_heads + ACT_SEQ_ELEMENTS) * seq_len)
    recomputed = len(range(0, n_layers, grad_checkpoint_every)) if grad_checkpoint_every else 0
    elements = (ACT_EMBED_ELEMENTS * dim + (n_layers - recomputed) * per_layer + recomputed * dim
                + (per_layer if recomputed else 0))
    return seq_len * (math.ceil(elements * COMPUTE_BYTES[dtype]) + LOGIT_BYTES * vocab_size)


def lm_facts(cfg) -> LMFacts | None:
    """The built-in LM's parameter count, activations per sample and ZeRO-3 unit, from
    `model.preset` and its overrides; None for a task or a pretrained `model.path` (build it to
    count, and measure activations)."""
    if cfg.task.factory or cfg.model.path:
        return None
    from ..models.presets import param_count, resolve

    a = resolve(cfg.model)
    hd = a.head_dim
    block = a.dim * a.n_heads * hd * 2 + a.dim * a.n_kv_heads * hd * 2 + 3 * a.dim * a.ffn_dim + 2 * a.dim
    act = lm_activation_bytes_per_sample(a.dim, a.n_layers, a.n_heads, a.ffn_dim, a.vocab_size, cfg.data.seq_len,
                                         cfg.model.dtype, a.grad_checkpoint_every)
    staged = lm_activation_bytes_per_sample(a.dim, a.n_layers, a.n_heads, a.ffn_dim, a.vocab_size, cfg.data.seq_len,
                                            cfg.model.dtype, 1)
    return LMFacts(param_count(a), act, max(block, a.vocab_size * a.dim), staged)


@dataclass
class Plan:
    """Every rank's bytes under every mode, the shard split, and `auto`'s choice."""

    ranks: list[RankMemory]
    n_params: int
    dtype: str
    shard_sizes: list[int]  # parameters (elements) each rank owns when sharded
    needs: dict[str, list[Bytes]]
    choice: str | None  # what dist.shard=auto resolves to; None: nothing fits
    configured: str = "auto"  # dist.shard as set
    notes: list[str] = field(default_factory=list)
    optimizer: str = "adamw"  # train.optimizer: its state is the table's optimizer column

    @property
    def budgets(self) -> list[int]:
        return [r.budget for r in self.ranks]

    @property
    def fractions(self) -> list[float]:
        return [s / self.n_params for s in self.shard_sizes]

    def fits(self, mode: str) -> bool:
        return all(b.total <= r.budget for b, r in zip(self.needs[mode], self.ranks, strict=True))

    def problem(self, mode: str) -> str | None:
        """None when `mode` fits every rank; else one line naming the rank that misses by most."""
        over = [(b.total / r.budget if r.budget else math.inf, r, b)
                for b, r in zip(self.needs[mode], self.ranks, strict=True) if b.total > r.budget]
        if not over:
            return None
        _, r, b = max(over, key=lambda t: t[0])
        more = f" (and {len(over) - 1} more rank(s))" if len(over) > 1 else ""
        return (f"{r.label} needs {self._n(b.total)} {self._unit} under dist.shard={mode} ({MODE_NAMES[mode]}) but its budget is "
                f"{self._n(r.budget)} {self._unit} ({self._n(r.memory)} {self._unit} x memory_target {r.target:g}){more}")

    @property
    def _unit(self) -> str:
        """GiB, or MiB for a plan whose largest budget is under 1 GiB (a small model, a test)."""
        return "GiB" if max((r.budget for r in self.ranks), default=GIB) >= GIB else "MiB"

    def _n(self, n: float) -> str:
        return f"{n / (GIB if self._unit == 'GiB' else 2**20):.1f}"

    def no_fit_line(self) -> str:
        """The one line when not even ZeRO-3 fits."""
        return (f"no dist.shard fits: {self.problem('weights')}; lower that host's micro-batch "
                "(nodes.HOST.batch_size), data.seq_len or the model, or set model.grad_checkpoint_every")

    def choice_line(self) -> str:
        if self.choice is None:
            return self.no_fit_line()
        why = "it fits every rank" if self.choice == "none" else \
            f"{MODES[MODES.index(self.choice) - 1]} does not: {self.problem(MODES[MODES.index(self.choice) - 1])}"
        return f"dist.shard=auto -> {self.choice} ({MODE_NAMES[self.choice]}): the least sharding that fits; {why}"

    def table_lines(self, choice: bool = True) -> list[str]:
        """The printed plan: ranks, then per mode and rank the bytes held against the budget, the
        notes, and (`choice`) the line saying what `auto` picks or why nothing fits."""
        lines = [f"{self.n_params:,} trained parameters, model.dtype {self.dtype}; "
                 f"{self._unit} = 2^{30 if self._unit == 'GiB' else 20} bytes",
                 f"{'rank':<5}{'host':<14}{'memory':>8}{'target':>8}{'budget':>8}{'micro':>7}{'shard':>8}"]
        for r, f in zip(self.ranks, self.fractions, strict=True):
            lines.append(f"{r.rank:<5}{r.host[:13]:<14}{self._n(r.memory):>8}{r.target:>8.2f}{self._n(r.budget):>8}"
                         f"{r.micro_batch:>7}{100 * f:>7.1f}%")
        lines.append("")
        lines.append(f"{'dist.shard':<24}{'rank':<5}{'host':<14}{'weights':>8}{self.optimizer:>8}{'activ.':>8}"
                     f"{'grads':>8}{'update':>8}{'whole':>8}{'peak':>8}{'budget':>8}  fits")
        for mode in MODES:
            head = f"{mode} ({MODE_NAMES[mode]})"
            for i, (r, b) in enumerate(zip(self.ranks, self.needs[mode], strict=True)):
                act = "n/a" if b.activations is None else self._n(b.activations)
                ok = "yes" if b.total <= r.budget else "NO"
                lines.append(f"{head if i == 0 else '':<24}{r.rank:<5}{r.host[:13]:<14}{self._n(b.weights):>8}"
                             f"{self._n(b.optimizer):>8}{act:>8}{self._n(b.gradients):>8}{self._n(b.update):>8}"
                             f"{self._n(b.whole_model) if b.whole_model else '-':>8}"
                             f"{self._n(b.total):>8}{self._n(r.budget):>8}  {ok}")
        state = OPTIMIZERS[self.optimizer].state_names
        key = (f"peak = weights + {self.optimizer} + the highest of: activ. (backward), the whole gradients (4 bytes a "
               "parameter, backward's end), grads + update (the update's temporaries), whole (ZeRO-3: the "
               f"whole model every rank builds at start, 4 bytes a parameter; {4 + 4 * len(state)} on rank 0, "
               f"which gathers the weights and {'/'.join(state)} to save them)")
        return lines + ["", key] + self.notes + ([self.choice_line()] if choice else [])

    def unsharded_warning(self, can_shard: bool = True, auto: bool = True) -> str | None:
        """`dist.shard=none` as configured: None when data parallel's plan fits every rank; else
        one line naming the rank that misses by most, its budget and the plan's bytes, and what
        to set (`can_shard`: the engine shards, `auto`: and dist.shard=auto picks it there;
        otherwise the micro-batch or the model)."""
        problem = self.problem("none")
        if problem is None:
            return None
        if can_shard and self.choice in ("optimizer", "gradients"):
            fix = (f"set dist.shard=auto (or optimizer/gradients): auto would choose {self.choice} "
                   f"({MODE_NAMES[self.choice]})" if auto else
                   f"set dist.shard={self.choice} ({MODE_NAMES[self.choice]}): it fits")
        else:
            fix = ("lower the micro-batch (nodes.HOST.batch_size), data.seq_len or the model, or set "
                   "model.grad_checkpoint_every")
        return (f"warning: memory plan: {problem}; {fix}. Training goes on: the plan is an estimate "
                "(python -m mlxdist.plan prints it)")

    def banner_lines(self) -> list[str]:
        """The trainer's start lines once `auto` is resolved (or a set mode is checked)."""
        mode = self.choice if self.configured == "auto" else self.configured
        if mode is None:
            return [self.no_fit_line()]
        held = ", ".join(f"{r.label} {self._n(b.total)}/{self._n(r.budget)} {self._unit}"
                         for r, b in zip(self.ranks, self.needs[mode], strict=True))
        shards = "/".join(f"{100 * f:.0f}%" for f in self.fractions)
        head = self.choice_line() if self.configured == "auto" else f"dist.shard={mode} ({MODE_NAMES[mode]})"
        lines = [head, f"memory plan: {held}" + (f"; shards {shards} of {self.n_params:,} parameters"
                                                   if mode != "none" else "")]
        problem = self.problem(mode) if self.configured != "auto" else None
        if problem:
            lines.append(f"warning: {problem}; dist.shard=auto would choose {self.choice or 'nothing (none fits)'}")
        return lines + self.notes


def plan(cfg, hosts: Sequence[tuple[str, int]], n_params: int, act_per_sample: int | None, *,
         memory: Mapping[str, MemoryLine], gather_params: int = 0, staged_act_per_sample: int | None = None,
         shardable: bool = True) -> Plan:
    """The plan for ranks on `hosts` ((host name, memory limit in bytes), one per rank in rank
    order): memory_target and micro-batch per rank from the config as the trainer reads them
    (`Config.node_for`), bytes from `estimate`, shards by `split.shard_bounds` (the split the
    sharded strategies train with). `memory`: each mode's line (`sync.strategy.memory_lines()`).
    `act_per_sample` None: activations are not counted (a note says so). `shardable`: dist.mode's
    strategy is data parallel, sharded or not (its declaration: `sync.strategy.mode_strategy`);
    otherwise a note says the table is data parallel's."""
    if not hosts:
        raise ValueError("plan: no ranks")
    if n_params < 1:
        raise ValueError("plan: the model has no parameters")
    nodes = [cfg.node_for(host, i) for i, (host, _) in enumerate(hosts)]
    ranks = [RankMemory(i, host, int(memory), node.memory_target, node.batch_size)
             for i, ((host, memory), node) in enumerate(zip(hosts, nodes, strict=True))]
    budgets = [float(r.memory) * r.target for r in ranks]
    shard_sizes = [b - a for a, b in shard_bounds(n_params, budgets, cfg.dist.shard_split)]
    state_bytes = make_optimizer(cfg.train.optimizer, cfg.train).state_bytes
    needs = {m: [estimate(n_params, m, s / n_params, r.micro_batch, act_per_sample, cfg.model.dtype,
                          memory=memory, gather_params=gather_params, ranks=len(ranks), writer=r.rank == 0,
                          staged_activation_bytes_per_sample=staged_act_per_sample, state_bytes=state_bytes)
                 for r, s in zip(ranks, shard_sizes, strict=True)] for m in MODES}
    choice = choose_mode({m: [b.total for b in bs] for m, bs in needs.items()}, [r.budget for r in ranks])
    notes = []
    if act_per_sample is None:
        what = "a task" if cfg.task.factory else "a pretrained model.path"
        notes.append(f"activations not estimated for {what}; add --activation-gb (GiB per sample, as measured)")
    if not shardable:
        notes.append(f"note: dist.mode={cfg.dist.mode}: each rank keeps its whole model and its own state; "
                     "sharding is a ddp mode")
    return Plan(ranks, n_params, cfg.model.dtype, shard_sizes, needs, choice, cfg.dist.shard, notes,
                cfg.train.optimizer)
