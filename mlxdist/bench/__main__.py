"""`python -m mlxdist.bench NAME [options]` (or `mlxdist-bench`): speed claims, measured as ratios.

Every benchmark runs its baseline in the same process run, interleaved, because these
machines are noisy: only ratios measured side by side mean anything.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, entry point, whether MLX runs in this process: then the fast BLAS is
# preloaded first, by a re-exec, before anything imports MLX), what it measures.
BENCHMARKS = {
    "overhead": ("overhead", "overhead", True, "the trainer against the shortest correct MLX loop (or --task)"),
    "allreduce": ("allreduce", "main", False, "gradient all-reduce throughput per backend vs the link"),
    "torchddp": ("torchddp", "main", False, "torch engine across ranks vs torch.distributed DDP"),
    "balance": ("balance", "main", False, "unequal hosts: balanced vs equal split vs ideal"),
    "diloco": ("diloco", "main", False, "DiLoCo vs DDP on slow links, against the no-communication bound"),
    "load": ("load", "main", True, "SmolLM2 load and first step: ours vs mlx-lm"),
    "finetune": ("finetune", "main", False, "LoRA steps: ours vs mlx-lm and transformers + peft"),
    "generate": ("generate", "main", True, "mlxdist.generate vs mlx_lm.generate, tokens/s"),
    "shard": ("shard", "main", False, "sharded data parallel (ZeRO-1/2) vs data parallel: memory per rank, step time"),
    "optim": ("optim", "main", False, "the torch engine's AdamW (mlxdist.optim) vs torch.optim.AdamW, one step"),
    "wire": ("wire", "main", False, "data parallel's int8 gradient wire (error feedback) vs fp32: step time, loss"),
    "compiled": ("compiled", "main", False, "your MLX loop: the step compiled with its gradient sum inside vs uncompiled"),
    "cluster": ("cluster", "main", False, "2 hosts, one at half speed, shaped links: ours vs mlx-lm LoRA and DDP"),
    "checkpoint-io": ("checkpoint_io", "main", False, "checkpoint write/read: plain safetensors vs zstd"),
    "pipeline": ("pipeline", "main", False, "a model no host holds: pipeline vs ZeRO-3 on shaped links, equal and half-speed hosts"),
    "yourloop": ("yourloop", "main", False, "a DDP-style script on mlxdist.torch vs DDP+gloo, quiet and busy; CPU while waiting"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    return "usage: python -m mlxdist.bench NAME [options]   (NAME --help for its options)\n\n" + "\n".join(
        f"  {name:<{width}}  {about}" for name, (*_, about) in BENCHMARKS.items())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"error: unknown benchmark '{name}' ({', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    module, entry, uses_mlx, _ = BENCHMARKS[name]
    try:
        if uses_mlx:
            from ..blas import ensure_openblas

            ensure_openblas()
        return getattr(importlib.import_module(f"{__package__}.{module}"), entry)(rest)
    except FileNotFoundError as e:  # mpirun or a data file: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
