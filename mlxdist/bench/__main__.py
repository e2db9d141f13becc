"""`python -m mlxdist.bench {overhead,allreduce,torchddp,balance,diloco,load,finetune}`: speed claims, measured as ratios.

Every benchmark runs its baseline in the same process run, interleaved, because these
machines are noisy: only ratios measured side by side mean anything.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m mlxdist.bench {overhead,allreduce,torchddp,balance,diloco,load,finetune} [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    try:
        return _run(name, rest)
    except FileNotFoundError as e:  # mpirun or a data file: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(name: str, rest: list[str]) -> int:
    if name == "overhead":
        from ..blas import ensure_openblas

        ensure_openblas()
        from .overhead import overhead

        return overhead(rest)
    if name == "torchddp":
        from .torchddp import main as torchddp_main

        return torchddp_main(rest)
    if name == "allreduce":
        from .allreduce import main as allreduce_main

        return allreduce_main(rest)
    if name == "balance":
        from .balance import main as balance_main

        return balance_main(rest)
    if name == "diloco":
        from .diloco import main as diloco_main

        return diloco_main(rest)
    if name == "load":
        from ..blas import ensure_openblas

        ensure_openblas()
        from .load import main as load_main

        return load_main(rest)
    if name == "finetune":
        from .finetune import main as finetune_main

        return finetune_main(rest)
    print(f"error: unknown benchmark '{name}' (overhead, allreduce, balance, diloco, load, finetune)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
