"""ZeRO-3 (`dist.shard=weights`, MLX and torch engines): the weights leave every rank but one shard, so
the step must compute from weights gathered a stage at a time, in exchanges that every rank
joins whatever its micro-batches. If that bookkeeping slips (a stage gathered out of order, a
rank's gradients added twice, a round a short rank skips), training still runs and the loss
still falls; only a comparison with one process, data parallel's checkpoint format and the
memory each rank reports show it. So these runs check the numbers against one process, the
checkpoints both ways across ZeRO-3 and unsharded runs, and that the memory saving is real."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FAST, assert_same_weights, final_weights, run_train
from test_sharded import SPLIT, UNEQUAL, _checkpoint, _events, _max_diff, _ok, _train

from mlxdist.config import load_config
from mlxdist.control.memory_plan import lm_facts, plan
from mlxdist.sync.strategy import memory_lines

# The built-in tiny LM (771,456 parameters, 6 stages: embedding, 4 blocks, head), clipped
# (grad_norm ~6 against 0.5). lr 3e-4: AdamW turns a near-zero gradient's rounding into an
# update of up to lr, so one element of 771k follows the summation order; at lr 1e-3 splitting
# 8 samples into micro-batches 1 | 5+2 moved one element of layers.3.ffn.w2 by 1.5e-5 from one
# process, data parallel as much as ZeRO-3 (which was within 3e-7 of data parallel). At 3e-4
# every run here stays within ~1e-6 of one process: 10x under the 1e-5 asserted.
LM = [*FAST, "train.steps=4", "train.grad_clip=0.5", "dist.sync_weights_every=0", "train.lr=3e-4"]
ZERO3 = "dist.shard=weights"
# rank 0 one micro-batch of 1, rank 1 micro-batches 5+2 (shares [1, 7]): rank 0 joins the
# second round's exchanges with zero gradients
UNEVEN = ["nodes={rank0: {batch_size: 1}, rank1: {batch_size: 5}}", "train.global_batch=8"]
# the user's MLX model with stages() (3 stages, 467 parameters); the whole eval set (so one
# process and two ranks evaluate the same samples), evaluated under whole_model every 2 steps
STAGED = ["task.factory=user_tasks:mlx_staged_mlp", "train.eval_every=2", "train.eval_batches=0"]


def _step_memory(run_dir: Path, rank: int, key: str) -> int:
    return max(e[key] for e in _events(run_dir, "step", rank))


# ---------------------------------------------------------------- the built-in LM
@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """One process (8 a step), data parallel 3+5, ZeRO-3 3+5 and ZeRO-3 1 | 5+2: run dir and
    stderr of each."""
    root, runs = tmp_path_factory.mktemp("zero3_lm"), {}
    for name, args, np_ in (("one", ["train.batch_size=8"], 0), ("dp", [SPLIT], 2), ("zero3", [SPLIT, ZERO3], 2),
                            ("uneven", [*UNEVEN, ZERO3], 2)):
        r = _ok(run_train([*LM, *args, f"train.out_dir={root / name}"], np_=np_))
        runs[name] = (root / name, r.stderr)
    return runs


@pytest.mark.cluster
def test_lm_zero3_equals_one_process_with_equal_or_unequal_micro_batches(lm):
    """3+5 in one micro-batch each, and 1 | 5+2 (two rounds of exchanges, rank 0 computing in
    one): both end where one process with 8 a step does."""
    one = final_weights(lm["one"][0])
    for name in ("zero3", "uneven"):
        run_dir, stderr = lm[name]
        banner = [line for line in stderr.splitlines() if "ZeRO-3 (dist.shard=weights)" in line and "stages" in line]
        assert banner and "6 stages, gathered one at a time" in banner[0], stderr[-3000:]
        assert_same_weights(one, final_weights(run_dir), atol=1e-5)
    # rank 0's one micro-batch took part in both rounds: twice the bytes of one round, on both ranks
    first = [_events(lm[name][0], "step", rank)[0] for name in ("zero3", "uneven") for rank in (0, 1)]
    one_round = first[0]["sync_bytes"]
    assert [(e["accum"], e["sync_bytes"]) for e in first] == [(1, one_round), (1, one_round),
                                                              (1, 2 * one_round), (2, 2 * one_round)]


@pytest.mark.cluster
def test_lm_zero3_holds_a_shard_between_steps_and_peaks_below_data_parallel(lm):
    """Between steps (memory_active_bytes) one process holds 16 N bytes: fp32 weights, m, v and
    the copy the model last ran with (N = 771,456: 12.3 MB). A ZeRO-3 rank holds its shard
    of weights, m, v and the decay mask, 13 N f (f = 1/2: 5.0 MB, 0.41x). 0.55x fails a rank
    that keeps one whole fp32 copy of the weights besides (4 N more: 0.66x). At the peak data
    parallel holds the whole gradients twice and AdamW's new p, m, v beside the old (27.8 MB);
    a ZeRO-3 rank the same for its shard only, 29 N f (11.2 MB, 0.40x): asserted under 0.6x."""
    one_active = _step_memory(lm["one"][0], 0, "memory_active_bytes")
    dp_peak = min(_step_memory(lm["dp"][0], rank, "memory_peak_bytes") for rank in (0, 1))
    for name in ("zero3", "uneven"):
        for rank in (0, 1):
            active = _step_memory(lm[name][0], rank, "memory_active_bytes")
            peak = _step_memory(lm[name][0], rank, "memory_peak_bytes")
            assert active <= 0.55 * one_active, f"{name} rank {rank}: {active} B active vs one process {one_active}"
            assert peak <= 0.6 * dp_peak, f"{name} rank {rank}: peak {peak} B vs data parallel {dp_peak}"


# ---------------------------------------------------------------- a user's staged model
@pytest.fixture(scope="module")
def staged_one(tmp_path_factory) -> Path:
    """The staged model on one rank, 8 a step, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("zero3_staged") / "one"
    _ok(_train([*STAGED, "train.batch_size=8", "checkpoint.every=2", f"train.out_dir={out}"]))
    return out


@pytest.fixture(scope="module")
def staged_zero3(tmp_path_factory) -> Path:
    """The staged model, ZeRO-3 on two ranks (3+5), checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("zero3_staged") / "zero3"
    r = _ok(_train([*STAGED, SPLIT, ZERO3, "checkpoint.every=2", f"train.out_dir={out}"], np_=2))
    assert "3 stages, gathered one at a time" in r.stderr, r.stderr[-3000:]
    return out


@pytest.mark.cluster
def test_staged_model_zero3_trains_evaluates_and_saves_as_one_process(staged_one, staged_zero3):
    """AdamW with weight decay and clipping: weights, every rank's evaluation (the whole model
    gathered for it) and the step-2 checkpoint's moments equal one process's."""
    assert_same_weights(final_weights(staged_one), final_weights(staged_zero3), atol=1e-5)
    expected = [(e["step"], e["eval_loss"]) for e in _events(staged_one, "eval")]
    assert [s for s, _ in expected] == [2, 4]
    for rank in (0, 1):
        got = [(e["step"], e["eval_loss"]) for e in _events(staged_zero3, "eval", rank)]
        assert [s for s, _ in got] == [2, 4]
        assert max(abs(a - b) for (_, a), (_, b) in zip(expected, got, strict=True)) <= 1e-5, (expected, got)
    saved, one = _checkpoint(staged_zero3, 2), _checkpoint(staged_one, 2)
    assert saved.optimizer.keys() == one.optimizer.keys()  # m.<param>, v.<param>: data parallel's
    assert {k.split(".", 1)[0] for k in saved.optimizer} == {"m", "v"}
    assert _max_diff(saved.optimizer, one.optimizer) <= 1e-6
    assert_same_weights(saved.weights, one.weights, atol=1e-5)


@pytest.mark.cluster
def test_zero3_on_mlx_ring_equals_one_process(tmp_path, staged_one):
    """Under dist.backend=mlx-ring the stages' exchanges run on a channel (mpi4py's ring: MLX has
    no second channel) and the checkpoint's gather on MLX's all_gather: the same numbers."""
    _ok(_train([*STAGED, SPLIT, ZERO3, "dist.backend=mlx-ring", "checkpoint.every=2", f"train.out_dir={tmp_path}"],
               np_=2))
    assert_same_weights(final_weights(staged_one), final_weights(tmp_path), atol=1e-5)
    assert _max_diff(_checkpoint(tmp_path, 2).optimizer, _checkpoint(staged_one, 2).optimizer) <= 1e-6


@pytest.mark.cluster
def test_zero3_and_unsharded_checkpoints_resume_each_other(tmp_path, staged_one, staged_zero3):
    """ZeRO-3's step 2 resumes on one unsharded rank, and one rank's step 2 resumes under ZeRO-3
    with shards by memory budget (0.8 vs 0.2): both end where the uninterrupted run does."""
    uninterrupted = final_weights(staged_one)
    r = _ok(_train([*STAGED, "train.batch_size=8", f"train.out_dir={tmp_path / 'unsharded'}",
                    "--resume", str(staged_zero3 / "checkpoints" / "step_00000002")]))
    assert "resumed from" in r.stderr and "saved by 2 rank(s)" in r.stderr, r.stderr[-3000:]
    assert_same_weights(uninterrupted, final_weights(tmp_path / "unsharded"), atol=1e-5)

    r = _ok(_train([*STAGED, UNEQUAL, ZERO3, f"train.out_dir={tmp_path / 'zero3'}",
                    "--resume", str(staged_one / "checkpoints" / "step_00000002")], np_=2))
    assert "resumed from" in r.stderr and "saved by 1 rank(s)" in r.stderr, r.stderr[-3000:]
    for rank in (0, 1):
        event = _events(tmp_path / "zero3", "shard", rank)[0]
        assert event["mode"] == "weights" and event["elements"] == [374, 93], event  # 467 cut 0.8 : 0.2
    assert_same_weights(uninterrupted, final_weights(tmp_path / "zero3"), atol=1e-5)


# ---------------------------------------------------------------- dist.shard=auto
@pytest.mark.cluster
def test_auto_takes_zero3_when_nothing_less_fits(tmp_path):
    """The tiny LM, micro-batch 4 on 2 ranks: a memory limit midway between what the trainer's
    own planner says ZeRO-2 and ZeRO-3 need (the table `python -m mlxdist.plan` prints)."""
    args = [*FAST, "train.batch_size=4", "train.steps=2", "dist.shard=auto", f"train.out_dir={tmp_path}"]
    cfg = load_config(None, args)
    facts = lm_facts(cfg)

    def need(mode: str, limit: int) -> int:
        p = plan(cfg, [("vm", limit)] * 2, facts.n_params, facts.activation_bytes_per_sample, memory=memory_lines(),
                 gather_params=facts.gather_params, staged_act_per_sample=facts.staged_activation_bytes_per_sample)
        return max(b.total for b in p.needs[mode])

    zero2, zero3 = need("gradients", 2**40), need("weights", 2**40)
    assert zero3 < zero2, (zero3, zero2)
    limit = int((zero2 + zero3) / 2 / cfg.control.memory_target)
    r = run_train(args, np_=2, extra_env={"MLXDIST_MEMORY_LIMIT_BYTES": str(limit)})
    assert r.returncode == 0, r.stderr[-3000:]
    chose = "dist.shard=auto -> weights (ZeRO-3): the least sharding that fits; gradients does not"
    assert chose in r.stderr, r.stderr[-3000:]
    assert "sharded data parallel, ZeRO-3 (dist.shard=weights)" in r.stderr, r.stderr[-3000:]
    steps = _events(tmp_path, "step")
    assert [e["step"] for e in steps] == [1, 2] and steps[1]["loss"] < steps[0]["loss"]
    assert _events(tmp_path, "shard")[0]["mode"] == "weights"
    assert _checkpoint(tmp_path, 2).weights


# ---------------------------------------------------------------- the torch engine
@pytest.mark.cluster
def test_torch_zero3_equals_one_process_evaluates_alike_and_resumes_unsharded(tmp_path):
    """The torch twin of the built-in LM under ZeRO-3, micro-batches 1 | 5+2 (rank 0 joins the
    second round), evaluating stage by stage: it ends where one torch process with 8 a step
    does, evaluates the same losses, and its step-2 checkpoint resumes on one unsharded rank."""
    torch_lm = [*LM, "--engine", "torch", "--device", "cpu", "train.eval_every=2", "train.eval_batches=3",
                "train.batch_size=8", "checkpoint.every=2"]  # the same 3 eval batches of 8 for both runs
    one, zero3, resumed = tmp_path / "one", tmp_path / "zero3", tmp_path / "resumed"
    _ok(run_train([*torch_lm, f"train.out_dir={one}"]))
    r = _ok(run_train([*torch_lm, *UNEVEN, ZERO3, f"train.out_dir={zero3}"], np_=2))
    assert "ZeRO-3 (dist.shard=weights)" in r.stderr and "6 stages, gathered one at a time" in r.stderr, r.stderr
    assert_same_weights(final_weights(one), final_weights(zero3), atol=1e-5)
    evals = [[e["eval_loss"] for e in _events(d, "eval")] for d in (one, zero3)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], abs=1e-5)
    assert _max_diff(_checkpoint(one, 2).optimizer, _checkpoint(zero3, 2).optimizer) <= 1e-6
    _ok(run_train([*torch_lm, f"train.out_dir={resumed}",
                   "--resume", str(zero3 / "checkpoints" / "step_00000002")]))
    assert_same_weights(final_weights(one), final_weights(resumed), atol=1e-5)
