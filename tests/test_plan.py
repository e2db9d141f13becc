"""The memory planner (issue 35): the estimator's arithmetic, shards sized by budget, what
`dist.shard=auto` picks, and `python -m mlxdist.plan` (in-process: no mpirun, no model run)."""

from __future__ import annotations

import math
import re

import pytest

from mlxdist.commands.plan import main, parse_hosts, parse_size
from mlxdist.config import load_config
from mlxdist.control import memory_plan
from mlxdist.control.memory_plan import (
    GIB,
    MODES,
    Bytes,
    RankNeed,
    choose_mode,
    lm_activation_bytes_per_sample,
    lm_facts,
)
from mlxdist.models.presets import param_count, resolve
from mlxdist.sync.strategy import memory_lines

N = 1_000_000
LINES = memory_lines()  # each mode's line of the plan, its strategy's `memory`


def estimate(*args, **kwargs) -> Bytes:
    return memory_plan.estimate(*args, memory=LINES, **kwargs)


def plan(*args, **kwargs) -> memory_plan.Plan:
    return memory_plan.plan(*args, memory=LINES, **kwargs)


def test_each_mode_line_is_its_strategys_and_a_new_one_brings_its_own():
    from mlxdist.sync.fully_sharded import FullyShardedDataParallel
    from mlxdist.sync.sharded import ShardedDataParallel

    assert LINES["weights"] == FullyShardedDataParallel.memory and LINES["gradients"] == ShardedDataParallel.memory
    seen: list[RankNeed] = []

    def mine(need: RankNeed) -> Bytes:
        seen.append(need)
        return Bytes(need.shard, 0, 0, None)

    p = memory_plan.plan(_cfg(), [("a", 8 * GIB), ("b", 8 * GIB)], 1000, 10, memory={**LINES, "weights": mine})
    assert [b.total for b in p.needs["weights"]] == [500, 500] and [n.ranks for n in seen] == [2, 2]
    assert [b.total for b in p.needs["gradients"]] == [b.total for b in plan(_cfg(), [("a", 8 * GIB)] * 2, 1000,
                                                                               10).needs["gradients"]]
    with pytest.raises(ValueError, match="no memory line for dist.shard=weights"):
        memory_plan.estimate(N, "weights", 0.5, 1, 0, memory={"none": LINES["none"]})


def test_estimate_data_parallel_holds_everything_and_the_update_beside_it():
    b = estimate(N, "none", 0.25, micro_batch=4, activation_bytes_per_sample=1000, dtype="float32")
    assert (b.weights, b.gradients, b.optimizer, b.activations, b.update) == (4 * N, 4 * N, 8 * N, 4000, 12 * N)
    assert b.total == 28 * N  # the compiled AdamW's new p, m, v beside the old ones (measured 28.8 N)
    two = estimate(N, "none", 0.25, 4, 1000, ranks=2)
    assert two.gradients == 8 * N and two.total == 32 * N  # + the reducer's summed copy (measured 32.0 N)
    assert estimate(N, "none", 1.0, 4, 40 * N // 4).total == 52 * N  # activations above the update


def test_estimate_zero1_shards_adamw_state_and_its_update():
    b = estimate(N, "optimizer", 0.5, 1, 0, ranks=2)
    assert b.optimizer == 8 * N * 0.5 == 4 * N
    assert (b.weights, b.gradients, b.update) == (4 * N, 4 * N + 2 * N, 17 * N // 2)
    assert b.total == 8 * N + 29 * N // 2  # measured 22.5 N (bench shard, base, 2 ranks)
    small = estimate(N, "optimizer", 1 / 6, 1, 0, ranks=6)  # the all-gathered weights set beside the old
    assert small.update == 4 * N + math.ceil(N / 6) and small.total == pytest.approx(14.17 * N, rel=1e-3)


def test_estimate_zero2_drops_the_whole_gradients_before_the_update():
    b = estimate(N, "gradients", 0.5, 1, 0, ranks=2)
    assert (b.weights, b.gradients, b.optimizer, b.whole_gradients) == (4 * N, 2 * N, 4 * N, 4 * N)
    assert b.total == 4 * N + 29 * N // 2  # measured 18.5 N
    assert estimate(N, "gradients", 1 / 6, 1, 0, ranks=6).total == pytest.approx(10.17 * N, rel=1e-3)


def test_estimate_zero3_shards_weights_plus_one_gathered_unit():
    b = estimate(N, "weights", 0.5, 1, 0, "bfloat16", gather_params=10_000, staged_activation_bytes_per_sample=7)
    assert b.weights == 2 * N + (4 + 2) * 10_000  # fp32 master shard + the gathered unit, fp32 and its bf16 copy
    assert b.whole_gradients == 4 * 10_000  # the unit's full fp32 gradient before reduce-scatter
    assert (b.gradients, b.optimizer, b.activations) == (2 * N, 4 * N, 7)  # only the stages' inputs are kept
    assert b.update == 13 * N // 2  # the decay mask and the new p, m, v: the old p is the shard held anyway
    assert b.whole_model == 4 * N  # the whole model, built at start before the slice is cut
    writer = estimate(N, "weights", 0.5, 1, 0, gather_params=10_000, writer=True)
    assert writer.whole_model == 12 * N  # it gathers the whole weights and moments to save them
    assert writer.total == 2 * N + 4 * 10_000 + 4 * N + 12 * N


def test_estimate_bf16_adds_the_compute_copy_and_unknown_activations_count_zero():
    b = estimate(N, "none", 1.0, 8, None, "bfloat16")
    assert b.weights == 6 * N and b.activations is None and b.total == 6 * N + 8 * N + 4 * N + 12 * N


def test_estimate_refuses_unknown_mode_and_bad_fraction():
    with pytest.raises(ValueError, match="mode"):
        estimate(N, "auto", 1.0, 1, 0)
    with pytest.raises(ValueError, match="shard_fraction"):
        estimate(N, "optimizer", 1.5, 1, 0)


def test_choose_mode_is_the_least_sharding_that_fits_every_rank():
    needs = {"none": [10, 10], "optimizer": [9, 8], "gradients": [8, 6], "weights": [5, 4]}
    assert choose_mode(needs, [10, 10]) == "none"
    assert choose_mode(needs, [10, 8]) == "optimizer"
    assert choose_mode(needs, [10, 7]) == "gradients"
    assert choose_mode(needs, [5, 5]) == "weights"
    assert choose_mode(needs, [4, 100]) is None


def _cfg(*overrides: str):
    return load_config(None, ["model.preset=tiny", "train.batch_size=2", *overrides])


def test_shards_are_proportional_to_budgets():
    p = plan(_cfg(), [("studio", 128 * GIB), ("macbook", 16 * GIB)], 9_000_000, 0)
    assert p.shard_sizes == [8_000_000, 1_000_000] and sum(p.shard_sizes) == 9_000_000
    studio, macbook = p.needs["optimizer"]
    assert studio.optimizer == 8 * 8_000_000 and macbook.optimizer == 8 * 1_000_000
    assert studio.optimizer > macbook.optimizer


def test_memory_target_and_micro_batch_come_from_nodes():
    cfg = _cfg("nodes={studio: {batch_size: 8, memory_target: 0.5}, macbook: {batch_size: 1}}",
               "control.memory_target=0.8")
    p = plan(cfg, [("Studio.local", 100 * GIB), ("Johns-MacBook-Pro", 10 * GIB)], 1000, 100)
    assert [r.budget for r in p.ranks] == [50 * GIB, 8 * GIB]
    assert [r.micro_batch for r in p.ranks] == [8, 1]
    assert p.needs["none"][0].activations == 800 and p.needs["none"][1].activations == 100


def _plan_for(budgets_gib: list[float], n: int = 100_000_000, act: int = 0):
    cfg = _cfg("control.memory_target=1.0")
    return plan(cfg, [(f"h{i}", int(b * GIB)) for i, b in enumerate(budgets_gib)], n, act)


def test_auto_picks_none_when_data_parallel_fits():
    p = _plan_for([3.5, 3.5])  # 32 bytes x 100M = 2.98 GiB each
    assert p.choice == "none" and p.fits("none")
    assert "the least sharding that fits; it fits every rank" in p.choice_line()


def test_auto_picks_optimizer_when_only_sharding_adamw_fits():
    # 100M params, shards 8:1.3: on the small rank ZeRO-1 holds 12 N + 13 N f = 1.29 GiB (the gathered
    # weights set beside the old ones), data parallel 32 N = 2.98 GiB.
    p = _plan_for([8.0, 1.3])
    assert p.choice == "optimizer"
    assert not p.fits("none") and p.fits("optimizer")
    line = p.choice_line()
    assert line.startswith("dist.shard=auto -> optimizer (ZeRO-1)")
    assert "none does not: rank 1 (h1) needs 3.0 GiB" in line


def test_auto_picks_gradients_then_weights_as_memory_shrinks():
    assert _plan_for([8.0, 0.9]).choice == "gradients"  # 8 N + 13 N f: 0.87 GiB (ZeRO-1: 12 N + 13 N f)
    # ZeRO-3 on the small rank: 12 N f of shards (f = 0.06) and the whole model it builds at start
    # (4 N = 0.37 GiB): fits 0.5 GiB, where ZeRO-2 needs 8 N + more (0.75 GiB); 0.2 GiB fits nothing.
    assert _plan_for([8.0, 0.5]).choice == "weights"
    assert _plan_for([8.0, 0.2]).choice is None


def test_nothing_fits_names_the_rank_its_budget_and_its_need():
    p = _plan_for([1.0, 1.0], n=1_000_000_000)
    assert p.choice is None
    line = p.no_fit_line()
    assert line.startswith("no dist.shard fits: rank ")
    assert "under dist.shard=weights (ZeRO-3) but its budget is 1.0 GiB (1.0 GiB x memory_target 1)" in line


def test_a_set_mode_that_does_not_fit_warns_in_the_banner():
    cfg = _cfg("control.memory_target=1.0", "dist.shard=none")
    p = plan(cfg, [("a", 8 * GIB), ("b", int(1.3 * GIB))], 100_000_000, 0)
    lines = p.banner_lines()
    assert lines[0] == "dist.shard=none (data parallel)"
    assert any(line.startswith("warning: rank 1 (b) needs") and line.endswith("auto would choose optimizer")
               for line in lines)


def test_data_parallel_that_does_not_fit_is_one_warning_naming_rank_budget_and_bytes():
    cfg = _cfg("control.memory_target=1.0", "dist.shard=none")
    p = plan(cfg, [("a", 8 * GIB), ("b", int(1.3 * GIB))], 100_000_000, 0)
    line = p.unsharded_warning()
    assert line.startswith("warning: memory plan: rank 1 (b) needs 3.0 GiB under dist.shard=none (data parallel) "
                           "but its budget is 1.3 GiB (1.3 GiB x memory_target 1); set dist.shard=auto (or "
                           "optimizer/gradients): auto would choose optimizer (ZeRO-1). Training goes on"), line
    assert "\n" not in line
    assert "set dist.shard=optimizer (ZeRO-1): it fits" in p.unsharded_warning(auto=False)  # torch: name the mode
    assert "lower the micro-batch" in p.unsharded_warning(can_shard=False)
    assert plan(cfg, [("a", 8 * GIB)] * 2, 100_000_000, 0).unsharded_warning() is None  # it fits
    tight = plan(cfg, [("a", int(0.05 * GIB))] * 2, 100_000_000, 0)  # nothing fits: shrink instead
    assert tight.choice is None and "lower the micro-batch" in tight.unsharded_warning()


def test_lm_facts_match_the_preset():
    cfg = load_config(None, ["model.preset=1b", "data.seq_len=2048", "model.dtype=bfloat16"])
    facts = lm_facts(cfg)
    a = resolve(cfg.model)
    assert facts.n_params == param_count(a)
    # 1b: dim 2048, 22 layers, 16 heads, ffn 5632, 2048 tokens: per token 36 x dim outside the blocks, per
    # block 7 x dim + 5.5 x ffn + (1.15 x 16 + 1) x seq elements in bf16, and 16 bytes x vocab.
    per_token = 36 * 2048 + 22 * (7 * 2048 + 5.5 * 5632 + (1.15 * 16 + 1) * 2048)
    assert facts.activation_bytes_per_sample == pytest.approx(2048 * (2 * per_token + 16 * a.vocab_size), rel=1e-6)
    assert lm_facts(load_config(None, ["task.factory=user_tasks:torch_mlp"])) is None


def test_grad_checkpointing_shrinks_the_activation_estimate():
    full = lm_activation_bytes_per_sample(64, 8, 4, 256, 100, 32, "float32")
    every = lm_activation_bytes_per_sample(64, 8, 4, 256, 100, 32, "float32", grad_checkpoint_every=1)
    half = lm_activation_bytes_per_sample(64, 8, 4, 256, 100, 32, "float32", grad_checkpoint_every=2)
    assert every < half < full


def test_sizes_and_hosts_parse():
    assert parse_size("128GB") == 128 * GIB == parse_size("128 GiB")
    assert parse_size("512MB") == 512 * 2**20 and parse_size("1024") == 1024
    assert parse_hosts("studio=128GB, macbook=16GB") == [("studio", 128 * GIB), ("macbook", 16 * GIB)]


def test_cli_prints_the_table_and_the_choice_for_a_preset(capsys):
    rc = main(["model.preset=tiny", "data.seq_len=64", "--hosts", "studio=128GB,macbook=16GB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "model: preset tiny" in out and "2 rank(s) from --hosts" in out
    for mode in MODES:
        assert f"\n{mode} (" in out
    assert "studio" in out and "macbook" in out
    assert out.strip().splitlines()[-1].startswith("dist.shard=auto -> none (data parallel)")


def test_cli_fits_nowhere_is_one_line_and_exit_2(capsys):
    rc = main(["model.preset=1b", "data.seq_len=2048", "--hosts", "studio=128GB,macbook=2GB"])
    captured = capsys.readouterr()
    assert rc == 2
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no dist.shard fits: rank 1 (macbook) needs ")
    assert "budget is 1.7 GiB (2.0 GiB x memory_target 0.85)" in err[0]
    assert "weights (ZeRO-3)" in captured.out  # the table still shows why


def test_cli_hostfile_with_memory(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("studio.local slots=1\nmacbook.local slots=2\n")
    rc = main(["model.preset=tiny", "--hostfile", str(hosts), "--memory", "studio=64GB,macbook=16GB"])
    out = capsys.readouterr().out
    assert rc == 0 and "3 rank(s) from hostfile" in out
    assert "macbook.local" in out and "     8.0" in out  # two ranks share the MacBook's 16 GB


def test_cli_hostfile_host_without_memory_is_named(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("studio.local slots=1\n")
    assert main(["model.preset=tiny", "--hostfile", str(hosts)]) == 2
    assert "host 'studio.local': its memory is unknown here; add --memory studio.local=SIZE" in capsys.readouterr().err


def test_cli_task_counts_parameters_and_asks_for_activations(capsys):
    rc = main(["task.factory=user_tasks:torch_mlp", "--engine", "torch", "--hosts", "a=1GB,b=1GB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "195 trained parameters" in out  # Linear(8,16) + Linear(16,3)
    assert "activations not estimated for a task; add --activation-gb" in out
    rc = main(["task.factory=user_tasks:torch_mlp", "--engine", "torch", "--hosts", "a=1GB,b=1GB",
               "--activation-gb", "0.01"])
    out = capsys.readouterr().out
    assert rc == 0 and "n/a" not in out and "activations 0.01 GiB/sample (given)" in out
    assert "163.8" in out  # 16 samples x 0.01 GiB, in MiB (budgets under 1 GiB)


def test_step_prediction_follows_each_modes_exchange_and_the_pipelines_schedule():
    """Two ranks of 1 MFLOP/s, 2 samples of 10 tokens each, micro-batches of one: data parallel
    and ZeRO-1/2 move 2 (p-1)/p of 4 bytes a parameter, ZeRO-3 3 (p-1)/p; the pipeline runs 4
    micro-batches in 5 slots of its slowest stage (900 elements), a boundary activation (10 x 4
    floats) crossing once each way per micro-batch, only the fill and drain not hidden."""
    from mlxdist.control.mode_time import predict

    def at(bps):
        return {t.mode: t for t in predict(1000, [100, 800, 100], [(0, 2), (2, 3)], [2, 2], [1, 1], 10, 4, bps,
                                           [1e6, 1e6])}

    t = at(8e6)  # 1 MB/s
    assert t["data parallel"].compute_s == pytest.approx(6 * 1000 * 20 / 1e6)
    assert t["data parallel"].exchange_bytes == t["ZeRO-1/2"].exchange_bytes == pytest.approx(4000)
    assert t["ZeRO-3"].exchange_s == pytest.approx(6000 / 1e6)
    assert t["pipeline"].compute_s == pytest.approx(5 * 6 * 900 * 10 / 1e6)
    assert t["pipeline"].exchange_s == pytest.approx(2 * 160 / 1e6)
    assert t["pipeline"].exchange_bytes == pytest.approx(2 * 4 * 160)
    slow = at(8e3)  # 1 kB/s: a hop (0.16 s) outlasts the slowest stage (0.054 s), so it sets the slot
    assert slow["pipeline"].compute_s == pytest.approx(5 * 2 * 0.16)


def test_cli_says_which_mode_to_use_over_the_link(capsys):
    """A Studio and a MacBook at half its FLOP/s, 1B model: over 1 Gbit/s the pipeline (cut by
    the FLOP/s, and the nodes: speed to set said) is predicted many times faster than ZeRO-3;
    on equal Macs over a link so fast the exchange costs nothing, the pipeline's fill and drain
    (2 micro-batches in 3 slots) lose to ZeRO-1/2. Without --tflops: each mode's bytes a step."""
    base = ["--hosts", "studio=128GB,macbook=16GB", "model.preset=1b"]
    assert main([*base, "--tflops", "10,5"]) == 0
    out = capsys.readouterr().out
    assert "use: pipeline" in out and "data parallel" in out and "does not fit" in out, out
    zero3 = float(re.search(r"ZeRO-3 (\d+\.\d+)x as long", out).group(1))
    assert zero3 > 5, out
    assert "rank 0 stages 0-13, rank 1 stages 14-23; set nodes: {HOST: {speed: ...}} to 1, 0.5" in out, out
    assert main([*base, "--tflops", "10", "--link", "1tbit"]) == 0
    assert "use: ZeRO-1/2 (the others that fit take" in capsys.readouterr().out
    assert main(base) == 0
    out = capsys.readouterr().out
    assert re.search(r"exchange a step over the busiest link at 1gbit: data parallel \d+ MB .* pipeline [\d.]+ MB", out)
    assert main([*base, "--link", "fast"]) == 2
    assert "--link: cannot read 'fast' as a link rate" in capsys.readouterr().err
    assert main([*base, "--tflops", "10,5,3"]) == 2
    assert "--tflops=10,5,3: needs one positive number, or 2 (one per rank)" in capsys.readouterr().err
