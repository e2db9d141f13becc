"""Your own loop gets the trainer's promises (issue 51): a resumed sampler sees exactly the
batches of a run never stopped, in every later epoch too; `mlxdist.mlx.init()` reads
$MLXDIST_CONFIG as `mlxdist.torch.init()` does and each rank says its share; BatchNorm's running
statistics are kept equal across ranks (by rows, as the trainer keeps them) in both APIs and a
checkpoint names a rank that drifted; a DDP script's `loss / accum` given to `backward(loss,
count)` is refused in one line naming the factor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mpirun_path

from mlxdist.yourloop.session import RankSampler

HERE = Path(__file__).parent / "yourloop"
SPLIT = "nodes:\n  rank0: {batch_size: 3}\n  rank1: {batch_size: 5}\n"


def _batches(n: int, global_batch: int, shares: list[int], start: int, epochs: int) -> list[list[int]]:
    """Every rank's rows of each global batch a loop over `epochs` epochs sees from `start`."""
    samplers = [RankSampler(n, global_batch, shares, r, 7, start, "test") for r in range(len(shares))]
    out = []
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        for step in samplers[0].epoch_steps():
            assert all(step in s.epoch_steps() for s in samplers)
            out.append([i for s in samplers for i in s.indices(step).tolist()])
    return out


@pytest.mark.parametrize("shares", [[8], [3, 5]])
@pytest.mark.parametrize("stop", [0, 1, 4, 5, 7, 9, 14])
def test_a_resumed_sampler_sees_exactly_the_batches_of_a_run_never_stopped(shares, stop):
    """40 samples, global batch 8: 5 steps an epoch, three epochs; stopped after `stop` steps."""
    whole = _batches(40, 8, shares, 0, 3)
    assert len(whole) == 15
    resumed = _batches(40, 8, shares, stop, 3)
    assert resumed == whole[stop:]
    assert all(sorted(b) == sorted(set(b)) for b in whole)


def test_both_samplers_iterate_the_resumed_epochs_whole(monkeypatch):
    import mlxdist.mlx as mmd
    import mlxdist.torch as tmd

    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "MLXDIST_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    tmd.init(device="cpu")
    for sampler_cls, flat in ((tmd.DistributedSampler, True), (mmd.DistributedSampler, False)):
        never = sampler_cls(40, 8, seed=3)
        resumed = sampler_cls(40, 8, seed=3, start_step=7)
        seen_never, seen_resumed = [], []
        for epoch in range(3):
            never.set_epoch(epoch)
            resumed.set_epoch(epoch)
            a, b = list(never), list(resumed)
            seen_never += a if flat else [i for x in a for i in x.tolist()]
            seen_resumed += b if flat else [i for x in b for i in x.tolist()]
            assert len(b) == (0 if epoch == 0 else (3 * 8 if epoch == 1 else 5 * 8)) // (1 if flat else 8)
        assert seen_resumed == seen_never[7 * 8:]


def _run(args, np_=0, timeout=180, extra_env=None):
    cmd = [sys.executable, str(HERE / "bn_loop.py"), *map(str, args)]
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH",
               "-x", "OPENBLAS_NUM_THREADS", *[x for k in (extra_env or {}) for x in ("-x", k)], *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env() | (extra_env or {}), timeout=timeout,
                          cwd=HERE)


@pytest.mark.cluster
@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_init_reads_mlxdist_config_and_each_rank_says_its_share(tmp_path, framework):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(SPLIT)
    r = _run([tmp_path / "s", "--framework", framework, "--shares-only"], np_=2, extra_env={"MLXDIST_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr[-2000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"s-{rank}.json").read_text())["shares"] == [3, 5]
    lines = [ln for ln in r.stderr.splitlines() if f"mlxdist.{framework}: rank" in ln]
    assert len(lines) == 2, r.stderr[-2000:]
    assert any("rank 0/2 on " in ln and f": 3 of every 8 rows of a global batch (nodes: in {cfg})" in ln for ln in lines)
    assert any("rank 1/2 on " in ln and f": 5 of every 8 rows of a global batch (nodes: in {cfg})" in ln for ln in lines)


@pytest.mark.cluster
@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_running_statistics_are_kept_equal_by_rows_and_a_drifted_rank_is_named(tmp_path, framework):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(SPLIT)
    split = {"MLXDIST_CONFIG": str(cfg)}
    for steps in (1, 4):
        two = _run([tmp_path / f"two{steps}", "--framework", framework, "--steps", steps], np_=2, extra_env=split)
        assert two.returncode == 0, two.stderr[-2000:]
        r0, r1 = (json.loads((tmp_path / f"two{steps}-{r}.json").read_text()) for r in (0, 1))
        assert [k for k in r0 if k.endswith("running_mean")], r0
        for k in r0:
            np.testing.assert_array_equal(r0[k], r1[k])  # the ranks agree, step after step
    # After one step (each rank normalised its own rows, so later weights differ from one
    # process's), the running mean by rows is what one process with all 8 rows holds.
    one = _run([tmp_path / "one", "--framework", framework, "--steps", 1])
    assert one.returncode == 0, one.stderr[-2000:]
    ref, r0 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one-0", "two1-0"))
    for k in (k for k in ref if k.endswith("running_mean")):
        np.testing.assert_allclose(r0[k], ref[k], atol=1e-6)
    drift = _run([tmp_path / "d", "--framework", framework, "--drift", "--run-dir", tmp_path / "run"], np_=2,
                 extra_env={"MLXDIST_CONFIG": str(cfg)})
    assert drift.returncode == 0, drift.stderr[-2000:]
    assert f"mlxdist.{framework}.save_checkpoint: step 4: rank 1's " in drift.stderr, drift.stderr[-2000:]
    assert "running_mean differs from rank 0's" in drift.stderr
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["loop_state"]["ranks_equal"] is False


ACCUM = """
import torch
import mlxdist.torch as md

md.init(device="cpu")
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = md.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
accum = 2
x, y = torch.randn(8, 3), torch.randn(8, 1)
for micro in range(accum):
    part = slice(micro * 4, micro * 4 + 4)
    loss = torch.nn.functional.mse_loss(model(x[part]), y[part]) / accum   # as DDP scripts write it
    if micro < accum - 1:
        with opt.no_sync():
            opt.backward(loss, count=4)
    else:
        opt.backward(loss, count=4)
opt.step()
print("stepped")
"""


def test_a_loss_divided_by_the_micro_steps_given_to_backward_is_refused_in_one_line(tmp_path):
    script = tmp_path / "accum.py"
    script.write_text(ACCUM)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "stepped" not in r.stdout and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: mlxdist.torch.DistributedOptimizer.backward: each of this step's 2 losses was "
                           "divided by 2"), line
    assert "drop the '/ 2'" in line and "optimizer.synchronize(count=" in line
    fixed = script.read_text().replace(" / accum   # as DDP scripts write it", "")
    script.write_text(fixed)
    ok = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env(), timeout=120)
    assert ok.returncode == 0 and "stepped" in ok.stdout, ok.stderr
