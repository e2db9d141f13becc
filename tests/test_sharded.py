"""Sharded data parallel (`dist.shard=optimizer|gradients`, MLX and torch engines): the same
numbers as data parallel and as one process (DESIGN promise 9), shards sized to each rank's
memory budget, and checkpoints in data parallel's format, so sharded and unsharded runs resume
each other."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, assert_same_weights, env, final_weights, mpirun_path, run_train

from mlxdist.control.split import proportional_split, shard_bounds
from mlxdist.state import checkpoint as ckpt
from mlxdist.sync.sharded import bucket_counts

HERE = Path(__file__).parent
TASK = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
        "train.schedule=constant", "train.lr=1e-2", "dist.sync_weights_every=0",
        "task.factory=user_tasks:mlx_mlp", "train.grad_clip=0.5", "train.weight_decay=0.1", "train.steps=4"]
# LoRA-named factors, which the torch engine holds transposed to checkpoints; 291 parameters,
# rank 0's half ending inside the first factor.
TORCH = ["--engine", "torch", "--device", "cpu", "task.factory=user_tasks:torch_adapted"]
SPLIT = "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"
# rank 0 may use 0.8 of its memory, rank 1 0.2: same machine, so rank 0 owns ~4x the elements
UNEQUAL = "nodes={rank0: {batch_size: 3, memory_target: 0.8}, rank1: {batch_size: 5, memory_target: 0.2}}"


def _train(args, np_=0):
    return run_train([*TASK, *args], np_=np_, cwd=HERE)


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _events(run_dir: Path, kind: str, rank: int = 0) -> list[dict]:
    lines = (run_dir / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _checkpoint(run_dir: Path, step: int) -> ckpt.Loaded:
    loaded = ckpt.load(run_dir / "checkpoints" / f"step_{step:08d}")
    assert loaded.meta.optimizer_step == step
    return loaded


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


# ---------------------------------------------------------------- plain logic
def test_shards_are_contiguous_and_sized_by_budget():
    bounds = shard_bounds(1000, [0.8 * 64e9, 0.2 * 64e9])
    assert bounds == [(0, 800), (800, 1000)]
    assert shard_bounds(10, [0.0, 0.0]) == [(0, 5), (5, 10)]  # no reading: equal shares
    bounds = shard_bounds(195, [128e9 * 0.85, 16e9 * 0.85, 16e9 * 0.85])
    assert [b - a for a, b in bounds] == proportional_split(195, [8, 1, 1]) and bounds[-1][1] == 195
    assert shard_bounds(10, [3.0, 1.0], "equal") == [(0, 5), (5, 10)]  # dist.shard_split=equal
    for lo, hi in ((0, 100), (150, 900), (790, 810), (999, 1000)):
        counts = bucket_counts([(0, 800), (800, 1000)], lo, hi)
        assert sum(counts) == hi - lo and min(counts) >= 0


def test_sharding_reads_the_engines_capability_record():
    """`ShardedDataParallel.check` decides from `engine.capabilities` alone (both engines fill it
    alike: tests/test_strategy.py); no other attribute of the engine is read."""
    from types import SimpleNamespace

    from mlxdist.config import ConfigError, load_config
    from mlxdist.engine.base import Capabilities
    from mlxdist.sync.sharded import ShardedDataParallel

    cfg, world = load_config(None, ["dist.shard=optimizer"]), SimpleNamespace(agreed_error=ConfigError)
    plan = SimpleNamespace(shard="optimizer")
    ShardedDataParallel.check(cfg, world, SimpleNamespace(capabilities=Capabilities("t")), plan)  # mlxdist's AdamW
    with pytest.raises(ConfigError, match="brings its own optimizer"):
        ShardedDataParallel.check(cfg, world, SimpleNamespace(capabilities=Capabilities("t", own_optimizer=True)), plan)
    with pytest.raises(ConfigError, match="scales the loss"):
        ShardedDataParallel.check(cfg, world, SimpleNamespace(capabilities=Capabilities("t", loss_scaling=True)), plan)


def test_torch_shard_update_is_the_engines_own_adamw_bit_for_bit():
    """Two shards cut inside a LoRA-style factor (held transposed), updated by the torch engine's
    shard ops, give bit for bit what its own data-parallel step gives (mlxdist.optim's AdamW over
    all parameters at once; decay on matrices only), and the engine keeps no moments of its own
    meanwhile."""
    pytest.importorskip("torch")
    from user_tasks import Regression, torch_adapted

    from mlxdist.config import load_config
    from mlxdist.engine.base import Piece
    from mlxdist.engine.torch_engine import TorchEngine
    from mlxdist.tasks import Batch

    cfg = load_config(None, ["train.weight_decay=0.1", "train.lr=1e-2", "train.grad_clip=0"])
    ref, sharded = TorchEngine(cfg, "cpu", task=torch_adapted()), TorchEngine(cfg, "cpu", task=torch_adapted())
    ops, data = sharded.shard_ops(), Regression(64)
    sizes = [int(np.prod(s)) for s in ops.shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    assert ops.names[2].endswith(".lora_a") and offsets[2] < 150 < offsets[3]
    shards = [(lo, hi, tuple(Piece(i, max(a, lo) - a, min(b, hi) - a, max(a, lo) - lo)
                             for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True))
                             if max(a, lo) < min(b, hi)))
              for lo, hi in ((0, 150), (150, int(offsets[-1])))]
    moments = [(ops.array(np.zeros(hi - lo, np.float32)), ops.array(np.zeros(hi - lo, np.float32)))
               for lo, hi, _ in shards]
    for t in (1, 2, 3):
        batch = Batch(np.arange(8), {"x": data.x[8 * t:8 * t + 8], "y": data.y[8 * t:8 * t + 8]}, 8)
        ref.micro_step(batch)
        g = ref.take_gradients()
        ref.apply_gradients(g.arrays, g.loss_sum, g.count, 1e-2)
        sharded.micro_step(batch)
        g = sharded.take_gradients()
        flat = np.concatenate([ops.flat(i, a) for i, a in enumerate(g.arrays)])
        new = []
        for r, (lo, hi, pieces) in enumerate(shards):
            p, moments[r] = ops.update(ops.weights(pieces), moments[r], ops.array(flat[lo:hi].copy()) * (1 / g.count),
                                       pieces, 1e-2, t, 1.0)
            new.append(ops.numpy(p))
        full = np.concatenate(new)
        sharded.set_weights({n: full[a:b].reshape(s) for n, s, a, b in
                             zip(ops.names, ops.shapes, offsets[:-1], offsets[1:], strict=True)})
        ops.drop_moments(t)
        state, step = sharded.get_optimizer_state()
        assert step == t and not any(a.any() for a in state.values())  # the engine holds none: zeros
    assert_same_weights(ref.get_weights(), sharded.get_weights(), atol=0.0)
    state, _ = ref.get_optimizer_state()
    m = np.concatenate([state[f"m.{n}"].reshape(-1) for n in ops.names])
    assert np.array_equal(m, np.concatenate([ops.numpy(m) for m, _ in moments]))


# ---------------------------------------------------------------- real ranks
@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """One rank, 8 samples a step, data parallel's checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("sharded") / "one"
    _ok(_train(["train.batch_size=8", "checkpoint.every=2", f"train.out_dir={out}"]))
    return out


@pytest.mark.cluster
def test_sharded_equals_data_parallel_and_one_process(tmp_path, one_process):
    """AdamW with weight decay and clipping (the norm is 5x the clip): 3+5 on two ranks,
    optimizer state sharded or gradients too, equals 3+5 data parallel and 8 on one rank."""
    runs = {}
    for shard in ("none", "optimizer", "gradients"):
        r = _ok(_train([SPLIT, f"dist.shard={shard}", f"train.out_dir={tmp_path / shard}"], np_=2))
        runs[shard] = final_weights(tmp_path / shard)
        if shard != "none":
            assert f"(dist.shard={shard})" in r.stderr and "rank 0 98 (50%)" in r.stderr, r.stderr
    one = final_weights(one_process)
    for shard in ("optimizer", "gradients"):
        assert_same_weights(runs["none"], runs[shard], atol=1e-5)
        assert_same_weights(one, runs[shard], atol=1e-5)
        moments = _max_diff(_checkpoint(one_process, 4).optimizer, _checkpoint(tmp_path / shard, 4).optimizer)
        assert moments <= 1e-6, f"{shard}: moments differ by {moments:.3g}"
    clipped = _events(tmp_path / "gradients", "step")[0]
    assert clipped["grad_norm"] > 0.5 and clipped["sync_bytes"] == 2 * 4 * 195


@pytest.mark.cluster
@pytest.mark.parametrize("backend, shard", [("mlx-ring", "optimizer"), ("mlx-mpi", "gradients")])
def test_sharding_runs_on_mlx_backends_and_equals_one_process(tmp_path, one_process, backend, shard):
    """The exchange over MLX's collectives (`MlxTransport`: all_sum for the reduce-scatter, a
    padded all_gather for the weights and the checkpoint's moments): 3+5 on two ranks equals
    8 on one rank, weights and moments, as over mpi4py."""
    r = _ok(_train([SPLIT, f"dist.shard={shard}", f"dist.backend={backend}", f"train.out_dir={tmp_path}"], np_=2))
    assert f"exchange: {backend} all_sum" in r.stderr, r.stderr[-3000:]
    assert_same_weights(final_weights(one_process), final_weights(tmp_path), atol=1e-5)
    moments = _max_diff(_checkpoint(one_process, 4).optimizer, _checkpoint(tmp_path, 4).optimizer)
    assert moments <= 1e-6, f"{backend} {shard}: moments differ by {moments:.3g}"


@pytest.mark.cluster
def test_checkpoints_resume_across_sharded_and_unsharded_runs(tmp_path, one_process):
    """Shards by memory budget (0.8 vs 0.2: rank 0 owns 4x); a save mid-run disturbs
    nothing; its step-2 checkpoint is data parallel's and resumes on one unsharded rank, and
    one rank's unsharded checkpoint resumes sharded on two: all equal the uninterrupted run."""
    sharded = tmp_path / "sharded"
    r = _ok(_train([UNEQUAL, "dist.shard=gradients", "checkpoint.every=2", f"train.out_dir={sharded}"], np_=2))
    shares = re.search(r"rank 0 (\d+) \(\d+%\) [\d.e-]+ MB, rank 1 (\d+) \(", r.stderr)
    assert shares and (int(shares[1]), int(shares[2])) == (156, 39), r.stderr
    for rank in (0, 1):
        event = _events(sharded, "shard", rank)[0]
        assert event["elements"] == [156, 39] and event["optimizer_bytes_here"] == 8 * [156, 39][rank]
    uninterrupted = final_weights(one_process)
    assert_same_weights(uninterrupted, final_weights(sharded), atol=1e-5)
    saved, expected = _checkpoint(sharded, 2), _checkpoint(one_process, 2)
    assert saved.optimizer.keys() == expected.optimizer.keys()  # m.<param>, v.<param>: data parallel's
    assert _max_diff(saved.optimizer, expected.optimizer) <= 1e-6

    r = _ok(_train(["train.batch_size=8", f"train.out_dir={tmp_path / 'unsharded'}",
                    "--resume", str(sharded / "checkpoints" / "step_00000002")]))
    assert "resumed from" in r.stderr
    assert_same_weights(uninterrupted, final_weights(tmp_path / "unsharded"), atol=1e-5)

    r = _ok(_train([SPLIT, "dist.shard=optimizer", f"train.out_dir={tmp_path / 'resharded'}",
                    "--resume", str(one_process / "checkpoints" / "step_00000002")], np_=2))
    assert "resumed from" in r.stderr
    assert_same_weights(uninterrupted, final_weights(tmp_path / "resharded"), atol=1e-5)
    assert _max_diff(_checkpoint(one_process, 4).optimizer, _checkpoint(tmp_path / "resharded", 4).optimizer) <= 1e-6


@pytest.fixture(scope="module")
def torch_one_process(tmp_path_factory) -> Path:
    """The torch engine, one rank, 8 samples a step, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("sharded_torch") / "one"
    _ok(_train([*TORCH, "train.batch_size=8", "checkpoint.every=2", f"train.out_dir={out}"]))
    return out


@pytest.fixture(scope="module")
def torch_zero2(tmp_path_factory) -> Path:
    """The torch engine, ZeRO-2 on two ranks (3+5), checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("sharded_torch") / "gradients"
    r = _ok(_train([*TORCH, SPLIT, "dist.shard=gradients", "checkpoint.every=2", f"train.out_dir={out}"], np_=2))
    assert "(dist.shard=gradients)" in r.stderr and "rank 0 146 (50%)" in r.stderr, r.stderr
    return out


@pytest.mark.cluster
def test_torch_sharded_equals_data_parallel_and_one_process(tmp_path, torch_one_process, torch_zero2):
    """The torch engine's AdamW (torch's own, decay on matrices only) with clipping: 3+5 on
    two ranks sharded equals 3+5 data parallel and 8 on one rank, moments included."""
    runs = {"gradients": torch_zero2}
    for shard in ("none", "optimizer"):
        _ok(_train([*TORCH, SPLIT, f"dist.shard={shard}", "checkpoint.every=2", f"train.out_dir={tmp_path / shard}"],
                   np_=2))
        runs[shard] = tmp_path / shard
    for shard in ("optimizer", "gradients"):
        for reference in (runs["none"], torch_one_process):
            assert_same_weights(final_weights(reference), final_weights(runs[shard]), atol=1e-5)
            moments = _max_diff(_checkpoint(reference, 4).optimizer, _checkpoint(runs[shard], 4).optimizer)
            assert moments <= 1e-6, f"{shard}: moments differ by {moments:.3g}"
    clipped = _events(torch_zero2, "step")[0]
    assert clipped["grad_norm"] > 0.5 and clipped["sync_bytes"] == 2 * 4 * 291


@pytest.mark.cluster
def test_torch_sharded_checkpoint_resumes_unsharded(tmp_path, torch_one_process, torch_zero2):
    """The torch ZeRO-2 run's step-2 checkpoint is data parallel's (`m.<param>`, `v.<param>`)
    and resumes on one unsharded rank to the uninterrupted run's weights."""
    saved, expected = _checkpoint(torch_zero2, 2), _checkpoint(torch_one_process, 2)
    assert saved.optimizer.keys() == expected.optimizer.keys()
    assert _max_diff(saved.optimizer, expected.optimizer) <= 1e-6
    r = _ok(_train([*TORCH, "train.batch_size=8", f"train.out_dir={tmp_path}",
                    "--resume", str(torch_zero2 / "checkpoints" / "step_00000002")]))
    assert "resumed from" in r.stderr
    assert_same_weights(final_weights(torch_one_process), final_weights(tmp_path), atol=1e-5)


@pytest.mark.cluster
def test_buckets_split_parameters_and_shards(tmp_path):
    """The built-in LM (771k parameters) in 0.01 MB buckets: parameters and shards straddle
    bucket edges, ranks own 4:1, and ZeRO-2 still equals data parallel."""
    lm = [*FAST, "train.steps=2", "train.grad_clip=0.5", "dist.sync_weights_every=0"]
    _ok(run_train([*lm, SPLIT, f"train.out_dir={tmp_path / 'dp'}"], np_=2))
    r = _ok(run_train([*lm, UNEQUAL, "dist.shard=gradients", "dist.bucket_mb=0.01",
                       f"train.out_dir={tmp_path / 'zero2'}"], np_=2))
    assert "rank 0 617165 (80%)" in r.stderr, r.stderr
    assert_same_weights(final_weights(tmp_path / "dp"), final_weights(tmp_path / "zero2"), atol=1e-5)


@pytest.mark.cluster
def test_chunked_update_resumes_and_reports_where_the_step_goes(tmp_path):
    """ZeRO-1 in 0.01 MB chunks (rank 0 owns 4x: 236 chunks against 59, so the last
    all-gathers carry rank 0's chunks only): its optimizer state, kept chunk by chunk, saves
    as data parallel's moments and resumes from step 1 to the uninterrupted run's weights and
    moments; every step reports its seconds by phase (`shard_phases`), which fit in the step."""
    lm = [*FAST, "train.steps=2", "train.grad_clip=0.5", "dist.sync_weights_every=0", UNEQUAL,
          "dist.shard=optimizer", "dist.bucket_mb=0.01"]
    whole = tmp_path / "whole"
    _ok(run_train([*lm, "checkpoint.every=1", f"train.out_dir={whole}"], np_=2))
    _ok(run_train([*lm, f"train.out_dir={tmp_path / 'resumed'}",
                   "--resume", str(whole / "checkpoints" / "step_00000001")], np_=2))
    assert_same_weights(final_weights(whole), final_weights(tmp_path / "resumed"), atol=1e-6)
    assert _max_diff(_checkpoint(whole, 2).optimizer, _checkpoint(tmp_path / "resumed", 2).optimizer) <= 1e-7
    for rank in (0, 1):
        steps = {e["step"]: e for e in _events(whole, "step", rank)}
        phases = _events(whole, "shard_phases", rank)
        assert [e["step"] for e in phases] == [1, 2]
        for e in phases:
            parts = [e[k] for k in ("flatten", "reduce_scatter", "norm", "update", "all_gather", "unpack")]
            assert min(parts) >= 0 and sum(parts) <= steps[e["step"]]["step_s"] + 1e-3, (e, steps[e["step"]])


@pytest.mark.cluster
def test_bfloat16_on_the_wire_takes_the_ring_and_halves_the_gradient_bytes(tmp_path):
    """`dist.wire_dtype=bfloat16`: the reduce-scatter goes through the pipelined ring in bf16
    (MPI cannot sum bf16) in equal shards (`dist.shard_split=equal`, despite 0.8/0.2 memory
    targets), the all-gather stays fp32: the same weights as data parallel with a bf16 wire
    (two ranks: one rounding of the same pairwise sum either way). No clipping here: a norm
    that differs in the 8th digit moves weights by 1e-7, and bf16's rounding of the next
    gradients turns that into 1e-5 (fp32 runs check clipping)."""
    lm = [*FAST, "train.steps=2", "train.grad_clip=0", "dist.sync_weights_every=0", "dist.wire_dtype=bfloat16"]
    _ok(run_train([*lm, SPLIT, f"train.out_dir={tmp_path / 'dp'}"], np_=2))
    r = _ok(run_train([*lm, UNEQUAL, "dist.shard=optimizer", "dist.shard_split=equal",
                       f"train.out_dir={tmp_path / 'zero1'}"], np_=2))
    assert "in equal shards (dist.shard_split=equal): rank 0 385728 (50%)" in r.stderr, r.stderr
    assert "exchange: pipelined ring, gradients bfloat16 on the wire (weights fp32)" in r.stderr
    assert _events(tmp_path / "zero1", "step")[0]["sync_bytes"] == (2 + 4) * 771456
    assert_same_weights(final_weights(tmp_path / "dp"), final_weights(tmp_path / "zero1"), atol=1e-7)


@pytest.mark.parametrize("args, line", [
    (["dist.shard=weights"], "runs the model a stage at a time, but Sequential has no stages() (the built-in LM's"),
    (["dist.shard=weights", "task.args={batchnorm: true}"], "has buffers or frozen arrays"),
    (["dist.shard=weights", "task.factory=user_tasks:mlx_staged_mlp", "train.ema=0.9"], "with train.ema: the average"),
    (["dist.shard=optimizer", *TORCH, "model.dtype=float16"], "scales the loss (GradScaler)"),
    (["dist.shard=gradients", "task.factory=user_tasks:mlx_own_optimizer"], "brings its own optimizer"),
    (["dist.shard=optimizer", "dist.mode=diloco"], "dist.mode=diloco keeps each rank's own optimizer"),
])
def test_what_sharding_cannot_do_is_refused_in_one_line(tmp_path, args, line):
    r = _train([*args, "train.batch_size=8", f"train.out_dir={tmp_path}"])
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: dist.shard=") and line in last, r.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("limit, expect, code", [
    (22_000_000, "dist.shard=auto -> optimizer (ZeRO-1): the least sharding that fits; none does not: rank 0", 0),
    (9_000_000, "error: no dist.shard fits: rank 0 (", 2),
])
def test_auto_takes_the_least_sharding_that_fits_every_rank_or_stops_before_step_1(tmp_path, limit, expect, code):
    """The built-in tiny LM: data parallel needs 23.5 MiB a rank (python -m mlxdist.plan), ZeRO-1
    16.6; a 22 MB limit (budget 17.8) fits ZeRO-1 only, 9 MB nothing."""
    r = run_train([*FAST, "train.batch_size=4", "train.steps=2", "dist.shard=auto", f"train.out_dir={tmp_path}"],
                  np_=2, extra_env={"MLXDIST_MEMORY_LIMIT_BYTES": str(limit)})
    assert r.returncode == code, r.stderr[-3000:]
    assert expect in r.stderr, r.stderr[-3000:]
    if code == 0:
        assert "sharded data parallel, ZeRO-1 (dist.shard=optimizer)" in r.stderr
        assert "shard: auto" in (tmp_path / "config.yaml").read_text()  # the config as given; the choice is the plan's
    else:
        assert not (tmp_path / "checkpoints").exists() and r.stderr.count("error:") == 1


PLAN_SCRIPT = """
import dataclasses, json, sys
from mlxdist.config import load_config
from mlxdist.training.loop import Trainer
cfg = load_config(None, sys.argv[1:])
before = (dataclasses.asdict(cfg), cfg.warnings, cfg.explicit)
trainer = Trainer(cfg)
trainer.run()
p = trainer.run_plan
if trainer.world.is_main:
    print("PLAN " + json.dumps({"same": (dataclasses.asdict(cfg), cfg.warnings, cfg.explicit) == before,
                               "configured": cfg.dist.shard, "shard": p.shard, "bounds": p.shard_bounds,
                               "strategy": trainer.sync.bounds, "trained": int(sum(trainer.engine.gradient_sizes())),
                               "micro": p.micro_batches, "hosts": p.hosts, "vocab": p.vocab_size, "wire": p.wire_dtype}))
"""


@pytest.mark.cluster
def test_auto_is_resolved_into_the_run_plan_and_the_config_is_unchanged_by_a_run(tmp_path):
    """Two real ranks, dist.shard=auto on a 22 MB limit (ZeRO-1 fits, data parallel does not):
    the plan holds the choice and the split the strategy trains with; the config is as loaded."""
    script = tmp_path / "plan_run.py"
    script.write_text(PLAN_SCRIPT)
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH",
           "-x", "OPENBLAS_NUM_THREADS", "-x", "MLXDIST_MEMORY_LIMIT_BYTES", sys.executable, str(script),
           *FAST, "train.batch_size=4", "train.steps=2", "dist.shard=auto", "nodes.rank1.batch_size=2",
           f"train.out_dir={tmp_path / 'run'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE,
                       env=env() | {"MLXDIST_MEMORY_LIMIT_BYTES": "22000000"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PLAN "))[5:])
    assert got["same"] and got["configured"] == "auto" and got["shard"] == "optimizer", got
    half = (got["trained"] + 1) // 2  # equal budgets: equal shards, the odd element to rank 0
    assert got["bounds"] == got["strategy"] == [[0, half], [half, got["trained"]]], got
    assert got["micro"] == [4, 2] and len(got["hosts"]) == 2 and got["vocab"] == 258 and got["wire"] == "float32"
