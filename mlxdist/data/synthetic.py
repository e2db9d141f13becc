"""Synthetic tasks with a known answer, for tests: a model that learns them shows the loss falls.

Sample i is generated from (seed, i) alone, so any rank can make any sample.
"""

from __future__ import annotations

import numpy as np

SEP = 255


def synthetic_window(task: str, seed: int, index: int, seq_len: int) -> np.ndarray:
    rng = np.random.default_rng((seed, index))
    half = (seq_len + 1) // 2
    if task == "count":
        start = int(rng.integers(0, 200))
        return ((start + np.arange(seq_len + 1)) % 250).astype(np.int32)
    body = rng.integers(97, 107, size=half - 1, dtype=np.int32)  # 10 letters: learnable fast
    if task == "copy":
        answer = body
    elif task == "reverse":
        answer = body[::-1]
    elif task == "sort":
        answer = np.sort(body)
    else:
        raise ValueError(f"data.task: unknown synthetic task '{task}'")
    window = np.concatenate([body, [SEP], answer, [SEP, SEP]]).astype(np.int32)
    return window[: seq_len + 1]
