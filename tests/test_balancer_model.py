"""The balancer's step-time model against synthetic hosts whose compute time is affine in
their share (``fixed + per_sample * share``): the shape that made the rate-proportional
rule creep toward the fast host one re-split at a time. Pure Python, no MLX, no MPI."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from mlxdist.control.balancer import (
    LoadBalancer,
    Point,
    StepModel,
    fit_line,
    fixed_range,
    min_max_split,
    summarise,
)

H = 0.05  # the default hysteresis


def worst(models: list[StepModel], shares: list[int]) -> float:
    return max(m.time(s) for m, s in zip(models, shares, strict=True))


def drive(bal: LoadBalancer, truth, steps: int, noise: float = 0.0, seed: int = 0,
          first: int = 1) -> list[tuple[int, list[int]]]:
    """Feed `steps` steps of compute times from `truth` (models, or step -> models),
    jittered by +-noise; the moves made, as (step, new shares)."""
    rng = random.Random(seed)
    moves = []
    for step in range(first, first + steps):
        models = truth(step) if callable(truth) else truth
        shares = bal.shares
        secs = [m.time(s) * (1 + rng.uniform(-noise, noise)) for m, s in zip(models, shares, strict=True)]
        new = bal.observe(step, shares, secs)
        if new is not None:
            moves.append((step, new))
    return moves


# A Studio and a MacBook: the MacBook is twice as slow per sample, and both pay a
# fixed cost per step as large as 25 samples of their per-sample time.
PAIR = [StepModel(0.5, 0.02), StepModel(1.0, 0.04)]
TRIO = [StepModel(0.3, 0.02), StepModel(0.3, 0.02), StepModel(0.6, 0.05)]


# ------------------------------------------------------------------ the pieces


def test_min_max_split_matches_brute_force() -> None:
    rng = random.Random(5)
    for _ in range(300):
        n = rng.choice([2, 3])
        minimum = rng.choice([1, 2])
        total = rng.randint(n * minimum, 20)
        models = [StepModel(rng.uniform(0, 1), rng.uniform(0.01, 0.3)) for _ in range(n)]
        got = min_max_split(models, total, minimum)
        assert sum(got) == total and min(got) >= minimum, got
        best = min(worst(models, list(c)) for c in itertools.product(range(minimum, total + 1), repeat=n)
                   if sum(c) == total)
        assert worst(models, got) == pytest.approx(best, rel=1e-12), (models, total, got)


def test_min_max_split_is_deterministic_and_scales() -> None:
    # Equal models: ties go to the lowest rank, the same on every rank.
    assert min_max_split([StepModel(0.1, 0.01)] * 3, 10) == [4, 3, 3]
    # A host so slow that the minimum is all it should get.
    assert min_max_split([StepModel(0.0, 0.01), StepModel(5.0, 1.0)], 48, minimum=2) == [46, 2]
    big = min_max_split(PAIR, 100_000)
    assert sum(big) == 100_000 and big[0] == pytest.approx(2 * big[1] + 25, abs=1)  # equal finish
    with pytest.raises(ValueError):
        min_max_split(PAIR, 3, minimum=2)


def test_summarise_is_a_median_with_a_floor_on_its_error() -> None:
    p = summarise(24, [1.0, 1.0, 9.0, 1.0, 1.0])  # one stalled step
    assert (p.share, p.seconds) == (24, 1.0) and p.se == pytest.approx(0.005)  # floor: 0.5%
    spread = summarise(24, [0.9, 1.0, 1.1, 1.0, 1.2])
    assert spread.seconds == 1.0 and spread.se > 0.03


def test_fit_line_recovers_an_affine_host() -> None:
    pts = [Point(s, 0.5 + 0.02 * s, 0.005) for s in (16, 24, 40)]
    a, c, se_a, chi2 = fit_line(pts)
    assert a == pytest.approx(0.5) and c == pytest.approx(0.02) and chi2 == pytest.approx(0, abs=1e-9)
    assert 0 < se_a < 0.05
    assert fit_line([Point(24, 1.0, 0.01), Point(24, 1.1, 0.01)]) is None  # one share: no slope


def test_fixed_range_prior_fit_cap_and_change() -> None:
    one = [Point(24, 1.0, 0.01)]
    assert fixed_range(one) == (0.0, 0.0)  # prior: time proportional to share
    assert fixed_range(one, prior_fixed=0.2) == pytest.approx((0.2, 0.2))
    two = [Point(24, 1.0, 0.005), Point(32, 1.16, 0.005)]  # fixed 0.52, per sample 0.02
    lo, hi = fixed_range(two)
    assert lo < 0.52 < hi and hi - lo < 0.1
    flat = [Point(24, 1.0, 0.005), Point(32, 1.01, 0.005)]  # "all fixed": capped
    assert fixed_range(flat, max_fixed=0.5)[1] == pytest.approx(0.505)
    # The host got 50% slower between the splits: no line with a fixed cost >= 0 fits,
    # so the old point is dropped and the prior stands.
    assert fixed_range([Point(24, 1.0, 0.005), Point(32, 2.0, 0.005)]) == (0.0, 0.0)
    # A stale point from before the change is dropped, the two since then are used.
    stale = [Point(40, 0.5, 0.005), Point(24, 1.0, 0.005), Point(32, 1.16, 0.005)]
    assert fixed_range(stale) == pytest.approx(lo_hi := fixed_range(two)) and lo_hi[0] > 0.4


# ------------------------------------------------------------------ convergence


def _tolerance(start: list[int]) -> float:
    """How close to the optimum a start allows. Where a rank starts with a handful of
    samples, one sample is a large part of its time and its fixed cost cannot be told
    from its per-sample cost until it has run another share; if the prior's proposal
    rounds back to the start, nothing is tried, and the split stays one granule off."""
    return 1 + (H if min(start) >= 6 else 2 * H)


def test_converges_to_the_optimum_from_any_start() -> None:
    optimum = worst(PAIR, min_max_split(PAIR, 48))
    for start in range(1, 48):
        bal = LoadBalancer(48, 2, initial_shares=[start, 48 - start], warmup=1)
        moves = drive(bal, PAIR, 80)
        assert len(moves) <= 3, (start, moves)
        assert all(step <= 15 for step, _ in moves), (start, moves)  # then it holds
        assert worst(PAIR, bal.shares) <= _tolerance([start, 48 - start]) * optimum, (start, moves)


def test_three_hosts_converge_from_any_start() -> None:
    optimum = worst(TRIO, min_max_split(TRIO, 72))
    for a, b in itertools.product(range(4, 64, 6), repeat=2):
        if a + b > 70:
            continue
        start = [a, b, 72 - a - b]
        bal = LoadBalancer(72, 3, initial_shares=start, warmup=1)
        moves = drive(bal, TRIO, 80)
        assert len(moves) <= 3, (start, moves)
        assert worst(TRIO, bal.shares) <= _tolerance(start) * optimum, (start, moves)


def test_the_model_jumps_where_the_proportional_rule_creeps() -> None:
    """From the equal split, the rate-proportional rule (no fixed cost believed: max_fixed=0)
    needs re-split after re-split, each further toward the fast host; the model needs two."""
    creeping = LoadBalancer(48, 2, initial_shares=[24, 24], warmup=1, max_fixed=0.0, free_moves=100)
    crept = drive(creeping, PAIR, 80)
    assert len(crept) >= 4 and [m[1][0] for m in crept] == sorted(m[1][0] for m in crept), crept
    bal = LoadBalancer(48, 2, initial_shares=[24, 24], warmup=1)
    moves = drive(bal, PAIR, 80)
    assert len(moves) <= 2, moves
    assert worst(PAIR, bal.shares) <= (1 + H) * worst(PAIR, min_max_split(PAIR, 48))


def test_at_the_loops_interval_two_moves_at_most() -> None:
    """As the trainer runs it (control.balance_interval 5): moves at steps 5 and 10, then none."""
    bal = LoadBalancer(48, 2, initial_shares=[24, 24], interval=5)
    moves = drive(bal, PAIR, 60, noise=0.02, seed=4)
    assert [step for step, _ in moves] in ([5], [5, 10]), moves


# ------------------------------------------------------------------ noise


def _alternating(bal: LoadBalancer, truth: list[StepModel], steps: int, block: int,
                 factor: float) -> list[list[int]]:
    """Rank 1 reads `factor` slower, then `factor` faster, in blocks of `block` steps."""
    splits = [bal.shares]
    for step in range(1, steps + 1):
        f = factor if (step // block) % 2 == 0 else 1 / factor
        secs = [truth[0].time(bal.shares[0]), truth[1].time(bal.shares[1]) * f]
        if bal.observe(step, bal.shares, secs) is not None:
            splits.append(bal.shares)
    return splits


@pytest.mark.parametrize("block", [3, 5, 8, 13])
@pytest.mark.parametrize("factor", [1.08, 1.15, 1.3])
def test_never_oscillates_under_alternating_noise(block: int, factor: float) -> None:
    start = min_max_split(PAIR, 48)
    bal = LoadBalancer(48, 2, initial_shares=start, warmup=1)
    splits = _alternating(bal, PAIR, steps=400, block=block, factor=factor)
    back_and_forth = [i for i in range(2, len(splits)) if splits[i] == splits[i - 2]]
    assert not back_and_forth, splits
    assert len(splits) <= 4, splits


@pytest.mark.parametrize("seed", range(8))
def test_random_noise_moves_are_bounded(seed: int) -> None:
    optimum = worst(PAIR, min_max_split(PAIR, 48))
    bal = LoadBalancer(48, 2, initial_shares=[24, 24], warmup=1)
    moves = drive(bal, PAIR, 300, noise=0.05, seed=seed)
    assert len(moves) <= 4, moves
    assert worst(PAIR, bal.shares) <= (1 + 2 * H) * optimum, moves


def test_a_real_change_is_followed_and_old_readings_forgotten() -> None:
    """The fast host gets 3x slower (another job starts on it) after the split settled."""
    bal = LoadBalancer(48, 2, initial_shares=[24, 24], warmup=1)
    drive(bal, PAIR, 40)
    assert bal.shares[0] > 35
    after = [StepModel(1.5, 0.06), PAIR[1]]
    moves = drive(bal, after, 40, first=41)
    assert moves and len(moves) <= 3, moves
    assert worst(after, bal.shares) <= (1 + H) * worst(after, min_max_split(after, 48)), moves


def test_state_roundtrip_keeps_the_history() -> None:
    """A resumed balancer decides exactly as the one that never stopped: the fit's points
    and the escalation travel in the checkpoint (as JSON)."""
    a = LoadBalancer(48, 2, warmup=1)
    drive(a, PAIR, 19, noise=0.03, seed=1)
    assert a.changes >= 1 and all(a.state_dict()["history"])
    c = LoadBalancer(48, 2, warmup=1)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    rng = random.Random(2)
    for step in range(20, 80):
        jitter = [1 + rng.uniform(-0.05, 0.05) for _ in PAIR]
        secs = [m.time(s) * j for m, s, j in zip(PAIR, a.shares, jitter, strict=True)]
        assert a.observe(step, a.shares, secs) == c.observe(step, c.shares, secs)
    assert a.state_dict() == c.state_dict()


def test_older_checkpoints_load() -> None:
    """The rate-median balancer saved samples/s readings; they become times at that split."""
    bal = LoadBalancer(48, 2)
    bal.load_state_dict({"shares": [32, 16], "readings": [[64.0, 64.0], [20.0]], "left": [24, 24],
                         "settle": 0, "changes": 1})
    assert bal.rates == pytest.approx([64.0, 20.0]) and bal.changes == 1
    assert bal.state_dict()["times"] == [[0.5, 0.5], [0.8]]
