"""`replan` is pure: hand-made all-gathered lists in, a plan and decisions out."""

from mlxdist.control import AccumulationController, LoadBalancer, StepPlan, replan


def _gathered(micro, samples, compute_s):
    return [{"micro": m, "samples": s, "compute_s": c} for m, s, c in zip(micro, samples, compute_s, strict=True)]


def test_nothing_changes_without_news():
    plan = StepPlan(16, [8, 8], [8, 8])
    new, decisions = replan(plan, _gathered([8, 8], [8, 8], [1.0, 1.0]), 3, None, AccumulationController(16, 64))
    assert (new.shares, new.micro, decisions) == ([8, 8], [8, 8], [])


def test_a_rank_shrinking_its_micro_batch_is_reported_and_keeps_the_global_batch():
    plan = StepPlan(16, [8, 8], [8, 8])
    accum = AccumulationController(16, 64)
    new, decisions = replan(plan, _gathered([8, 3], [8, 8], [1.0, 1.0]), 5, None, accum)
    assert new.micro == [8, 3] and new.shares == [8, 8] and sum(new.shares) == new.global_batch
    assert [d.kind for d in decisions] == ["batch_size", "accumulation"]
    assert decisions[0].text == "batch: step 5: micro-batches [8, 8] -> [8, 3]"
    assert decisions[1].fields["accum"] == [1, 3]
    assert plan.micro == [8, 8], "the old plan is not modified"


def test_balancer_moves_work_to_the_faster_rank():
    plan = StepPlan(32, [16, 16], [32, 32])
    balancer = LoadBalancer(32, 2, hysteresis=0.05, interval=1, initial_shares=[16, 16])
    accum = AccumulationController(32, 64)
    new, decisions = plan, []
    for step in range(1, 8):  # rank 0 is twice as fast: 16 samples in 1 s against 2 s
        gathered = _gathered(new.micro, new.shares, [new.shares[0] / 16, new.shares[1] / 8])
        new, decisions = replan(new, gathered, step, balancer, accum)
        if decisions:
            break
    assert [d.kind for d in decisions] == ["balance", "accumulation"]
    assert new.shares[0] > new.shares[1] and sum(new.shares) == 32
    assert decisions[0].fields["old"] == [16, 16] and decisions[0].fields["new"] == new.shares
