"""A compiled MLX step holds its gradient sum (issue 43): `md.average_gradients` inside
`mx.compile`, as mlx-lm and mlx-examples write their steps, keeps 3+5 == 8 on real mpirun
ranks; the mpi4py backend, which sums on the host, refuses it in one line; and
`md.DistributedSampler` gives each rank its rows of every global batch.

The public script is mlx-examples' `transformer_lm/main.py`, vendored in
tests/public/mlx_transformer_lm/ with the lines marked `# md` (its README gives the diff)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mpirun_path

HERE = Path(__file__).parent
LM = HERE / "public" / "mlx_transformer_lm"
SPLIT = "nodes:\n  rank0: {batch_size: 3}\n  rank1: {batch_size: 5}\n"
# A tiny model, 4 iterations (the first at learning rate 0: its warmup starts at 0).
LM_ARGS = ["--context_size", "16", "--num_blocks", "1", "--dim", "32", "--num_heads", "2", "--batch_size", "8",
           "--num_iters", "4", "--lr_warmup", "1", "--learning_rate", "1e-3", "--steps_per_report", "2"]


def _mpirun(np_: int, names: list[str]) -> list[str]:
    return [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
            *[x for name in ["PYTHONPATH", "OPENBLAS_NUM_THREADS", *names] for x in ("-x", name)]]


def _tiny_ptb(root: Path) -> Path:
    """PTB's three files, made up: 40 words, 120 training lines (the script would download PTB)."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    (root / "ptb").mkdir(parents=True)
    for name, lines in (("train", 120), ("valid", 10), ("test", 10)):
        text = "\n".join(" ".join(rng.choice(words, size=int(rng.integers(5, 15)))) for _ in range(lines))
        (root / "ptb" / f"ptb.{name}.txt").write_text(text + "\n")
    return root


@pytest.fixture(scope="module")
def transformer_lm(tmp_path_factory) -> Path:
    """main.py as 1 process with batches of 8, then as 2 ranks with 3+5 (PYTHONHASHSEED fixed:
    its vocabulary comes from a set, PLATFORM_NOTES)."""
    d = tmp_path_factory.mktemp("transformer-lm")
    (d / "split.yaml").write_text(SPLIT)
    e = env() | {"PTB_DIR": str(_tiny_ptb(d / "data")), "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "main.py", *LM_ARGS]
    one = subprocess.run(cmd, capture_output=True, text=True, cwd=LM, timeout=300,
                         env=e | {"MLXDIST_SAVE": str(d / "one.npz")})
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([*_mpirun(2, ["PTB_DIR", "PYTHONHASHSEED", "MLXDIST_SAVE", "MLXDIST_CONFIG"]), *cmd],
                         capture_output=True, text=True, cwd=LM, timeout=300,
                         env=e | {"MLXDIST_SAVE": str(d / "two.npz"), "MLXDIST_CONFIG": str(d / "split.yaml")})
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    (d / "two.out").write_text(two.stdout)
    return d


def _worst(a: Path, b: Path) -> float:
    x, y = np.load(a), np.load(b)
    assert x.files == y.files and x.files
    return max(float(np.abs(x[k] - y[k]).max()) for k in x.files)


@pytest.mark.cluster
def test_mlx_examples_transformer_lm_compiled_on_3_plus_5_ranks_equals_one_process_with_8(transformer_lm):
    out = (transformer_lm / "two.out").read_text()
    assert out.count("Iter 4: Train loss") == 2, out  # both ranks ran all 4 compiled steps
    assert _worst(transformer_lm / "one.npz", transformer_lm / "two.npz") < 2e-6  # measured 2.4e-7


def _loop(args: list[str], np_: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(HERE / "yourloop" / "mlx_loop.py"), *args]
    return subprocess.run([*_mpirun(np_, []), *cmd] if np_ else cmd, capture_output=True, text=True,
                          env=env(), cwd=HERE / "yourloop", timeout=180)


@pytest.mark.cluster
def test_a_compiled_step_on_mlx_ring_keeps_3_plus_5_equal_8(tmp_path):
    """MLX's own ring backend (every collective MLX's) holds the sum in the compiled graph too."""
    (tmp_path / "split.yaml").write_text(SPLIT)
    one = _loop([str(tmp_path / "one.npz"), "--compile"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _loop([str(tmp_path / "two.npz"), "--compile", "--backend", "mlx-ring", "--config",
                 str(tmp_path / "split.yaml")], np_=2)
    assert two.returncode == 0, two.stderr[-2000:]
    assert _worst(tmp_path / "one.npz", tmp_path / "two.npz") < 1e-5


@pytest.mark.cluster
def test_a_script_that_started_mpi4py_first_still_sums_in_the_graph_over_mlx_ring():
    """MLX's mpi backend cannot start MPI a second time: `auto` takes MLX's ring there."""
    code = ("from mpi4py import MPI; from functools import partial; import mlx.core as mx; "
            "import mlxdist.mlx as md; i = md.init(); n = 3 + 2 * i.rank; "
            "f = mx.compile(lambda g: md.average_gradients({'w': g}, count=n)['w']); "
            "out = f(mx.full((4,), float(i.rank + 1))); mx.eval(out); "
            "print(i.rank, md._SYNC['backend'], out.tolist())")
    r = subprocess.run([*_mpirun(2, []), sys.executable, "-c", code], capture_output=True, text=True, env=env(),
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # (3 * 1 + 5 * 2) / 8: each rank's mean gradient weighed by its count
    assert sorted(r.stdout.splitlines()) == [f"{k} mpi4py+mlx-ring [1.625, 1.625, 1.625, 1.625]" for k in (0, 1)]


def test_a_compiled_step_on_the_mpi4py_backend_is_refused_in_one_line_on_one_process(tmp_path):
    """mpi4py sums on the host, which a traced step cannot reach: the first call says so and
    how to fix it, on one process too (so a script tried alone fails as it would on N)."""
    r = _loop([str(tmp_path / "x.npz"), "--compile", "--backend", "mpi4py", "--steps", "1"])
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: mlxdist.mlx.average_gradients: called inside mx.compile (or vmap), where the mpi4py backend "
        "cannot sum (it sums on the host, outside MLX's graph): use md.init(backend='auto') or "
        "'mlx-mpi'/'mlx-ring', or call it outside the compiled function"], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x.npz").exists()


# -- the sampler -------------------------------------------------------------------------


def test_the_ranks_rows_cover_each_global_batch_once_in_the_stream_order():
    from mlxdist.data.sampler import GlobalSampler
    from mlxdist.yourloop.session import RankSampler

    ranks = [RankSampler(100, 8, [3, 5], r, seed=7) for r in (0, 1)]
    assert [s.batch_size for s in ranks] == [3, 5]
    for step in (0, 1, 11, 25):  # 12 batches an epoch of 100 rows: 25 starts the third epoch
        rows = np.concatenate([s.indices(step) for s in ranks])
        assert rows.tolist() == np.asarray(GlobalSampler(100, 7).indices(step * 8, 8)).tolist()
        assert len(set(rows.tolist())) == 8
    epoch = np.concatenate([np.concatenate([s.indices(k) for s in ranks]) for k in range(12)])
    assert len(set(epoch.tolist())) == 96  # no row twice within an epoch


def test_the_same_seed_and_step_give_the_same_rows_whatever_the_split_and_after_a_resume():
    from mlxdist.yourloop.session import RankSampler

    alone = RankSampler(100, 8, [8], 0, seed=3)
    split = [RankSampler(100, 8, [2, 6], r, seed=3) for r in (0, 1)]
    for step in range(5):
        assert alone.indices(step).tolist() == np.concatenate([s.indices(step) for s in split]).tolist()
    resumed = RankSampler(100, 8, [8], 0, seed=3, start_step=4)
    assert list(resumed.epoch_steps()) == list(range(4, 12))
    assert RankSampler(100, 8, [8], 0, seed=4).indices(0).tolist() != alone.indices(0).tolist()


def test_md_distributed_sampler_gives_one_index_array_per_global_batch(tmp_path):
    code = ("import mlxdist.mlx as md, numpy as np; md.init(); s = md.DistributedSampler(20, 8, seed=1); "
            "b = list(s); print(len(s), len(b), [len(x) for x in b], len(set(np.concatenate(b).tolist()))); "
            "md.DistributedSampler(5, 8)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=60)
    assert r.stdout.split("\n")[0] == "2 2 [8, 8] 16", r.stdout + r.stderr
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: mlxdist.mlx.DistributedSampler: 5 samples make no global batch of 8; "
        "give a global batch between 1 and the number of samples"), r.stderr
