"""What each rank would hold under each `dist.shard` mode, and the one `auto` picks.

Pure arithmetic (no MLX, no torch, no MPI), so `python -m mlxdist.plan` prints it without
training and the trainer resolves `dist.shard=auto` from all-gathered numbers, every rank
reaching the same choice without another message.

Bytes per rank, N trained parameters, f = the rank's shard fraction (its `shard_sizes[r] / N`):

    mode         weights                      gradients        AdamW (m, v)
    none         4N (+ cN)                    4N               8N
    optimizer    4N (+ cN)                    4N               8N f      (ZeRO-1)
    gradients    4N (+ cN)                    4N f + bucket    8N f      (ZeRO-2)
    weights      4N f + c'G                   4N f + 4G        8N f      (ZeRO-3)

fp32 master weights and gradients (4 bytes), AdamW's two fp32 moments (8 bytes); c = 2 is the
bf16/fp16 compute copy the forward pass casts (0 for float32). ZeRO-2 still holds one
`dist.bucket_mb` bucket of full gradients while it is reduce-scattered. ZeRO-3 gathers one
unit of G parameters at a time (the built-in LM: one transformer block; a task: its largest
parameter tensor) in the compute dtype (c' = 2, or 4 for float32), and holds that unit's
full fp32 gradient until it is reduce-scattered. Activations: micro-batch x bytes per sample
(`lm_activation_bytes_per_sample`, or what the user measured), the same under every mode.

Shards are proportional to each rank's budget (`proportional_split` of the N elements by
memory x memory_target), so a 128 GB Studio holds more of the optimizer state than a 16 GB
MacBook. `auto` is the least sharding (none < optimizer < gradients < weights) whose every
rank fits its budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .split import proportional_split

MODES = ("none", "optimizer", "gradients", "weights")
MODE_NAMES = {"none": "data parallel", "optimizer": "ZeRO-1", "gradients": "ZeRO-2", "weights": "ZeRO-3"}
COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30

# Activations the built-in LM's backward keeps, in compute-dtype elements per token per layer:
# dim x (8 + 2 n_kv_heads / n_heads) + 4 ffn_dim. That is the two RMSNorm inputs and outputs
# and the residual sums (~6 dim), q and the attention output (2 dim; the fused attention keeps
# no seq x seq matrix), k and v (2 dim x n_kv/n_heads), the SwiGLU's gate, up, silu(gate) and
# their product (4 ffn_dim). For the 1b preset (ffn 2.75 dim, 8/16 kv heads) that is 20 x dim.
# Plus the fp32 logits, their log-softmax and its gradient: 12 bytes x vocab per token.
ACT_DIM_ELEMENTS = 8
ACT_FFN_ELEMENTS = 4
LOGIT_BYTES = 12


@dataclass(frozen=True)
class Bytes:
    """What one rank holds under one mode; `activations` None: not estimated."""

    weights: int
    gradients: int
    optimizer: int
    activations: int | None

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + (self.activations or 0)


def estimate(n_params: int, mode: str, shard_fraction: float, micro_batch: int,
             activation_bytes_per_sample: int | None, dtype: str = "float32", *,
             gather_params: int = 0, bucket_bytes: int = 0) -> Bytes:
    """Bytes one rank holds training `n_params` parameters under `mode` (see the module's
    table), owning `shard_fraction` of every sharded state, at `micro_batch` samples."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if not 0.0 <= shard_fraction <= 1.0:
        raise ValueError(f"shard_fraction {shard_fraction} is not within 0..1")
    n, f = n_params, shard_fraction
    compute = COMPUTE_BYTES[dtype]
    copy = 0 if dtype == "float32" else compute
    sharded = {m: MODES.index(mode) >= MODES.index(m) for m in MODES[1:]}
    optimizer = math.ceil(8 * n * f) if sharded["optimizer"] else 8 * n
    if sharded["weights"]:
        g = min(gather_params, n)
        weights = math.ceil(4 * n * f) + compute * g
        gradients = math.ceil(4 * n * f) + 4 * g
    else:
        weights = (4 + copy) * n
        gradients = (math.ceil(4 * n * f) + min(bucket_bytes, 4 * n)) if sharded["gradients"] else 4 * n
    act = None if activation_bytes_per_sample is None else micro_batch * activation_bytes_per_sample
    return Bytes(weights, gradients, optimizer, act)


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


def lm_activation_bytes_per_sample(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
                                   vocab_size: int, seq_len: int, dtype: str,
                                   grad_checkpoint_every: int = 0) -> int:
    """Activation bytes one sample of `seq_len` tokens keeps for the backward pass: see
    ACT_DIM_ELEMENTS. With `model.grad_checkpoint_every=k`, every k-th block (0, k, 2k, ...)
    keeps only its input and recomputes the rest; one block's full set is live again while it
    is recomputed."""
    per_layer = dim * ACT_DIM_ELEMENTS + 2 * dim * n_kv_heads // n_heads + ACT_FFN_ELEMENTS * ffn_dim
    recomputed = len(range(0, n_layers, grad_checkpoint_every)) if grad_checkpoint_every else 0
    elements = (n_layers - recomputed) * per_layer + recomputed * dim + (per_layer if recomputed else 0)
    return seq_len * (elements * COMPUTE_BYTES[dtype] + LOGIT_BYTES * vocab_size)


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
    act = lm_activation_bytes_per_sample(a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size,
                                         cfg.data.seq_len, cfg.model.dtype, a.grad_checkpoint_every)
    return LMFacts(param_count(a), act, max(block, a.vocab_size * a.dim))


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
        lines.append(f"{'dist.shard':<24}{'rank':<5}{'host':<14}{'weights':>8}{'grads':>8}{'adamw':>8}"
                     f"{'activ.':>8}{'total':>8}{'budget':>8}  fits")
        for mode in MODES:
            head = f"{mode} ({MODE_NAMES[mode]})"
            for i, (r, b) in enumerate(zip(self.ranks, self.needs[mode], strict=True)):
                act = "n/a" if b.activations is None else self._n(b.activations)
                ok = "yes" if b.total <= r.budget else "NO"
                lines.append(f"{head if i == 0 else '':<24}{r.rank:<5}{r.host[:13]:<14}{self._n(b.weights):>8}"
                             f"{self._n(b.gradients):>8}{self._n(b.optimizer):>8}{act:>8}{self._n(b.total):>8}"
                             f"{self._n(r.budget):>8}  {ok}")
        return lines + [""] + self.notes + ([self.choice_line()] if choice else [])

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
         gather_params: int = 0) -> Plan:
    """The plan for ranks on `hosts` ((host name, memory limit in bytes), one per rank in rank
    order): memory_target and micro-batch per rank from the config as the trainer reads them
    (`nodes:`), bytes from `estimate`, shards by `proportional_split` of the parameters by
    budget. `act_per_sample` None: activations are not counted (a note says so)."""
    if not hosts:
        raise ValueError("plan: no ranks")
    if n_params < 1:
        raise ValueError("plan: the model has no parameters")
    ranks = []
    for i, (host, memory) in enumerate(hosts):
        node = cfg.node_for(host, i)
        micro = node.batch_size if cfg.nodes else cfg.train.batch_size
        ranks.append(RankMemory(i, host, int(memory), node.memory_target or cfg.control.memory_target, micro))
    budgets = [float(r.memory) * r.target for r in ranks]  # as sync/sharded.py weighs its shard_bounds
    shard_sizes = proportional_split(n_params, budgets if sum(budgets) > 0 else [1.0] * len(ranks))
    bucket = int(cfg.dist.bucket_mb * 2**20)
    needs = {m: [estimate(n_params, m, s / n_params, r.micro_batch, act_per_sample, cfg.model.dtype,
                          gather_params=gather_params, bucket_bytes=bucket)
                 for r, s in zip(ranks, shard_sizes, strict=True)] for m in MODES}
    choice = choose_mode({m: [b.total for b in bs] for m, bs in needs.items()}, [r.budget for r in ranks])
    notes = []
    if act_per_sample is None:
        what = "a task" if cfg.task.factory else "a pretrained model.path"
        notes.append(f"activations not estimated for {what}; add --activation-gb (GiB per sample, as measured)")
    if cfg.dist.mode == "diloco":
        notes.append("note: dist.mode=diloco: each rank keeps its whole model and outer state; sharding is a ddp mode")
    return Plan(ranks, n_params, cfg.model.dtype, shard_sizes, needs, choice, cfg.dist.shard, notes)
