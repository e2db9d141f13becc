"""The arithmetic `bench balance` reports with: the oracle's whole-sample split and the cost
of compute jitter in lockstep steps. (The bench itself needs namespace hosts and ~8 minutes:
`python -m mlxdist.bench balance`; docs/measurements.md "Load balancing across unequal hosts" has its runs.)"""

from __future__ import annotations

import itertools

import pytest

from mlxdist.bench.balance import lockstep_cost, whole_split


@pytest.mark.parametrize("total, weights", [(48, [1 / 0.039, 1 / 0.080]), (72, [1.0, 1.0, 0.5]),
                                            (48, [1.0, 1.0]), (7, [1.0, 1.0, 1.0]), (10, [0.3, 0.3, 0.4])])
def test_whole_split_is_the_nearest_split_in_whole_samples(total, weights) -> None:
    got = whole_split(total, weights)
    assert sum(got) == total and all(isinstance(x, int) for x in got)
    exact = [total * w / sum(weights) for w in weights]

    def gap(split):
        return sum(abs(s - e) for s, e in zip(split, exact, strict=True))

    # No other split of the same total into whole samples is closer to the exact one.
    every = [c for c in itertools.product(range(total + 1), repeat=len(weights)) if sum(c) == total]
    assert gap(got) == pytest.approx(min(gap(c) for c in every))


def test_lockstep_cost_is_what_jitter_adds_to_the_slowest_rank() -> None:
    assert lockstep_cost([[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]]) == pytest.approx(0.0)  # no jitter
    assert lockstep_cost([[1.0, 1.2], [1.0, 1.2]]) == pytest.approx(0.0)  # both slowed together
    # Each rank is slow on the other's fast step: every step lasts 1.2 against means of 1.1.
    assert lockstep_cost([[1.0, 1.2], [1.2, 1.0]]) == pytest.approx(1.2 / 1.1 - 1)
    with pytest.raises(ValueError):
        lockstep_cost([[1.0, 1.0], [1.0]])  # a rank missing a step
