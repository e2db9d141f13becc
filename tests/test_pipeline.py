"""Pipeline parallelism (`dist.mode=pipeline`, MLX engine): the transport's point-to-point on
real ranks; a pipeline of 2 and 3 ranks (several cuts, unequal micro-batch counts, as
many micro-batches as stages) equals one process on the same micro-batches; its checkpoint is data
parallel's (one process and `generate` load it; it resumes on another cut, another number of
ranks, or one process, exactly); a stage killed, stopped by Ctrl-C or frozen mid-run; the cut by
speed and memory; refusals in one line.

The reference runs one process with micro-batches of one sample, and every pipeline run deals
the same samples in micro-batches of one, so the sums are added in the same order: what differs
is the global norm's sum (per rank, then over ranks) and a tied embedding's two gradient halves
added after backward instead of inside it, both fp32 rounding (measured ~2-5e-7 after 4 AdamW
steps; a different micro-batching alone moves these weights by ~6e-6, data parallel's too)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, ROOT, env, logged_steps, mpirun_path, run_slowed, run_train, training

from mlxdist.config import ConfigError
from mlxdist.control.pipeline_cut import LAST_RUN, cut_stages, parse_cut, stage_time
from mlxdist.state import checkpoint as ckpt

HERE = Path(__file__).parent
LM = [*FAST, "train.batch_size=1", "train.global_batch=5", "train.grad_clip=0.5", "train.weight_decay=0.1",
      "dist.sync_weights_every=0", "train.steps=4", "checkpoint.every=2", "train.eval_every=2"]
TOL = 1e-6


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _train(args, np_=0):
    return run_train(args, np_=np_, cwd=HERE, timeout=240)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def _saved(run: Path, step: int | None = None) -> ckpt.Loaded:
    if step is None:
        return ckpt.load_latest(run / "checkpoints")
    return ckpt.load(run / "checkpoints" / f"step_{step:08d}")


def _events(run: Path, kind: str, rank: int = 0) -> list[dict]:
    lines = (run / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _same_as(reference: Path, run: Path) -> tuple[float, float]:
    """Max weight and optimizer-state differences of the two runs' last checkpoints."""
    a, b = _saved(reference), _saved(run)
    assert a.meta.run.step == b.meta.run.step and a.meta.optimizer_step == b.meta.optimizer_step
    return _max_diff(a.weights, b.weights), _max_diff(a.optimizer, b.optimizer)


# ---------------------------------------------------------------- the cut (pure)
def test_cut_minimises_the_slowest_stage():
    costs = [1.0] * 12
    assert cut_stages(costs, [1.0] * 12, [1.0, 1.0], [0, 0]) == [(0, 6), (6, 12)]
    assert cut_stages(costs, [1.0] * 12, [1.0, 1.0, 1.0], [0, 0, 0]) == [(0, 4), (4, 8), (8, 12)]
    # A half-speed rank gets about a third of the layers: its 4 take as long as the other's 8.
    cuts = cut_stages(costs, [1.0] * 12, [1.0, 0.5], [0, 0])
    assert cuts == [(0, 8), (8, 12)]
    assert stage_time(costs, [1.0, 0.5], cuts) == [8.0, 8.0]
    # Unequal costs (a head four times a block) are balanced by time, not by count.
    assert cut_stages([1, 1, 1, 1, 1, 4], [0] * 6, [1, 1], [0, 0]) == [(0, 4), (4, 6)]
    # A pipeline's last rank recomputes nothing (3 forwards' work a stage against 4): it takes more.
    cuts = cut_stages(costs, [1.0] * 12, [1.0, 1.0], [0, 0], LAST_RUN)
    assert cuts == [(0, 5), (5, 12)] and stage_time(costs, [1.0, 1.0], cuts, LAST_RUN) == [5.0, 5.25]
    assert cut_stages(costs, [1.0] * 12, [1.0], [0], LAST_RUN) == [(0, 12)]


def test_cut_respects_each_ranks_memory():
    costs, sizes = [1.0] * 10, [10.0] * 10
    # Equal speeds would cut 5+5; rank 1 holds only 30 bytes: 3 stages.
    assert cut_stages(costs, sizes, [1.0, 1.0], [1000, 30]) == [(0, 7), (7, 10)]
    # The fast rank is small: the slow one must take more than its speed would give it.
    cuts = cut_stages(costs, sizes, [1.0, 0.25], [40, 1000])
    assert cuts == [(0, 4), (4, 10)] and all(sum(sizes[a:b]) <= m for (a, b), m in zip(cuts, [40, 1000], strict=True))
    with pytest.raises(ConfigError, match=r"^dist.mode=pipeline: no cut of the model's 10 stages .* fits the ranks' "
                                          r"memory budgets .*set dist.pipeline_cut$"):
        cut_stages(costs, sizes, [1.0, 1.0], [40, 40])
    with pytest.raises(ConfigError, match=r"on 3 ranks: the model has 2 stages, fewer than the ranks; run it on "
                                          r"at most 2 ranks"):
        cut_stages([1, 1], [1, 1], [1, 1, 1], [0, 0, 0])


def test_an_explicit_cut_is_checked():
    assert parse_cut("2,4", 6, 2) == [(0, 2), (2, 6)]
    for bad in ("2,3", "6,0", "1,2,3", "a,b"):
        with pytest.raises(ConfigError, match=r"^dist.pipeline_cut="):
            parse_cut(bad, 6, 2)


def test_plan_shows_the_cut(capsys):
    """`python -m mlxdist.plan` prints the pipeline's cut beside the shard modes: the 1b preset
    (22 blocks: 24 stages) on a Studio and a MacBook: the last rank, which recomputes no forward
    in its backward, takes more stages (10 + 14); with the MacBook at half speed the Studio takes
    more of the stack (14 + 10)."""
    from mlxdist.commands.plan import main

    assert main(["--hosts", "studio=128GB,macbook=16GB", "model.preset=1b"]) == 0
    out = capsys.readouterr().out
    assert ("pipeline (dist.mode=pipeline, 24 stages: embedding, blocks, head): rank 0 (studio) stages 0-9: 6.3 of "
            "108.8 GiB; rank 1 (macbook) stages 10-23: 9.1 of 13.6 GiB") in out, out
    assert main(["--hosts", "studio=128GB,macbook=16GB", "model.preset=1b", "nodes={macbook: {speed: 0.5}}"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 (studio) stages 0-13" in out and "rank 1 (macbook) stages 14-23" in out, out


# ---------------------------------------------------------------- point to point on real ranks
P2P = textwrap.dedent("""
    import sys
    import numpy as np
    from mlxdist.cluster.transport import make_transport, wait_sent
    from mlxdist.cluster.world import init_world

    backend = sys.argv[1]
    world = init_world(backend)
    t = make_transport(world, backend)
    r, n = t.rank, t.size
    # A receive posted before anything is sent, waited for last.
    early = np.empty(2, np.uint16)
    posted = t.post_recv(early, (r - 1) % n, tag=9)
    # Every rank sends to both neighbours before receiving anything (1F1B's crossing sends):
    # nonblocking sends cannot deadlock.
    sent = []
    for step, to in ((1, (r + 1) % n), (-1, (r - 1) % n)):
        buf = np.arange(1000, dtype=np.float32) + 1000 * r + step
        sent.append(t.send(buf, to, tag=5 + step, what="test send"))
    half = np.array([r, r + 1], np.uint16)  # bfloat16 bits travel as they are
    sent.append(t.send(half, (r + 1) % n, tag=9))
    for step, frm in ((1, (r - 1) % n), (-1, (r + 1) % n)):
        got = np.empty(1000, np.float32)
        t.recv(got, frm, tag=5 + step, what="test receive")
        assert np.array_equal(got, np.arange(1000, dtype=np.float32) + 1000 * frm + step), (r, frm)
    posted.wait()
    assert list(early) == [(r - 1) % n, (r - 1) % n + 1]
    wait_sent(sent)
    t.barrier()
    print(f"P2P OK {backend} {n} {type(t).__name__}", flush=True)
""")


@pytest.mark.cluster
@pytest.mark.parametrize("backend, n", [("mpi4py", 2), ("mpi4py", 3), ("mlx-mpi", 2)])
def test_send_and_receive_on_real_ranks(tmp_path: Path, backend: str, n: int) -> None:
    prog = tmp_path / "p2p.py"
    prog.write_text(P2P)
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(n), "-x", "PYTHONPATH",
           "-x", "OPENBLAS_NUM_THREADS", sys.executable, str(prog), backend]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env(), cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count(f"P2P OK {backend} {n}") == n, res.stdout


def test_one_rank_has_no_peer():
    from mlxdist.cluster.transport import Transport

    with pytest.raises(RuntimeError, match="one rank, no peer"):
        Transport().send(np.zeros(1, np.float32), 1)


# ---------------------------------------------------------------- training on real ranks
@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """One process, 5 samples a step in micro-batches of one; checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("pipeline") / "one"
    _ok(_train([*LM, f"train.out_dir={out}"]))
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("n, cut, backend", [(2, "", "auto"), (3, "1,3,2", "auto"), (3, "3,2,1", "auto"),
                                            (2, "4,2", "mlx-ring")])
def test_pipeline_equals_one_process(tmp_path, one_process, n, cut, backend):
    """5 micro-batches a step (3+2 on two ranks, 2+2+1 on three: unequal counts), the cut by
    memory budget or given; clipping active (the norm is several times train.grad_clip); over
    mpi4py and over an MLX transport (its sends go over its mpi4py side)."""
    args = [*LM, "dist.mode=pipeline", f"train.out_dir={tmp_path}", f"dist.backend={backend}"] + (
        [f"dist.pipeline_cut={cut}"] if cut else [])
    r = _ok(_train(args, np_=n))
    assert "pipeline parallelism: 6 model stages cut" in r.stderr, r.stderr[-2000:]
    weights, moments = _same_as(one_process, tmp_path)
    evals = [(e["step"], e["eval_loss"]) for e in _events(tmp_path, "eval")]
    expected = [(e["step"], e["eval_loss"]) for e in _events(one_process, "eval")]
    print(f"pipeline n={n} cut={cut or 'plan'} {backend}: max weight diff {weights:.3g}, moments {moments:.3g}; eval {evals} "
          f"(one process {expected})")
    assert weights <= TOL and moments <= TOL, (weights, moments)
    assert [s for s, _ in evals] == [s for s, _ in expected] == [2, 4]
    assert np.allclose([v for _, v in evals], [v for _, v in expected], rtol=1e-6, atol=0), (evals, expected)


@pytest.mark.cluster
def test_as_many_micro_batches_as_stages(tmp_path):
    """3 micro-batches on 3 stages (the fewest the loop deals: every rank gets a sample): the
    first rank's warm-up takes all but one, the result the same."""
    args = [*FAST, "train.batch_size=1", "train.global_batch=3", "train.grad_clip=0.5", "train.steps=3",
            "dist.sync_weights_every=0"]
    _ok(_train([*args, f"train.out_dir={tmp_path / 'one'}"]))
    _ok(_train([*args, "dist.mode=pipeline", f"train.out_dir={tmp_path / 'pp'}"], np_=3))
    weights, moments = _same_as(tmp_path / "one", tmp_path / "pp")
    assert weights <= TOL and moments <= TOL, (weights, moments)


@pytest.mark.cluster
def test_micro_batches_of_unequal_sizes(tmp_path):
    """11 samples a step in micro-batches of 3 and 1 on each rank (3+1 | 3+1 | 3): activations of
    two shapes, each sent with its header the first time only, the later ones' receives posted
    ahead. Equals data parallel on the same micro-batches (one process cannot split them so)."""
    args = [*FAST, "train.batch_size=3", "train.global_batch=11", "train.grad_clip=0.5", "train.steps=4",
            "train.eval_every=2", "dist.sync_weights_every=0"]
    _ok(_train([*args, f"train.out_dir={tmp_path / 'dp'}"], np_=3))
    r = _ok(_train([*args, "dist.mode=pipeline", f"train.out_dir={tmp_path / 'pp'}"], np_=3))
    assert "shares [4, 4, 3] in micro-batches [3, 3, 3]" in r.stderr, r.stderr[-2000:]
    weights, moments = _same_as(tmp_path / "dp", tmp_path / "pp")
    print(f"unequal micro-batch sizes: max weight diff {weights:.3g} against data parallel, moments {moments:.3g}")
    assert weights <= TOL and moments <= TOL, (weights, moments)


@pytest.mark.cluster
def test_checkpoints_are_whole_and_resume_anywhere(tmp_path, one_process):
    """The pipeline's step-2 checkpoint holds every stage's weights and moments (data parallel's
    format, equal to one process's); it resumes on one process and on a 3-rank pipeline of
    another cut, and one process's resumes on a pipeline: all reach the uninterrupted step 4.
    `generate` loads the pipeline's checkpoint."""
    pp = tmp_path / "pp"
    _ok(_train([*LM, "dist.mode=pipeline", f"train.out_dir={pp}"], np_=2))
    mine, theirs = _saved(pp, 2), _saved(one_process, 2)
    assert mine.optimizer.keys() == theirs.optimizer.keys()
    assert _max_diff(mine.weights, theirs.weights) <= TOL and _max_diff(mine.optimizer, theirs.optimizer) <= TOL
    resumes = {"one": ([], 0, pp), "three": (["dist.mode=pipeline", "dist.pipeline_cut=2,2,2"], 3, pp),
               "from-one": (["dist.mode=pipeline"], 2, one_process)}
    for name, (extra, n, source) in resumes.items():
        out = tmp_path / name
        r = _ok(_train([*LM, *extra, f"train.out_dir={out}", "--resume",
                        str(source / "checkpoints" / "step_00000002")], np_=n))
        assert "resumed from" in r.stderr
        weights, moments = _same_as(one_process, out)
        print(f"resume {name}: max weight diff {weights:.3g}, moments {moments:.3g}")
        assert weights <= TOL and moments <= TOL, (name, weights, moments)
    g = subprocess.run([sys.executable, "-m", "mlxdist.generate", "--checkpoint", str(pp), "--prompt", "ab",
                        "--max-tokens", "5", "--seed", "1"], capture_output=True, text=True, timeout=120, env=env(),
                       cwd=HERE)
    assert g.returncode == 0, g.stderr[-2000:]


@pytest.mark.cluster
def test_a_half_speed_rank_gets_fewer_stages(tmp_path):
    """`nodes:` speed reaches the cut: 10 blocks, rank 1 at half speed runs 5 of the 12 stages (as
    the last rank it recomputes no forward: 4 blocks and the head take it as long as rank 0's
    embedding and 6 blocks)."""
    r = _ok(_train([*FAST, "model.n_layers=10", "train.steps=1", "dist.mode=pipeline", f"train.out_dir={tmp_path}",
                    "dist.measure_stages=false", "nodes={rank0: {batch_size: 1}, rank1: {batch_size: 1, speed: 0.5}}"],
                   np_=2))
    assert ("12 model stages cut by memory budget and speed (1, 0.5): rank 0 7 stages (0-6), rank 1 5 stages "
            "(7-11)") in r.stderr, r.stderr[-2000:]


@pytest.mark.cluster
def test_the_cut_follows_speeds_measured_at_start(tmp_path):
    """Rank 1 computes 3x slower (the rig's compute scale: a slower GPU, CPU free): the forward
    pass every rank times at start reads it, and the cut gives rank 1 fewer of the 12 stages;
    with nodes: speeds given nothing is timed."""
    args = [*FAST, "model.n_layers=10", "train.steps=1", "train.batch_size=1", "dist.mode=pipeline",
            "dist.measure_stages=false"]
    r = run_slowed([*args, f"train.out_dir={tmp_path / 'measured'}"], "1,3")
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"speeds measured at start \(a forward pass of one sample\): rank 0 \(\S+\) ([\d.]+) \([\d.]+ ms\), "
                  r"rank 1 \(\S+\) ([\d.]+) ", r.stderr)
    assert m and float(m.group(1)) == 1 and float(m.group(2)) < 0.6, r.stderr[-3000:]
    cut = re.search(r"cut by memory budget and speed \(1, [\d.]+\): rank 0 (\d+) stages \(0-\d+\), rank 1 (\d+) stages",
                    r.stderr)
    assert cut and int(cut.group(2)) < int(cut.group(1)), r.stderr[-3000:]
    r = run_slowed([*args, f"train.out_dir={tmp_path / 'given'}", "nodes={rank1: {batch_size: 1, speed: 0.5}}"], "1,3")
    assert r.returncode == 0 and "speeds measured" not in r.stderr, r.stderr[-3000:]
    assert "rank 0 7 stages (0-6), rank 1 5 stages (7-11)" in r.stderr, r.stderr[-3000:]


@pytest.mark.cluster
def test_the_cut_weighs_stage_costs_measured_at_start(tmp_path):
    """A vocabulary of 32768 on 128 dims: the embedding and the head hold 4.2M parameters each
    against a block's 0.18M, so counting parameters gives rank 0 the embedding alone; but the
    lookup costs next to nothing and the head's matmul many blocks, which the forward timed at
    start sees: rank 0 gets the blocks."""
    args = [*FAST, "model.vocab_size=32768", "data.seq_len=128", "train.steps=1", "train.batch_size=1",
            "dist.mode=pipeline", "dist.measure_speed=false"]
    counted = _ok(_train([*args, "dist.measure_stages=false", f"train.out_dir={tmp_path / 'counted'}"], np_=2))
    assert "6 model stages cut by memory budget: rank 0 1 stage (0-0), rank 1 5 stages" in counted.stderr, \
        counted.stderr[-2000:]
    assert "stage costs measured" not in counted.stderr
    timed = _ok(_train([*args, f"train.out_dir={tmp_path / 'timed'}"], np_=2))
    line = re.search(r"stage costs measured at start .*?: stage 0 ([\d.]+)%, stages 1-4 ([\d.]+)%-([\d.]+)% each, "
                     r"stage 5 ([\d.]+)% of it", timed.stderr)
    assert line, timed.stderr[-2000:]
    embed, head, block = float(line.group(1)), float(line.group(4)), float(line.group(3))
    assert embed < block < head, line.group(0)
    cut = re.search(r"cut by memory budget and measured stage costs: rank 0 (\d) stages", timed.stderr)
    assert cut and int(cut.group(1)) >= 4, timed.stderr[-2000:]


def test_stage_costs_are_each_ranks_shares_averaged():
    from mlxdist.control.pipeline_cut import stage_costs, stage_costs_line

    costs = stage_costs([[0.1, 0.3, 0.6], [0.2, 0.6, 1.2]])  # rank 1 twice as slow: the same shares
    assert costs == pytest.approx([0.1, 0.3, 0.6])
    assert stage_costs([[1.0, 3.0], [3.0, 1.0]]) == pytest.approx([0.5, 0.5])
    assert "stage 0 10.0%, stage 1 30.0%, stage 2 60.0% of it" in stage_costs_line(costs, [[0.1, 0.3, 0.6]] * 2)


@pytest.mark.cluster
def test_a_tasks_staged_model_trains_in_a_pipeline(tmp_path):
    """A user's MLX model with stages() (three Linear stages, float input: the first stage's
    input gradient is computed and dropped) equals one process."""
    args = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
            "train.schedule=constant", "train.lr=1e-2", "task.factory=user_tasks:mlx_staged_mlp",
            "train.batch_size=1", "train.global_batch=4", "train.grad_clip=0.5", "train.steps=3",
            "dist.sync_weights_every=0"]
    _ok(_train([*args, f"train.out_dir={tmp_path / 'one'}"]))
    _ok(_train([*args, "dist.mode=pipeline", "dist.pipeline_cut=1,2", f"train.out_dir={tmp_path / 'pp'}"], np_=2))
    weights, moments = _same_as(tmp_path / "one", tmp_path / "pp")
    assert weights <= TOL and moments <= TOL, (weights, moments)


@pytest.mark.cluster
def test_a_non_finite_step_is_skipped_on_every_rank(tmp_path):
    """A sample with NaN features: its step's loss is non-finite on the last rank only, and
    every rank skips that update together (the same steps as one process skips; the weights
    after it equal one process's)."""
    args = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
            "train.schedule=constant", "train.lr=1e-2", "task.factory=pipeline_tasks:staged_poisoned",
            "train.batch_size=1", "train.global_batch=4", "train.steps=3", "dist.sync_weights_every=0"]
    _ok(_train([*args, f"train.out_dir={tmp_path / 'one'}"]))
    _ok(_train([*args, "dist.mode=pipeline", f"train.out_dir={tmp_path / 'pp'}"], np_=3))
    skipped = [s["step"] for s in _events(tmp_path / "one", "skipped")]
    assert skipped, "the poisoned sample was never drawn"
    for rank in range(3):
        assert [s["step"] for s in _events(tmp_path / "pp", "skipped", rank)] == skipped, rank
    weights, moments = _same_as(tmp_path / "one", tmp_path / "pp")
    assert weights <= TOL and moments <= TOL, (weights, moments)


@pytest.mark.cluster
def test_a_frozen_stage_is_named_by_its_neighbours(tmp_path):
    """The middle stage of three frozen (SIGSTOP) mid-run: the ranks waiting on it (an activation
    or gradient to or from it, named with the micro-batch and the rank, or a collective of the
    step) are stalled there, and name the frozen rank and only it as the culprit."""
    from test_stall import STALL_S, _rank_pids

    args = [*FAST, "train.steps=100000", "train.batch_size=1", "checkpoint.every=0", "dist.sync_weights_every=0",
            "dist.mode=pipeline", f"dist.stall_timeout_s={STALL_S}", f"train.out_dir={tmp_path}"]
    pids: dict[int, int] = {}
    try:
        with training(args, 3, tmp_path, 3) as proc:
            pids = _rank_pids(proc.pid, 3)
            os.kill(pids[1], signal.SIGSTOP)
            _, err = proc.communicate(timeout=STALL_S * 6 + 30)
    finally:
        for pid in pids.values():  # SIGKILL ends a stopped process too; it may be gone already
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0, err[-3000:]
    stalled = {int(m.group(1)): m.group(2) for m in re.finditer(
        r"mlxdist: rank (\d+) \(.*?\): stalled \d+s in (.*?) \(dist.stall_timeout_s\): ", err)}
    neighbours = {r: what for r, what in stalled.items() if r != 1}
    assert neighbours, err[-3000:]
    for r, what in neighbours.items():
        # A wait on a micro-batch's activation or gradient names the frozen rank; a collective of the
        # step ("gathering the step's micro-batches", a shared weight's owner) is named as such.
        if re.match(r"(activation|gradient) of micro-batch ", what):
            assert re.fullmatch(r"(activation|gradient) of micro-batch \d+ (from|to) rank 1( \(waiting for the peer "
                                r"to take it\))?", what), (r, what)
    lines = [ln for ln in err.splitlines() if re.match(r"mlxdist: rank [02] \(", ln) and "stalled" in ln]
    # The host as the ranks read it at start (the box's name can change under a namespace test).
    assert all(re.search(r"rank 1 \([^)]+\)", ln) for ln in lines), lines


KILLABLE = [*FAST, "train.batch_size=1", "train.global_batch=3", "train.grad_clip=0.5", "train.schedule=constant",
            "train.warmup_steps=0", "checkpoint.every=2", "dist.sync_weights_every=0"]


def _stopped_then_resumed(tmp_path: Path, stop) -> tuple[str, int, float, float]:
    """A 3-rank pipeline stopped by `stop(proc)` once 5 steps are logged; resumed (`--resume
    auto`) on 2 ranks for two more steps; against one process run that far uninterrupted.
    Returns the stopped job's stderr, the step it was resumed from and the two differences."""
    pp = tmp_path / "pp"
    with training([*KILLABLE, "train.steps=100000", "dist.mode=pipeline", f"train.out_dir={pp}"], 3, pp, 5) as proc:
        stop(proc)
        _, err = proc.communicate(timeout=120)
    latest = ckpt.load_latest(pp / "checkpoints")  # verified against its manifest
    assert latest is not None, err[-3000:]
    step = latest.meta.run.step
    end = step + 2
    r = _ok(_train([*KILLABLE, f"train.steps={end}", "dist.mode=pipeline", f"train.out_dir={pp}", "--resume", "auto"],
                   np_=2))
    assert f"resumed from {pp / 'checkpoints' / f'step_{step:08d}'}" in r.stderr, r.stderr[-2000:]
    _ok(_train([*KILLABLE, f"train.steps={end}", f"train.out_dir={tmp_path / 'one'}"]))
    weights, moments = _same_as(tmp_path / "one", pp)
    return err, step, weights, moments


@pytest.mark.cluster
def test_a_killed_stage_ends_the_job_and_nothing_is_lost(tmp_path):
    """The middle stage's rank SIGKILLed mid-run: the job ends non-zero with the dead rank
    named; every checkpoint left verifies, and the latest resumes (on 2 ranks, another cut) to
    the weights one process reaches uninterrupted."""
    from test_stall import _rank_pids

    def kill_rank_1(proc):
        os.kill(_rank_pids(proc.pid, 3)[1], signal.SIGKILL)

    err, step, weights, moments = _stopped_then_resumed(tmp_path, kill_rank_1)
    assert re.search(r"process rank 1 with PID \d+ on node \S+ exited on\s+signal 9", err), err[-3000:]
    assert step >= 2
    for d in sorted((tmp_path / "pp" / "checkpoints").glob("step_*")):
        assert ckpt.load(d) is not None, d
    print(f"killed stage: resumed from step {step}; max weight diff {weights:.3g}, moments {moments:.3g}")
    assert weights <= TOL and moments <= TOL, (weights, moments)


@pytest.mark.cluster
def test_ctrl_c_saves_the_pipeline_at_the_step_it_stops(tmp_path):
    """Ctrl-C (SIGUSR1 to mpirun, which forwards it) to a 3-rank pipeline: every rank stops after
    the same step and the whole model is saved there; it resumes exactly."""
    err, step, weights, moments = _stopped_then_resumed(tmp_path, lambda proc: proc.send_signal(signal.SIGUSR1))
    last = logged_steps(tmp_path / "pp")
    assert step >= 5 and f"stopped by signal after step {step}; continue with --resume auto" in err, err[-3000:]
    assert f"checkpoint: {tmp_path / 'pp' / 'checkpoints' / f'step_{step:08d}'}" in err, err[-3000:]
    print(f"ctrl-c: saved at step {step}; resumed: max weight diff {weights:.3g}, moments {moments:.3g}")
    assert weights <= TOL and moments <= TOL, (weights, moments)
    assert last[-1]["step"] == step + 2


# ---------------------------------------------------------------- refusals, one line each
TASK = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.steps=1"]
REFUSALS = [
    ([*TASK, "task.factory=user_tasks:mlx_mlp"], 1, "dist.mode=pipeline cuts the model's stages, but Sequential has "
                                                    "no stages()"),
    ([*FAST, "dist.shard=weights"], 1, "dist.shard=weights shards data parallel's optimizer; dist.mode=pipeline keeps "
                                       "each rank's own optimizer: set dist.shard=none"),
    ([*FAST, "dist.pipeline_cut=2,2"], 1, "dist.pipeline_cut=2,2: needs 1 positive counts (one per rank) adding up to "
                                          "the model's 6 stages"),
    ([*TASK, "task.factory=user_tasks:mlx_staged_mlp"], 4, "dist.mode=pipeline on 4 ranks: the model has 3 stages "
                                                           "(model.stages()), fewer than the ranks"),
]


@pytest.mark.parametrize("args, n, line", REFUSALS, ids=["no-stages", "shard", "cut", "too-many-ranks"])
def test_refusals_name_the_key_and_what_to_do(tmp_path, args, n, line):
    r = _train([*args, "train.steps=1", "dist.mode=pipeline", f"train.out_dir={tmp_path}"], np_=n if n > 1 else 0)
    assert r.returncode != 0
    assert line in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
