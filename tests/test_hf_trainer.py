"""A Hugging Face Trainer + PEFT LoRA script on mlxdist (`from mlxdist.hf import Trainer`, its one
`# md` line): 3 + 5 samples on two ranks train exactly like one process with 8, only rank 0
writes, and a resumed run equals the uninterrupted one.

Each rank of a two-rank run works in a folder of its own (an Open MPI app context each, with its
own working directory), as two Macs without a shared disk: rank 1 must write nothing there, and
resuming from a checkpoint only rank 0 has sends it to rank 1."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mpirun_path

for _name in ("torch", "transformers", "peft", "accelerate"):
    pytest.importorskip(_name, reason="needs the hf extra (and accelerate): pip install -e '.[hf]' accelerate")

SCRIPT = Path(__file__).parent / "yourloop" / "hf_script.py"
SPLIT = "nodes:\n  rank0: {batch_size: 3}\n  rank1: {batch_size: 5}\n"


def _one(cwd: Path, *args) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=env() | {"OMP_NUM_THREADS": "1"}, timeout=180, cwd=cwd)


def _two(base: Path, config: Path, *args) -> subprocess.CompletedProcess:
    """Rank 0 in base/rank0, rank 1 in base/rank1; the same command on both."""
    app = [sys.executable, str(SCRIPT), *map(str, args)]
    for r in (0, 1):
        (base / f"rank{r}").mkdir(parents=True, exist_ok=True)
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS",
           "-x", "OMP_NUM_THREADS", "-x", "MLXDIST_CONFIG",
           "-np", "1", "--wdir", str(base / "rank0"), *app, ":", "-np", "1", "--wdir", str(base / "rank1"), *app]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env=env() | {"OMP_NUM_THREADS": "1", "MLXDIST_CONFIG": str(config)})


def _worst(a: Path, b: Path) -> float:
    x, y = np.load(a), np.load(b)
    assert x.files == y.files and len(x.files) > 2
    return max(float(np.abs(x[k] - y[k]).max()) for k in x.files if k not in ("loss", "grad_norm"))


# Two micro-batches of 8 a step (3 + 5 on two ranks), SGD with momentum, clipped to 0.05 (of ~0.4).
# AdamW would do as well but for its first steps' sign-like updates, which turn float noise in
# near-zero gradients (summed in another order) into differences of ~1e-4.
TRAIN = ["--seed-by-rank", "--accum", "2", "--optim", "sgd", "--optim-args", "momentum=0.9", "--lr", "0.5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One process with batch 8, and two ranks with 3 + 5 saving a checkpoint every step."""
    base = tmp_path_factory.mktemp("hf")
    (base / "split.yaml").write_text(SPLIT)
    one = _one(base / "one", "out", *TRAIN)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _two(base / "two", base / "split.yaml", "out", "--save-steps", "1", *TRAIN)
    assert two.returncode == 0, two.stderr[-3000:]
    (base / "two.log").write_text(two.stdout + two.stderr)
    return base


@pytest.mark.cluster
def test_a_trainer_on_3_plus_5_ranks_equals_one_process_with_8(runs):
    one, two = runs / "one" / "out" / "final.npz", runs / "two" / "rank0" / "out" / "final.npz"
    assert _worst(one, two) < 1e-5
    x, y = np.load(one), np.load(two)
    assert max(float(np.abs(x[k]).max()) for k in x.files if "lora_B" in k) > 2e-3  # it learned (B starts at 0)
    assert len(x["loss"]) == 4 and np.allclose(x["loss"], y["loss"], atol=1e-5)  # the cluster's loss is logged
    assert np.allclose(x["grad_norm"], y["grad_norm"], atol=1e-6) and min(x["grad_norm"]) > 0.05  # clipped after the sum
    log = (runs / "two.log").read_text()
    assert log.count("{'loss': ") == 4  # rank 0 logs, rank 1 does not
    assert "tensors differed between ranks; every rank has rank 0's now" in log  # --seed-by-rank


@pytest.mark.cluster
def test_only_rank_0_writes_and_keeps_save_total_limit(runs):
    assert sorted(p.name for p in (runs / "two" / "rank0" / "out").iterdir()) == \
        ["checkpoint-3", "checkpoint-4", "final.npz"]
    assert not (runs / "two" / "rank1" / "out").exists()


@pytest.mark.cluster
def test_resuming_from_rank_0_s_checkpoint_equals_the_uninterrupted_run(runs):
    base = runs / "two"
    stale = base / "rank1" / "out" / "checkpoint-3"  # another run's, on rank 1's own disk: replaced
    shutil.copytree(base / "rank0" / "out" / "checkpoint-4", stale)
    (stale / "stale.txt").write_text("x")
    r = _two(base, runs / "split.yaml", "resumed", "--resume", "out/checkpoint-3", *TRAIN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mlxdist.hf: sending checkpoint out/checkpoint-3 to rank(s) 1" in r.stderr
    assert sorted(p.name for p in stale.iterdir()) == sorted(p.name for p in (base / "rank0" / "out" /
                                                                               "checkpoint-3").iterdir())
    assert (stale / "trainer_state.json").read_text() == \
        (base / "rank0" / "out" / "checkpoint-3" / "trainer_state.json").read_text()
    assert _worst(base / "rank0" / "out" / "final.npz", base / "rank0" / "resumed" / "final.npz") < 1e-6
    assert not (base / "rank1" / "resumed").exists()
