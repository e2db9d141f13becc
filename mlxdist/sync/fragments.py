"""Which parameters sync together, and when: Streaming DiLoCo's fragments and the time box.

Streaming DiLoCo (arXiv 2501.18512) splits the model into F fragments and syncs them in
turn, H/F inner steps apart, so the link carries 1/F of the model at a time instead of
all of it in a burst every H steps. The schedule counts inner steps within a round of
H; fragment k is due once the round reaches (k+1)*H//F steps, so with F=1 it is plain
DiLoCo (sync after H, 2H, ...).

The time box (`dist.sync_every_s`) lets a fast node do more inner steps than a slow one
between syncs. No rank may wait on another mid-round, so the step counts are decided at
each round boundary from rates all ranks all-gathered, by one deterministic function.
"""

from __future__ import annotations

import math


def partition(sizes: list[int], fragments: int) -> list[list[int]]:
    """Split parameter indices into `fragments` groups of near-equal total size.

    Largest-first into the lightest group (ties to the lower group), indices sorted
    within each group. Deterministic, so every rank computes the same split.
    """
    if fragments < 1:
        raise ValueError(f"dist.fragments={fragments}: must be at least 1")
    if fragments > len(sizes):
        raise ValueError(f"dist.fragments={fragments} exceeds the model's {len(sizes)} parameter arrays; "
                         f"use at most {len(sizes)}")
    loads = [0] * fragments
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(fragments), key=lambda k: (loads[k], k))
        groups[k].append(i)
        loads[k] += sizes[i]
    return [sorted(g) for g in groups]


def threshold(fragment: int, period: int, fragments: int) -> int:
    """Steps into a round after which `fragment` syncs (the last one closes the round)."""
    return (fragment + 1) * period // fragments


def plan_inner_steps(rates: list[float], seconds: float, *, min_steps: int, max_steps: int | None = None,
                     fallback: int | None = None) -> list[int]:
    """Inner steps per rank for the next round of a `seconds`-long time box.

    `rates` are the ranks' measured inner steps per second (all-gathered, so every rank
    gets the same list and the same answer). A rank with no measurement yet (rate <= 0
    or not finite) gets `fallback` (or `min_steps`). At least `min_steps` (the fragment
    count: each fragment needs a step of its own), at most `max_steps`.
    """
    out = []
    for r in rates:
        if r > 0 and math.isfinite(r):
            steps = int(math.floor(r * seconds))
        else:
            steps = fallback if fallback is not None else min_steps
        steps = max(min_steps, steps)
        if max_steps is not None:
            steps = min(max_steps, steps)
        out.append(steps)
    return out
