"""A Lightning Trainer on mlxdist (`mlxdist.lightning.MLXDistStrategy`) keeps 3+5 == 8: a small
LightningModule (an MLP, SGD with momentum, a StepLR schedule) trained 4 steps by one process
with a global batch of 8 and by 2 ranks taking 3 and 5 of it ends with the same weights; only
rank 0 logs and checkpoints. The script is tests/yourloop/lightning_script.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mpirun_path, with_mlxdist_lines

HERE = Path(__file__).parent / "yourloop"
SPLIT = "nodes:\n  rank0: {batch_size: 3}\n  rank1: {batch_size: 5}\nmetrics: {port: 0}\n"

needs_lightning = pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None,
                                     reason="pytorch-lightning is not installed (the `lightning` extra)")


def _run(out: Path, modes: str, np_: int = 0, config: Path | None = None) -> tuple[list[dict], str]:
    cmd = [sys.executable, str(HERE / "lightning_script.py"), str(out), "--modes", modes, "--root", str(out.parent)]
    cmd += ["--config", str(config)] if config else []
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH",
               "-x", "OPENBLAS_NUM_THREADS", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=240, cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    views = [json.loads(line.split(" ", 1)[1]) for line in r.stderr.splitlines() if line.startswith("VIEW ")]
    return views, r.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (the plain script without the strategy, timed before and after, and with
    it), then 2 ranks with 3 + 5: both launches once, read by the tests below."""
    base = tmp_path_factory.mktemp("lightning")
    (base / "one").mkdir()
    (base / "two").mkdir()
    split = base / "split.yaml"
    split.write_text(SPLIT)
    one, _ = _run(base / "one" / "w", "plain,samples,tokens,resume,plain")
    two, stderr = _run(base / "two" / "w", "samples,tokens,resume,unseeded", np_=2, config=split)
    return base, one, two, stderr


@needs_lightning
@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["samples", "tokens"])
def test_a_lightning_module_on_3_plus_5_ranks_equals_one_process_with_8(runs, mode):
    """samples: a mean loss, weighed by the batch's size; tokens: a mean over weighted units
    returned with {"loss", "count"}, 2 accumulated micro-batches and gradient clipping."""
    base = runs[0]
    a, b = np.load(base / "one" / f"w-{mode}.npz"), np.load(base / "two" / f"w-{mode}.npz")
    assert a.files == b.files
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files if k != "loss")
    print(f"{mode}: 3+5 against 8, largest weight difference {worst:.1e}")
    assert worst < 1e-5
    assert float(a["loss"]) == pytest.approx(float(b["loss"]), abs=1e-5)


@needs_lightning
@pytest.mark.cluster
def test_a_run_resumed_from_a_checkpoint_only_rank_0_has_ends_as_the_run_that_never_stopped(runs):
    """2 steps, a checkpoint (written by rank 0 only), a fresh model on every rank resuming from
    it mid-epoch (rank 1 given a path it lacks): the 4-step run's weights, on 1 and 2 ranks."""
    base = runs[0]
    straight = np.load(base / "one" / "w-samples.npz")
    for where in ("one", "two"):
        resumed = np.load(base / where / "w-resume.npz")
        assert max(float(np.abs(straight[k] - resumed[k]).max()) for k in straight.files if k != "loss") < 1e-5


@needs_lightning
@pytest.mark.cluster
def test_each_rank_knows_its_place_and_takes_its_share_of_the_batch(runs):
    _, one, two, _ = runs
    assert [(v["mode"], v["world_size"], v["batch"], v["steps"]) for v in one] == [
        ("plain", 1, 8, 4), ("samples", 1, 8, 4), ("tokens", 1, 8, 4), ("resume", 1, None, 4),
        ("plain", 1, 8, 4)]
    for v in two:
        assert (v["global_rank"], v["world_size"], v["is_global_zero"], v["batch"], v["steps"]) == \
            (v["rank"], 2, v["rank"] == 0, None if v["mode"] == "resume" else [3, 5][v["rank"]], 4), v
        assert v["gathered"] == [0.0, 1.0] and v["any"] is True and v["all"] is False  # all_gather, decisions
    assert sorted((v["mode"], v["rank"]) for v in two) == [("resume", 0), ("resume", 1), ("samples", 0),
                                                            ("samples", 1), ("tokens", 0), ("tokens", 1),
                                                            ("unseeded", 0), ("unseeded", 1)]


@needs_lightning
@pytest.mark.cluster
def test_what_the_ranks_cannot_keep_of_a_dataloader_is_one_line_at_start(runs):
    """`shuffle=True` drawn from each rank's own seed: rank 0's order on every rank, said once;
    a last batch of 1 sample on 2 ranks: skipped by both, said once, before the first step."""
    stderr = runs[3]
    order = ("mlxdist.lightning: the training DataLoader's order differs between ranks (a shuffle seeded per "
             "process); every rank uses rank 0's")
    last = ("mlxdist.lightning: the epoch's last batch has 1 sample(s), fewer than the 2 ranks: every rank skips it "
            "(one process would train on it)")
    assert stderr.count(order) == 1 and stderr.count(last) == 1


@needs_lightning
@pytest.mark.cluster
def test_only_rank_0_logs_and_writes_checkpoints(runs):
    base, _, _, stderr = runs
    two = base / "two"
    for i, mode in enumerate(["samples", "tokens"]):
        assert not (two / f"{i}-{mode}" / "rank1").exists()
        files = sorted(p.relative_to(two / f"{i}-{mode}" / "rank0").as_posix()
                       for p in (two / f"{i}-{mode}" / "rank0").rglob("*") if p.is_file())
        assert files == ["lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt",
                         "lightning_logs/version_0/metrics.csv"], files
        assert "train_loss" in (two / f"{i}-{mode}" / "rank0" / "lightning_logs/version_0/metrics.csv").read_text()
    assert stderr.count("GPU available:") == 5  # once per Trainer (5 in that launch): rank 0's


@needs_lightning
@pytest.mark.cluster
def test_the_strategy_s_overhead_on_one_rank_is_reported(runs):
    """Not asserted: the seconds of `fit` (4 steps) for the plain script and with the strategy."""
    _, one, two, _ = runs
    plain = min(v["seconds"] for v in one if v["mode"] == "plain")
    ours = next(v["seconds"] for v in one if v["mode"] == "samples")
    ranks = max(v["seconds"] for v in two if v["mode"] == "samples")
    print(f"fit, 4 steps: plain Lightning {plain:.3f} s, MLXDistStrategy on 1 rank {ours:.3f} s "
          f"({ours - plain:+.3f} s), on 2 ranks (3+5, one machine) {ranks:.3f} s")


def test_lightning_s_reduce_ops_map_to_mlxdist_s():
    from mlxdist.integrations.lightning import _op

    assert [_op(x) for x in (None, "mean", "avg", "sum", "max", "min")] == ["mean", "mean", "mean", "sum", "max",
                                                                             "min"]
    with pytest.raises(ValueError, match="reduce_op"):
        _op("product")


# -- a public script: Lightning's own examples/pytorch/basics/transformer.py ---------------------

PUBLIC = Path(__file__).parent / "public" / "lightning_transformer"
PUBLIC_ENV = {"OMP_NUM_THREADS": "1", "PL_TRAINER_MAX_STEPS": "5", "PL_TRAINER_LIMIT_VAL_BATCHES": "2",
              "PL_TRAINER_LIMIT_TEST_BATCHES": "2"}


def _wikitext(folder: Path) -> None:
    """data/wikitext-2.txt, where the demo's WikiText2 looks before it downloads: 14170 lines of
    9 words (30 words, <eos> each line), 4047 blocks of 35 tokens; the script keeps 2000 + 2000
    for validation and test, leaving 47 to train on: batches of 20, 20 and 7 an epoch."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(30)]
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "wikitext-2.txt").write_text("".join(" ".join(rng.choice(words, 9)) + "\n"
                                                            for _ in range(14170)))


def _public(folder: Path, *runs: str, np_: int = 0, config: Path | None = None) -> None:
    """run.py --no-dropout SCRIPT:OUT ... in `folder`, on one process or under mpirun."""
    cmd = [sys.executable, str(PUBLIC / "run.py"), "--no-dropout",
           *[f"{script}:{folder / out}" for script, out in (r.rsplit(":", 1) for r in runs)]]
    extra = PUBLIC_ENV | ({"MLXDIST_CONFIG": str(config)} if config else {})
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH",
               "-x", "OPENBLAS_NUM_THREADS", *[x for k in extra for x in ("-x", k)], *cmd]
    # torch with its own BLAS, as a torch user runs it: the suite preloads OpenBLAS for MLX, and
    # under it this model's weights differ by 1.6e-5 between two BLAS builds of the same plain run.
    e = {k: v for k, v in env().items() if k != "LD_PRELOAD"} | extra
    r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=240, cwd=folder)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def public(tmp_path_factory) -> Path:
    """The script with `shuffle=False` as plain Lightning and with the strategy, one after the
    other in one process, then with the strategy on 2 ranks (3:5): 5 steps, 2 epochs, dropout 0
    (a mask drawn per rank is not one process's)."""
    base = tmp_path_factory.mktemp("lightning_public")
    _wikitext(base)
    (base / "split.yaml").write_text(SPLIT)
    ours = with_mlxdist_lines(PUBLIC / "transformer.py", base / "patched")
    _public(base, f"{PUBLIC / 'transformer.py'}:plain", f"{ours}:one")
    _public(base, f"{ours}:two", np_=2, config=base / "split.yaml")
    return base


def _largest_difference(a: Path, b: Path) -> float:
    x, y = np.load(a), np.load(b)
    assert x.files == y.files
    return max(float(np.abs(x[k] - y[k]).max()) for k in x.files)


def _steps(path: Path) -> list[dict]:
    return json.loads(path.read_text())["steps"]


@needs_lightning
@pytest.mark.cluster
def test_the_public_transformer_script_on_one_process_is_plain_lightning(public):
    """Its DataLoader kept: `shuffle=False`, the epoch's last batch of 7, the same 5 steps and
    the same progress-bar loss, bit for bit: on one rank with one micro-batch a step the
    strategy runs plain Lightning's own ops (the loss is not weighed by its 20 units and the
    gradient divided back, which rounds twice more in fp32). Before that, the two runs differed
    by rounding alone, amplified by 5 steps of SGD at lr 0.1, and by how much depended on the
    CPU's kernels, not on anything the test can see: 2.4e-7 with torch's AVX2 kernels, 7.4e-7
    with AVX-512 (this box), 2.8e-6 with MKL_CBWR=COMPATIBLE, 6.1e-6 with
    ATEN_CPU_CAPABILITY=default; a fresh machine of CI's kind gave 2.7e-6 against a 1e-6 bound.
    Equal ops are equal on every CPU."""
    worst = _largest_difference(public / "plain.npz", public / "one.npz")
    print(f"transformer.py, 1 process: strategy against plain Lightning, largest weight difference {worst:.1e}")
    assert worst == 0.0
    plain, ours = _steps(public / "plain-rank0.json"), _steps(public / "one-rank0.json")
    assert [s["batch"] for s in ours] == [s["batch"] for s in plain] == [20, 20, 7, 20, 20]
    assert [s["progress_bar_loss"] for s in ours] == [s["progress_bar_loss"] for s in plain]


# Two ranks against one process: each rank sums its own 8 or 12 samples' gradients (and its
# loss) in fp32, so the cluster's sum is the one process's in another order, rounded
# differently; 5 steps of SGD at lr 0.1 amplify that. Measured between plain Lightning and 2
# ranks on one machine, over the CPU kernels a machine of one kind may pick (torch AVX2,
# AVX-512, ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE) and 1 or 2 torch threads: weights
# 2.4e-7 to 4.6e-6 apart, the progress bar's loss 2.4e-7 (one ulp) at the first step (the
# weights still equal: the loss's own sum) and up to 3.7e-5 by the fifth. The bounds leave 4x
# or more over the worst of those; what they are there to catch is far above them: ranks weighed
# equally instead of by their samples (8 + 12 as 10 + 10) moves the weights by 7.8e-4 and the
# second step's loss by 1.4e-3, and dropping the last batch of 7 moved the weights by 9.8e-4.
RANKS_WEIGHTS_ATOL = 2e-5
RANKS_FIRST_LOSS_ATOL = 2e-6  # 8 fp32 ulps at a loss of 3.5
RANKS_LOSS_ATOL = 1.5e-4


@needs_lightning
@pytest.mark.cluster
def test_the_public_transformer_script_on_2_ranks_equals_plain_lightning_on_one(public):
    """Each batch of 20 split 8 + 12 (3:5; the last, 7: 3 + 4); the progress bar's loss is the
    cluster's on both ranks, not rank 0's own. Equal to fp32 reduction order (the bounds above)."""
    worst = _largest_difference(public / "plain.npz", public / "two.npz")
    print(f"transformer.py, 2 ranks (3:5) against 1 process: largest weight difference {worst:.1e}")
    assert worst < RANKS_WEIGHTS_ATOL
    one = _steps(public / "plain-rank0.json")
    r0, r1 = _steps(public / "two-rank0.json"), _steps(public / "two-rank1.json")
    assert [s["batch"] for s in r0] == [8, 8, 3, 8, 8] and [s["batch"] for s in r1] == [12, 12, 4, 12, 12]
    plain = np.array([s["progress_bar_loss"] for s in one])
    for rank in (r0, r1):
        loss = np.array([s["progress_bar_loss"] for s in rank])
        assert abs(loss[0] - plain[0]) <= RANKS_FIRST_LOSS_ATOL, (loss, plain)
        assert np.abs(loss - plain).max() <= RANKS_LOSS_ATOL, (loss, plain)


def test_each_batch_splits_by_the_ranks_weights_and_a_batch_smaller_than_the_ranks_leaves_some_none():
    """The split under both integrations (mlxdist/integrations/_batches.py): 3:5 weights."""
    from mlxdist.integrations._batches import split_batch

    assert [split_batch(20, [3.0, 5.0], r) for r in (0, 1)] == [(0, 8), (8, 20)]
    assert [split_batch(7, [3.0, 5.0], r) for r in (0, 1)] == [(0, 3), (3, 7)]
    assert [split_batch(8, [1.0, 1.0, 1.0], r) for r in (0, 1, 2)] == [(0, 3), (3, 6), (6, 8)]
    assert sorted(split_batch(1, [3.0, 5.0], r)[1] - split_batch(1, [3.0, 5.0], r)[0] for r in (0, 1)) == [0, 1]
