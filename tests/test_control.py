"""Unit tests for the pure-Python control policies (mlxdist.control)."""

from __future__ import annotations

import json
import math
import random

import pytest

from mlxdist.control import (
    AccumulationController,
    AccumulationError,
    BatchSizeController,
    BatchSizeError,
    Decision,
    EarlyStopping,
    HealthMonitor,
    LoadBalancer,
    LRSchedule,
    ReduceOnPlateau,
    accumulation_steps,
    lr_at,
    micro_batches,
    proportional_split,
)


def roundtrip(state: dict) -> dict:
    """Checkpoints go through JSON; anything that survives this is safe to save."""
    return json.loads(json.dumps(state, allow_nan=False))


# ---------------------------------------------------------------- schedule

SCHED = dict(base_lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)


def test_schedule_warmup_starts_above_zero_and_reaches_base():
    assert lr_at(0, **SCHED) == pytest.approx(0.1)
    assert lr_at(4, **SCHED) == pytest.approx(0.5)
    assert lr_at(9, **SCHED) == pytest.approx(1.0)
    assert lr_at(10, **SCHED) == pytest.approx(1.0)


def test_schedule_cosine_middle_end_and_flat_after():
    assert lr_at(60, **SCHED) == pytest.approx(0.55)  # halfway between base and min
    assert lr_at(110, **SCHED) == pytest.approx(0.1)
    assert lr_at(10_000, **SCHED) == pytest.approx(0.1)
    values = [lr_at(s, **SCHED) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_schedule_linear_and_constant():
    assert lr_at(60, **SCHED, kind="linear") == pytest.approx(0.55)
    assert lr_at(35, **SCHED, kind="linear") == pytest.approx(1.0 - 0.9 * 0.25)
    assert lr_at(110, **SCHED, kind="linear") == pytest.approx(0.1)
    assert lr_at(0, **SCHED, kind="constant") == pytest.approx(0.1)
    assert lr_at(500, **SCHED, kind="constant") == pytest.approx(1.0)


def test_schedule_scale_and_no_warmup():
    assert lr_at(60, **SCHED, scale=0.5) == pytest.approx(0.275)
    assert lr_at(0, base_lr=2.0, warmup_steps=0, total_steps=100) == pytest.approx(2.0)
    sched = LRSchedule(**SCHED)
    assert sched(60, scale=0.5) == lr_at(60, **SCHED, scale=0.5)


@pytest.mark.parametrize("kwargs", [{"kind": "step"}, {"scale": 0.0}, {"warmup_steps": -1}])
def test_schedule_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        lr_at(0, **{**SCHED, **kwargs})


# ---------------------------------------------------------------- batch size


def feed(ctrl: BatchSizeController, fraction: float, n: int) -> list[Decision | None]:
    return [ctrl.observe(int(fraction * 1000), 1000) for _ in range(n)]


def test_batch_waits_for_full_window_then_shrinks():
    ctrl = BatchSizeController(100, 1, 200)
    out = feed(ctrl, 0.95, 5)
    assert out[:4] == [None] * 4
    assert out[4] == Decision(100, 80, "memory 0.95 > target 0.85")
    assert ctrl.batch == 80 and ctrl.shrinks == 1


def test_batch_grows_with_headroom_and_respects_max():
    ctrl = BatchSizeController(100, 1, 130, cooldown=0)
    assert feed(ctrl, 0.5, 5)[-1].new == 120
    assert feed(ctrl, 0.5, 5)[-1].new == 130  # capped at max_batch
    assert feed(ctrl, 0.5, 20) == [None] * 20
    assert ctrl.grows == 2


def test_batch_small_sizes_always_move():
    ctrl = BatchSizeController(2, 1, 10, cooldown=0)
    assert feed(ctrl, 0.1, 5)[-1].new == 3  # floor(2 * 1.2) == 2, so +1
    ctrl = BatchSizeController(3, 1, 10, cooldown=0)
    assert feed(ctrl, 0.99, 5)[-1].new == 2


def test_batch_no_change_inside_band_or_at_min():
    ctrl = BatchSizeController(100, 1, 200)
    assert feed(ctrl, 0.75, 50) == [None] * 50  # 0.68 <= 0.75 <= 0.85
    ctrl = BatchSizeController(4, 4, 8)
    assert feed(ctrl, 0.99, 50) == [None] * 50


def test_batch_window_cleared_and_cooldown_after_change():
    ctrl = BatchSizeController(100, 1, 200, cooldown=1)
    feed(ctrl, 0.95, 5)
    assert ctrl.average is None
    # 1 reading dropped + 4 readings: window not yet full.
    assert feed(ctrl, 0.95, 5) == [None] * 5
    assert ctrl.observe(950, 1000).new == 64


def test_batch_oom_shrinks_at_once_and_caps_growth():
    ctrl = BatchSizeController(100, 50, 200, cooldown=0)
    d = ctrl.on_oom()
    assert (d.old, d.new, ctrl.ooms) == (100, 80, 1)
    feed(ctrl, 0.1, 5)
    assert ctrl.batch == 96
    assert feed(ctrl, 0.1, 5)[-1].new == 99  # never back to the size that crashed
    assert feed(ctrl, 0.1, 20) == [None] * 20
    ctrl.on_oom()
    ctrl.on_oom()
    assert ctrl.batch == 63
    ctrl.on_oom()
    assert ctrl.batch == 50
    with pytest.raises(BatchSizeError, match="minimum batch size 50"):
        ctrl.on_oom()


def test_batch_set_target():
    ctrl = BatchSizeController(100, 1, 200)
    feed(ctrl, 0.8, 4)
    ctrl.set_target(0.7)
    assert ctrl.observe(800, 1000).reason == "memory 0.80 > target 0.70"
    with pytest.raises(ValueError):
        ctrl.set_target(1.5)


def test_batch_state_roundtrip_gives_identical_decisions():
    rng = random.Random(1)
    readings = [rng.uniform(0.4, 1.0) for _ in range(60)]
    a = BatchSizeController(64, 8, 256)
    for r in readings[:23]:
        a.observe(int(r * 1e9), 10**9)
    a.on_oom()
    b = BatchSizeController(64, 8, 256)
    b.load_state_dict(roundtrip(a.state_dict()))
    for r in readings[23:]:
        assert a.observe(int(r * 1e9), 10**9) == b.observe(int(r * 1e9), 10**9)
    assert a.state_dict() == b.state_dict()


# ---------------------------------------------------------------- split


def test_proportional_split_examples():
    assert proportional_split(96, [2.0, 1.0]) == [64, 32]
    assert proportional_split(100, [1, 2, 3, 4]) == [10, 20, 30, 40]
    assert proportional_split(10, [1, 1, 1]) == [4, 3, 3]  # tie goes to lowest rank
    assert proportional_split(0, [1, 1]) == [0, 0]


def test_proportional_split_minimum_per_rank():
    assert proportional_split(10, [1000, 1, 0]) == [8, 1, 1]
    assert proportional_split(10, [1, 0, 0], minimum=3) == [4, 3, 3]
    assert proportional_split(2, [1, 1, 1]) == [1, 1, 0]  # too few to give everyone one


def test_proportional_split_property_sums_and_bounds():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 8)
        weights = [rng.uniform(0, 10) for _ in range(n)]
        total = rng.randint(n, 1000)
        shares = proportional_split(total, weights)
        assert sum(shares) == total
        assert min(shares) >= 1
        assert shares == proportional_split(total, list(weights))
        wsum = sum(weights)
        for s, w in zip(shares, weights, strict=True):
            assert abs(s - total * w / wsum) < 2 or s == 1


def test_proportional_split_rejects_bad_weights():
    for weights in ([], [0, 0], [1, -1], [1, math.nan]):
        with pytest.raises(ValueError):
            proportional_split(10, weights)


def test_accumulation_and_micro_batches():
    assert accumulation_steps([10, 8, 0], [4, 8, 2]) == [3, 1, 0]
    assert micro_batches(10, 4) == [4, 3, 3]
    assert micro_batches(8, 4) == [4, 4]
    assert micro_batches(3, 8) == [3]
    assert micro_batches(0, 4) == []
    for share in range(0, 60):
        for micro in range(1, 12):
            sizes = micro_batches(share, micro)
            assert sum(sizes) == share
            assert len(sizes) == accumulation_steps([share], [micro])[0]
            assert all(s <= micro for s in sizes)
            assert not sizes or max(sizes) - min(sizes) <= 1


def test_accumulation_controller():
    ctrl = AccumulationController(global_batch=96, max_accum=4)
    assert ctrl.plan([64, 32], [16, 8]) == [4, 4]
    with pytest.raises(AccumulationError, match="rank 1.*unreachable"):
        ctrl.plan([64, 32], [16, 7])
    with pytest.raises(ValueError, match="expected global batch 96"):
        ctrl.plan([64, 31], [16, 8])
    ctrl.load_state_dict(roundtrip(ctrl.state_dict()))


# ---------------------------------------------------------------- balancer


def simulate(bal: LoadBalancer, rates: list[float], steps: int, noise: float, seed: int = 0):
    """Each rank's compute time is share / rate, jittered by +-noise."""
    rng = random.Random(seed)
    history = []
    for step in range(steps):
        shares = bal.shares
        secs = [
            s / r * (1 + rng.uniform(-noise, noise)) for s, r in zip(shares, rates, strict=True)
        ]
        history.append(bal.observe(step, shares, secs))
    return history


def test_balancer_converges_to_speed_ratio():
    bal = LoadBalancer(96, 2)
    assert bal.shares == [48, 48]
    simulate(bal, [200.0, 100.0], steps=10, noise=0.03)
    fast, slow = bal.shares
    assert sum(bal.shares) == 96
    assert fast / slow == pytest.approx(2.0, rel=0.05)
    assert bal.predicted_step_time(bal.shares) < bal.predicted_step_time([48, 48])


def test_balancer_hysteresis_no_flip_flop_under_noise():
    bal = LoadBalancer(96, 2, hysteresis=0.05)
    history = simulate(bal, [100.0, 100.0], steps=300, noise=0.04)
    assert history == [None] * 300
    assert bal.shares == [48, 48] and bal.changes == 0


def test_balancer_settles_after_converging():
    bal = LoadBalancer(120, 3, initial_shares=[40, 40, 40])
    history = simulate(bal, [300.0, 200.0, 100.0], steps=200, noise=0.03)
    assert bal.changes <= 3
    assert all(h is None for h in history[50:])
    assert bal.shares == pytest.approx([60, 40, 20], abs=2)


def test_balancer_warmup_interval_and_min_share():
    bal = LoadBalancer(96, 2, warmup=2, interval=3, min_observations=1)
    assert bal.observe(0, [48, 48], [0.1, 0.9]) is None  # warmup: compile time
    assert bal.observe(1, [48, 48], [0.1, 0.9]) is None
    assert bal.rates == [None, None]
    assert bal.observe(2, [48, 48], [0.1, 0.9]) is None  # step 2 not on the interval
    assert bal.observe(3, [48, 48], [0.1, 0.9]) is not None
    lopsided = LoadBalancer(96, 2, warmup=0, min_share=8, min_observations=1)
    assert lopsided.observe(0, [48, 48], [0.001, 100.0]) == [88, 8]


def test_balancer_waits_for_enough_readings():
    bal = LoadBalancer(96, 2, warmup=0, window=5, min_observations=3)
    assert bal.observe(1, [48, 48], [0.1, 0.2]) is None
    assert bal.observe(2, [48, 48], [0.1, 0.2]) is None
    assert bal.observe(3, [48, 48], [0.1, 0.2]) == [64, 32]


def test_balancer_median_ignores_spikes():
    """Every 4th step one rank stalls 5x (a neighbour's burst, a GC): with equal true
    speeds the split must not move; the old EMA moved it at the first spike."""
    bal = LoadBalancer(96, 2, warmup=0, hysteresis=0.05)
    rng = random.Random(3)
    for step in range(1, 200):
        spike = 5.0 if step % 4 == 0 else 1.0
        secs = [0.48 * (1 + rng.uniform(-0.03, 0.03)), 0.48 * spike * (1 + rng.uniform(-0.03, 0.03))]
        assert bal.observe(step, bal.shares, secs) is None, step
    assert bal.rates[1] == pytest.approx(100.0, rel=0.05)


def _alternating(bal: LoadBalancer, steps: int, block: int, factor: float) -> list[list[int]]:
    """Equal true speeds; rank 1 reads `factor` slower, then `factor` faster, in blocks."""
    splits = [bal.shares]
    for step in range(1, steps + 1):
        f = factor if (step // block) % 2 == 0 else 1 / factor
        secs = [bal.shares[0] / 100.0, bal.shares[1] / 100.0 * f]
        if bal.observe(step, bal.shares, secs) is not None:
            splits.append(bal.shares)
    return splits


def test_balancer_never_flips_back_under_alternating_noise():
    bal = LoadBalancer(96, 2, warmup=1, hysteresis=0.05)
    splits = _alternating(bal, steps=300, block=8, factor=1.12)
    assert len(splits) <= 2, splits  # at most one move, then it holds
    # Same input without the return margin (and without the escalating threshold, the other
    # guard): it ping-pongs, so the guards are what hold it.
    naive = LoadBalancer(96, 2, warmup=1, hysteresis=0.05, return_margin=1.0, free_moves=1000)
    flips = _alternating(naive, steps=300, block=8, factor=1.12)
    assert len(flips) > 10 and len({tuple(f) for f in flips[3:]}) == 2, flips


def test_balancer_follows_a_real_change_after_settling():
    """A host that really becomes 3x slower is followed, even back toward an old split."""
    bal = LoadBalancer(96, 2, warmup=1)
    simulate(bal, [200.0, 100.0], steps=30, noise=0.03)
    assert bal.shares == pytest.approx([64, 32], abs=1)
    simulate(bal, [100.0, 300.0], steps=30, noise=0.03, seed=1)
    assert bal.shares == pytest.approx([24, 72], abs=1)


def test_balancer_loads_old_ema_checkpoints():
    old = {"shares": [60, 36], "rates": [120.0, 70.0], "settle": 0, "changes": 2}
    bal = LoadBalancer(96, 2)
    bal.load_state_dict(roundtrip(old))
    assert bal.shares == [60, 36] and bal.rates == [120.0, 70.0] and bal.changes == 2
    bare = LoadBalancer(96, 2, warmup=2)
    bare.load_state_dict({"shares": [50, 46]})
    assert bare.shares == [50, 46] and bare.rates == [None, None] and bare.changes == 0
    assert bare.state_dict()["settle"] == 2
    with pytest.raises(ValueError, match="summing to 96"):
        bare.load_state_dict({"shares": [50, 40]})


def test_balancer_ignores_bad_timings():
    bal = LoadBalancer(96, 2, warmup=0)
    assert bal.observe(0, [48, 48], [0.5, 0.0]) is None  # rank 1 has no rate yet
    assert bal.rates[1] is None
    assert bal.observe(1, [48, 48], [0.5, math.inf]) is None


def test_balancer_deterministic_and_state_roundtrip():
    rng = random.Random(7)
    steps = [[rng.uniform(0.1, 1.0) for _ in range(3)] for _ in range(40)]
    a, b = LoadBalancer(90, 3), LoadBalancer(90, 3)
    outputs_a, outputs_b = [], []
    for step, secs in enumerate(steps[:15]):
        outputs_a.append(a.observe(step, a.shares, secs))
        outputs_b.append(b.observe(step, b.shares, secs))
    assert outputs_a == outputs_b
    c = LoadBalancer(90, 3)
    c.load_state_dict(roundtrip(a.state_dict()))
    for step, secs in enumerate(steps[15:], start=15):
        assert a.observe(step, a.shares, secs) == c.observe(step, c.shares, secs)
    assert a.state_dict() == c.state_dict()


def test_balancer_rejects_bad_config():
    with pytest.raises(ValueError):
        LoadBalancer(3, 4)
    with pytest.raises(ValueError):
        LoadBalancer(96, 2, initial_shares=[50, 40])
    with pytest.raises(ValueError):
        LoadBalancer(96, 2).observe(0, [48], [0.1])
    with pytest.raises(ValueError, match="min_observations"):
        LoadBalancer(96, 2, window=3, min_observations=4)


# ---------------------------------------------------------------- health


def test_health_skip_then_rollback_after_consecutive_nonfinite():
    mon = HealthMonitor(max_bad_steps=3)
    assert not mon.observe(0, 2.0, 1.0).skip_update
    v = mon.observe(1, math.nan, 1.0)
    assert v.skip_update and not v.rollback
    assert mon.observe(2, 2.0, 1.0).skip_update is False  # streak broken
    mon.observe(3, 2.0, math.inf)
    mon.observe(4, math.inf, 1.0)
    v = mon.observe(5, math.nan, math.nan)
    assert v.skip_update and v.rollback
    assert (v.nonfinite_total, v.rollbacks_total) == (4, 1)
    assert not mon.observe(6, math.nan, 1.0).rollback  # streak restarts after a rollback


def test_health_trend_and_variance():
    mon = HealthMonitor(window=10)
    assert mon.loss_trend() == 0.0 and mon.loss_variance() == 0.0
    for i in range(10):
        mon.observe(i, 5.0 - 0.5 * i, 1.0)
    assert mon.loss_trend() == pytest.approx(-0.5)
    assert mon.loss_variance() == pytest.approx(0.25 * 99 / 12)  # var of 0..9 scaled by 0.5^2
    mon.observe(10, math.nan, 1.0)  # non-finite never enters the window
    assert mon.loss_trend() == pytest.approx(-0.5)


def test_health_rising_trend_warns_once():
    mon = HealthMonitor(window=10, trend_warn=0.05)
    warnings = [mon.observe(i, 2.0 + 0.1 * i, 1.0).warnings for i in range(30)]
    flat = [w for w in warnings if w]
    assert len(flat) == 1 and "loss rising" in flat[0][0]
    assert warnings[9]  # fires as soon as the window is full


def test_health_variance_warning_edge_triggered():
    mon = HealthMonitor(window=4, variance_warn=1.0, trend_warn=None)
    losses = [1, 1, 1, 1, 5, 1, 5, 1, 1, 1, 1, 1, 5, 1]
    fired = [i for i, x in enumerate(losses) if mon.observe(i, float(x), 1.0).warnings]
    assert fired == [4, 12]  # re-arms only after the noisy stretch left the window


def test_health_state_roundtrip():
    rng = random.Random(3)
    seq = [rng.choice([math.nan, 1.0, 2.0, 3.0]) for _ in range(80)]
    a = HealthMonitor(window=8, variance_warn=0.5, max_bad_steps=2)
    for i, x in enumerate(seq[:30]):
        a.observe(i, x, 1.0)
    b = HealthMonitor(window=8, variance_warn=0.5, max_bad_steps=2)
    b.load_state_dict(roundtrip(a.state_dict()))
    for i, x in enumerate(seq[30:], start=30):
        assert a.observe(i, x, 1.0) == b.observe(i, x, 1.0)


def test_reduce_on_plateau():
    rop = ReduceOnPlateau(patience=2, factor=0.5, min_delta=0.01, min_scale=0.2)
    assert [rop.observe(x) for x in [3.0, 2.0, 1.995, 2.5]] == [1.0, 1.0, 1.0, 0.5]
    seq = [2.0, math.nan, 3.0, 3.0, 3.0, 3.0]
    assert [rop.observe(x) for x in seq] == [0.5, 0.25, 0.25, 0.2, 0.2, 0.2]  # floor at min_scale
    fresh = ReduceOnPlateau(patience=2)
    fresh.load_state_dict(roundtrip(rop.state_dict()))
    assert fresh.observe(0.5) == rop.observe(0.5) == 0.2


# ---------------------------------------------------------------- early stopping


def test_early_stopping_patience_and_min_delta():
    es = EarlyStopping(patience=2, min_delta=0.1)
    assert [es.observe(x) for x in [1.0, 0.95, 0.8, 0.85]] == [False, False, False, False]
    assert es.best == 0.8 and es.bad_evals == 1
    assert es.observe(0.75) is True
    assert es.observe(0.1) is True  # stays stopped


def test_early_stopping_max_mode_nan_and_disabled():
    es = EarlyStopping(patience=1, mode="max")
    assert es.observe(0.5) is False
    assert es.observe(0.6) is False
    assert es.observe(math.nan) is True
    off = EarlyStopping(patience=0)
    assert not any(off.observe(x) for x in [1.0] + [2.0] * 100)
    assert off.best == 1.0 and off.bad_evals == 100


def test_early_stopping_state_roundtrip():
    a = EarlyStopping(patience=3)
    for x in [1.0, 0.9, 0.95]:
        a.observe(x)
    b = EarlyStopping(patience=3)
    b.load_state_dict(roundtrip(a.state_dict()))
    for x in [0.96, 0.97, 0.5]:
        assert a.observe(x) == b.observe(x)
    with pytest.raises(ValueError):
        EarlyStopping(patience=1, mode="median")
