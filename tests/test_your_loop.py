"""Your loop on mlxdist: a plain PyTorch script (`mlxdist.torch`) and a plain MLX script
(`mlxdist.mlx`), started the way their authors start them (python, or mpirun), keep 3+5 == 8.
The scripts are in tests/yourloop/; the lines they change for mlxdist are marked `# md`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mpirun_path

HERE = Path(__file__).parent / "yourloop"
SPLIT = "nodes:\n  rank0: {batch_size: 3}\n  rank1: {batch_size: 5}\n"


def _run(script, args, np_=0, extra_env=None, timeout=180):
    cmd = [sys.executable, str(HERE / script), *map(str, args)]
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH",
               "-x", "OPENBLAS_NUM_THREADS", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env() | (extra_env or {}), timeout=timeout,
                          cwd=HERE)


def _worst(a: Path, b: Path) -> float:
    x, y = np.load(a), np.load(b)
    assert x.files == y.files
    return max(float(np.abs(x[k] - y[k]).max()) for k in x.files if k != "loss")


@pytest.fixture
def split(tmp_path) -> Path:
    path = tmp_path / "split.yaml"
    path.write_text(SPLIT)
    return path


MODES = ["backward", "step", "accum", "adamw"]


@pytest.fixture(scope="module")
def torch_loops(tmp_path_factory) -> Path:
    """torch_loop.py in every mode, each from scratch: one process with 8, then 2 ranks with 3+5;
    one launch each (the same weights, bit for bit, as a launch per mode)."""
    d = tmp_path_factory.mktemp("torch-loop")
    (d / "split.yaml").write_text(SPLIT)
    modes = ["--mode", ",".join(MODES), "--seed-by-rank"]
    one = _run("torch_loop.py", [d / "one", *modes])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _run("torch_loop.py", [d / "two", "--config", d / "split.yaml", *modes], np_=2)
    assert two.returncode == 0, two.stderr[-2000:]
    (d / "two.log").write_text(two.stderr)
    return d


@pytest.mark.cluster
@pytest.mark.parametrize("mode", MODES)
def test_a_torch_loop_on_3_plus_5_ranks_equals_one_process_with_8(torch_loops, mode):
    one, two = torch_loops / f"one-{mode}.npz", torch_loops / f"two-{mode}.npz"
    log = (torch_loops / "two.log").read_text()  # each mode ends with its line on each rank
    assert log.count("rank 0: done after 4 steps, batch 3") == log.count("rank 1: done after 4 steps, batch 5") \
        == len(MODES), log[-2000:]
    assert _worst(one, two) < 1e-5
    assert float(np.load(one)["loss"]) == pytest.approx(float(np.load(two)["loss"]), abs=1e-5)


def _by_hand_adamw(steps: int = 4) -> dict[str, np.ndarray]:
    """torch_loop.py's `adamw` mode in one process, each global batch's gradient made by hand
    as (3 g_rows_0:3 + 5 g_rows_3:8) / 8: the arithmetic 3+5 ranks do, in the order they do it."""
    import torch
    import torch.nn.functional as F

    from mlxdist.yourloop.session import sample_order

    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(256, 8)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 3, size=256))
    torch.manual_seed(1000)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        opt.zero_grad()
        for begin, end in ((0, 3), (3, 8)):
            rows = torch.as_tensor(sample_order(len(x), 0, step * 8 + begin, end - begin))
            (F.cross_entropy(model(x[rows]), y[rows]) * (end - begin)).backward()
        for p in model.parameters():
            p.grad.div_(8)
        opt.step()
        sched.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.cluster
def test_adamw_at_lr_1e_3_on_3_plus_5_ranks_is_the_by_hand_weighted_gradient(torch_loops):
    """AdamW divides by each gradient's own size, so near-zero gradients show the last bits of a
    sum taken in another order: 3+5 ranks differ from one process with 8 by more than SGD does.
    Against the same weighted sum made by hand in one process they are equal: that floor is
    AdamW's, not mlxdist's (docs/your-loop.md quotes these numbers)."""
    ref = _by_hand_adamw()
    one, two = np.load(torch_loops / "one-adamw.npz"), np.load(torch_loops / "two-adamw.npz")
    worst = {name: max(float(np.abs(run[k] - ref[k]).max()) for k in ref) for name, run in (("one", one), ("two", two))}
    print(f"adamw lr 1e-3, largest weight difference from the by-hand reference: {worst}")
    assert worst["two"] < 1e-7, worst
    assert worst["one"] < 1e-4, worst


@pytest.mark.cluster
def test_an_mlx_loop_on_3_plus_5_ranks_equals_one_process_with_8(tmp_path, split):
    one = _run("mlx_loop.py", [tmp_path / "one.npz"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _run("mlx_loop.py", [tmp_path / "two.npz", "--config", split], np_=2)
    assert two.returncode == 0, two.stderr[-2000:]
    assert _worst(tmp_path / "one.npz", tmp_path / "two.npz") < 1e-5


@pytest.mark.cluster
def test_a_model_of_another_shape_on_one_rank_is_one_line_naming_it(tmp_path):
    r = _run("mlx_loop.py", [tmp_path / "x.npz", "--wide-on-rank1"], np_=2)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: mlxdist.mlx.broadcast: the model on rank 1 (" + lines[0].split("(", 1)[1]], r.stderr
    assert "layers.0.bias is (32,) there, (16,) on rank 0" in lines[0] and "Traceback" not in r.stderr


def test_a_step_where_no_rank_counted_anything_is_skipped_and_said(tmp_path):
    r = _run("torch_loop.py", [tmp_path / "z.npz", "--zero-count", "--steps", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step skipped: no rank had a unit to learn from (count 0 everywhere; 2 so far)" in r.stderr


@pytest.mark.parametrize("code, extra_env, message", [
    ("import mlxdist.torch as md; md.shares(8)", {},
     "error: mlxdist.torch: call mlxdist.torch.init() first"),
    ("import mlxdist.mlx as md; md.average_gradients({}, 1)", {},
     "error: mlxdist.mlx: call mlxdist.mlx.init() first"),
    ("import mlxdist.torch as md; md.init()", {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"},
     "error: started by torchrun, whose ranks mlxdist cannot join"),
])
def test_misuse_is_one_line_and_exit_2(code, extra_env, message):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env() | extra_env,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith(message) and len(r.stderr.strip().splitlines()) == 1, \
        r.stderr


def test_shares_follow_the_config_s_nodes_and_a_lone_process_is_one_rank(tmp_path, split):
    code = ("import mlxdist.torch as md, sys; i = md.init(sys.argv[1], device='cpu'); "
            "print(i.rank, i.size, i.device, md.shares(16), md.all_reduce(2.0), md.all_gather('x'))")
    r = subprocess.run([sys.executable, "-c", code, str(split)], capture_output=True, text=True, env=env(),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1", "cpu", "[16]", "2.0", "['x']"]


@pytest.mark.cluster
def test_a_checkpoint_of_2_ranks_resumes_on_one_like_no_interruption(tmp_path, split):
    seed = ["--seed-by-rank"]
    assert _run("torch_loop.py", [tmp_path / "whole.npz", "--steps", 6, *seed]).returncode == 0
    r = _run("torch_loop.py", [tmp_path / "a.npz", "--steps", 3, "--run-dir", tmp_path / "run", "--config", split,
                               *seed], np_=2)
    assert r.returncode == 0, r.stderr[-2000:]
    from mlxdist.state import checkpoint as ckpt

    assert ckpt.verify(tmp_path / "run" / "checkpoints" / "step_00000003") is None
    r = _run("torch_loop.py", [tmp_path / "b.npz", "--steps", 6, "--run-dir", tmp_path / "run", *seed])
    assert r.returncode == 0 and "done after 6 steps" in r.stderr, r.stderr[-2000:]
    assert _worst(tmp_path / "whole.npz", tmp_path / "b.npz") < 1e-5


@pytest.mark.cluster
def test_a_stop_signal_ends_every_rank_at_the_same_step_and_the_script_saves(tmp_path):
    import signal
    import time

    started = tmp_path / "started"
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", sys.executable,
           str(HERE / "torch_loop.py"), tmp_path / "s.npz", "--steps", "100000", "--sleep", "0.1", "--run-dir",
           tmp_path / "run", "--started", started]
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=HERE)
    deadline = time.time() + 120
    while not started.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)  # what launch/mlxrun sends; mpirun forwards it to the ranks
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    done = sorted(line for line in err.splitlines() if "done after" in line)
    steps = {line.split("done after ")[1].split()[0] for line in done}
    assert len(done) == 2 and len(steps) == 1, err[-2000:]
    assert (tmp_path / "run" / "checkpoints" / f"step_{int(steps.pop()):08d}").is_dir()


@pytest.mark.cluster
def test_a_rank_that_stops_answering_is_named_by_the_others(tmp_path):
    r = _run("torch_loop.py", [tmp_path / "f.npz", "--steps", 10, "--freeze-at", 2], np_=2, timeout=120)
    assert r.returncode != 0
    assert "no heartbeat from rank 1" in r.stderr and "gradient all-reduce" in r.stderr, r.stderr[-2000:]


@pytest.mark.cluster
def test_a_transformers_resnet_with_batchnorm_in_a_plain_loop_keeps_3_plus_5_equal_8(tmp_path, split):
    """BatchNorm couples a batch's samples: with md.sync_batchnorm the statistics are the whole
    cluster's, so weights and running statistics match one process; without, they do not."""
    assert _run("resnet_loop.py", [tmp_path / "one.npz"]).returncode == 0
    # With and without md.sync_batchnorm, each from scratch: one launch of 2 ranks.
    r = _run("resnet_loop.py", [tmp_path / "two", "--config", split, "--bn", "sync,plain"], np_=2)
    assert r.returncode == 0, r.stderr[-2000:]
    one = np.load(tmp_path / "one.npz")
    assert any("running_mean" in k and np.abs(one[k]).max() > 1e-3 for k in one.files)
    assert _worst(tmp_path / "one.npz", tmp_path / "two-sync.npz") < 1e-5
    assert _worst(tmp_path / "one.npz", tmp_path / "two-plain.npz") > 1e-3


def test_a_loop_s_ranks_serve_prometheus_metrics(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys, urllib.request, mlxdist.torch as md; md.init(device='cpu', metrics_port=int(sys.argv[1])); "
            "print(urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics').read().decode())")
    r = subprocess.run([sys.executable, "-c", code, str(port)], capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert 'mlxdist_build_info{' in r.stdout and 'engine="torch"' in r.stdout and 'world_size="1"' in r.stdout
