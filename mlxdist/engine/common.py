"""Engine logic that is the same whatever the framework: one copy, so both engines agree.

Both engines must produce the same numbers from the same checkpoint (DESIGN promise 5),
so the rules that decide numbers (which parameters decay, how a token is drawn) live
here, in numpy, not twice in two frameworks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def decays(shape: tuple[int, ...]) -> bool:
    """AdamW's decoupled weight decay applies to matrices, not to norms and biases."""
    return len(shape) >= 2


def check_weights(expected: Mapping[str, tuple[int, ...]], weights: Mapping[str, np.ndarray],
                  what: str = "checkpoint") -> None:
    """One line that says which parameters do not fit, before anything is overwritten."""
    from ..models.weights import weights_mismatch

    problem = weights_mismatch(expected, weights, what,
                               "a different model.preset, model.path, finetune setting or task.args?")
    if problem:
        raise ValueError(problem)


def sample_tokens(next_logits: Callable[[list[int]], np.ndarray], prompt: list[int], max_new: int,
                  temperature: float, seed: int, context: int, stop: set[int] | None = None,
                  on_token: Callable[[int], None] | None = None) -> list[int]:
    """Draw up to `max_new` tokens after `prompt`; `next_logits(window)` gives fp32 logits of
    the last position. The draw is made here with numpy, so a seed gives the same text on
    either engine and any device. temperature <= 0 means greedy."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token (e.g. --prompt 'Hello')")
    rng = np.random.default_rng(seed)
    seq, out = list(prompt), []
    for _ in range(max_new):
        logits = np.asarray(next_logits(seq[-context:]), np.float64)
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            z = logits / temperature
            p = np.exp(z - z.max())
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        seq.append(nxt)
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if stop and nxt in stop:
            break
    return out


def task_optimizers(task, model, kind: type, what: str) -> list:
    """What the task's `optimizer(model)` returned, as a list of `kind`; one line naming the
    task when it raises or returns something else."""
    from ..tasks import TaskError

    try:
        made = task.optimizer(model)
    except Exception as e:
        raise TaskError(f"task {task.name}: optimizer(model) raised {type(e).__name__}: {e}") from None
    opts = list(made) if isinstance(made, (list, tuple)) else [made]
    for o in opts:
        if not isinstance(o, kind):
            raise TaskError(f"task {task.name}: optimizer(model) returned {type(o).__name__}, not {what}")
    return opts
