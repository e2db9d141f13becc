"""A research script's own pieces on `mlxdist.torch` (issue 43 part 6): the Tiny Recursive
Models repo's `pretrain.py` (vendored in tests/public/trm/ with its mlxdist lines, README there)
trains on 2 ranks with 3+5 as one process with 8, and resumes from a mid-run checkpoint (its ACT
carry as per-rank rows, its EMA copy as tensors) exactly as if it never stopped. Smaller tests
pin each piece: an optimizer whose `step(self)` takes no closure, two optimizers, per-sample rows
on buffers, tensor state in checkpoints, an IterableDataset's rows per rank, the summed-loss
check, and one-line errors under `@hydra.main`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mpirun_path

torch = pytest.importorskip("torch")

import mlxdist.torch as md  # noqa: E402
from mlxdist.config import ConfigError  # noqa: E402
from mlxdist.state import checkpoint as ckpt  # noqa: E402

HERE = Path(__file__).parent
TRM = HERE / "public" / "trm"
SPLIT = "nodes:\n  rank0: {batch_size: 3}\n  rank1: {batch_size: 5}\n"
# A tiny TRM: hidden 32, one layer, 2x2 cycles, ACT up to 3 steps; fp32 on the CPU; no halting
# exploration (torch.rand_like draws per rank's rows, so it cannot match across splits).
TRM_ARGS = ["evaluators=[]", "global_batch_size=8", "epochs=4", "eval_interval=null", "min_eval_interval=1",
            "lr=1e-3", "lr_warmup_steps=0", "puzzle_emb_lr=1e-2", "ema=True", "+project_name=t",
            "+checkpoint_every_steps=3", "arch.hidden_size=32", "arch.num_heads=2", "arch.expansion=2",
            "arch.L_layers=1", "arch.H_cycles=2", "arch.L_cycles=2", "arch.halt_max_steps=3",
            "arch.halt_exploration_prob=0", "arch.forward_dtype=float32", "arch.puzzle_emb_len=1"]


def _launch(cmd: list[str], np_: int, cwd: Path, extra_env: dict | None = None, timeout: float = 240):
    if np_:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH",
               "-x", "OPENBLAS_NUM_THREADS", *[x for k in (extra_env or {}) for x in ("-x", k)], *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env() | (extra_env or {}), timeout=timeout,
                          cwd=cwd)


def build_puzzles(root: Path, puzzles: int = 12, side: int = 4, vocab: int = 6) -> Path:
    """A tiny puzzle set in TRM's own format (`dataset/common.py`'s metadata, `set__field.npy`):
    sort a 4x4 grid's digits; one example per puzzle and per group, so TRM's unseeded
    `np.random.choice` inside a puzzle has one choice."""
    d = root / "train"
    d.mkdir(parents=True)
    inputs = np.random.default_rng(0).integers(1, vocab, (puzzles, side * side)).astype(np.int32)
    index = np.arange(puzzles + 1, dtype=np.int32)
    arrays = {"inputs": inputs, "labels": np.sort(inputs, axis=1), "puzzle_identifiers": index[1:],
              "puzzle_indices": index, "group_indices": index}
    for k, v in arrays.items():
        np.save(d / f"all__{k}.npy", v)
    (d / "dataset.json").write_text(json.dumps(dict(
        pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=vocab, seq_len=side * side,
        num_puzzle_identifiers=puzzles + 1, total_groups=puzzles, mean_puzzle_examples=1.0, total_puzzles=puzzles,
        sets=["all"])))
    return root


@pytest.fixture(scope="module")
def trm(tmp_path_factory) -> Path:
    """TRM's pretrain.py, 6 steps: one process with 8 (`one`), 2 ranks with 3+5 (`two`), and 2
    ranks stopped after step 4 then resumed from its checkpoint (`resumed`). Step 4, not 3: with
    halt_max_steps=3 every sample halts at step 3, so only a stop mid-way shows the carry."""
    d = tmp_path_factory.mktemp("trm")
    data = build_puzzles(d / "data")
    (d / "split.yaml").write_text(SPLIT)
    split = {"MLXDIST_CONFIG": str(d / "split.yaml"), "DISABLE_COMPILE": "1", "WANDB_MODE": "disabled"}

    def run(name: str, np_: int, *extra: str) -> None:
        args = [f"data_paths=[{data}]", *TRM_ARGS, f"+run_name={name}", f"+checkpoint_path={d / name}",
                f"hydra.run.dir={d / 'hydra'}", *extra]
        r = _launch([sys.executable, str(TRM / "pretrain.py"), *args], np_, d,
                    split if np_ else {k: v for k, v in split.items() if k != "MLXDIST_CONFIG"})
        assert r.returncode == 0, r.stderr[-3000:]

    run("one", 0)
    run("two", 2)
    run("resumed", 2, "+stop_after_steps=4")
    assert [c.name for c in ckpt.list_checkpoints(d / "resumed" / "checkpoints")][-1] == "step_00000004"
    run("resumed", 2)
    return d


def _last(run: Path) -> ckpt.Loaded:
    loaded = ckpt.load_latest(run / "checkpoints")
    assert loaded is not None and loaded.state["step"] == 6, run
    return loaded


def _worst(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)


EMB = "model.inner.puzzle_emb.weights"


@pytest.mark.cluster
def test_trm_on_3_plus_5_ranks_equals_one_process_with_8(trm):
    one, two = _last(trm / "one"), _last(trm / "two")
    assert two.state["loop_state"]["ranks_equal"] is True  # every rank held rank 0's weights
    assert np.count_nonzero(np.abs(one.weights[EMB]).sum(1)) > 4  # the sparse embedding learned rows
    np.testing.assert_array_equal(one.weights[EMB], two.weights[EMB])  # sign-SGD over the same rows
    dense = {k: v for k, v in one.weights.items() if k != EMB}
    assert _worst(dense, {k: two.weights[k] for k in dense}) < 5e-7
    assert _worst(one.optimizer, two.optimizer) < 5e-7
    ema = {k: v for k, v in one.extra["task"].items() if k.startswith("state/ema.")}
    assert len(ema) > 4 and _worst(ema, {k: two.extra["task"][k] for k in ema}) < 5e-7
    # The carry, saved as every rank's rows in rank order, is the one process's carry.
    z = "rows/carry.inner_carry.z_H"
    assert two.extra["task"][z].shape[0] == 8 and _worst({z: one.extra["task"][z]}, {z: two.extra["task"][z]}) < 1e-4


@pytest.mark.cluster
def test_trm_resumed_from_step_4_with_its_carry_and_ema_equals_the_run_never_stopped(trm):
    at_stop = ckpt.load(trm / "resumed" / "checkpoints" / "step_00000004").extra["task"]
    assert not at_stop["rows/carry.halted"].all()  # samples mid-way through their reasoning steps
    two, resumed = _last(trm / "two"), _last(trm / "resumed")
    assert _worst(two.weights, resumed.weights) < 1e-7
    assert _worst(two.optimizer, resumed.optimizer) < 1e-7
    assert _worst(two.extra["task"], resumed.extra["task"]) < 1e-7  # carry rows, EMA copy


# ------------------------------------------------------------- the pieces on 2 ranks, 3+5


@pytest.fixture(scope="module")
def research(tmp_path_factory) -> tuple[list[dict], Path]:
    d = tmp_path_factory.mktemp("research")
    (d / "split.yaml").write_text(SPLIT)
    r = _launch([sys.executable, str(HERE / "yourloop" / "research_loop.py"), str(d / "out"), str(d / "run")], 2,
                d, {"MLXDIST_CONFIG": str(d / "split.yaml")})
    assert r.returncode == 0, r.stderr[-3000:]
    (d / "run" / "stderr").write_text(r.stderr)
    return [json.loads((d / f"out-{rank}.json").read_text()) for rank in (0, 1)], d / "run"


@pytest.mark.cluster
def test_an_iterable_dataset_gives_each_rank_its_rows_of_every_global_batch(research):
    (r0, r1), _ = research
    # start_step=1 skips the first global batch of the first pass only; 3 rows, then 5.
    assert r0["iterable_ids"] == [[8, 9, 10], [16, 17, 18], [24, 25, 26]]
    assert r1["iterable_ids"] == [[11, 12, 13, 14, 15], [19, 20, 21, 22, 23], [27, 28, 29, 30, 31]]
    assert r0["iterable_second_pass"] == [[0, 1, 2]] and r1["iterable_second_pass"] == [[3, 4, 5, 6, 7]]


@pytest.mark.cluster
def test_rows_on_buffers_are_stepped_as_every_ranks_rows_divided_by_the_cluster_samples(research):
    (r0, r1), _ = research
    # Row i's gradient is (i + 1) * w, w = 1: an optimizer whose step(self) takes no closure saw
    # all 8 rows in rank order, divided by the 8 samples, on both ranks; then its own 3 and 5 again.
    expected = [[(i + 1) / 8] * 2 for i in range(8)]
    for r in (r0, r1):
        assert r["gathered_ids"] == list(range(8))
        np.testing.assert_allclose(r["gathered_grad"], expected, rtol=1e-6)
        np.testing.assert_allclose(r["w_grad"], [21.0, 21.0], rtol=1e-6)  # sum i(i+1) / 8: the parameter's sum
    assert r0["local_after"] == [3, 2] and r1["local_after"] == [5, 2]


@pytest.mark.cluster
def test_two_optimizers_are_broadcast_and_tensor_state_round_trips(research):
    (r0, r1), run = research
    assert r0["adam_exp_avg"] == r1["adam_exp_avg"]  # the second optimizer's state is rank 0's
    # md.rows: saved as every rank's rows in rank order; each rank loads its own.
    saved = ckpt.load(run / "checkpoints" / "step_00000001").extra["task"]
    np.testing.assert_array_equal(saved["rows/carry.z"][:, 0], [0, 0, 0, 1, 1, 1, 1, 1])
    assert r0["resumed_carry_z"] == [0.0] * 3 and r1["resumed_carry_z"] == [1.0] * 5
    assert r0["resumed_carry_halted"] == [True, False, True] and r1["resumed_carry_halted"][:2] == [False, True]
    # Plain tensors (an EMA copy, an RNG state) are rank 0's, the same on every rank.
    assert r0["resumed_ema_w"] == r1["resumed_ema_w"] and r0["rng_equal_to_rank0"] and r1["rng_equal_to_rank0"]
    assert r0["resumed_epoch"] == r1["resumed_epoch"] == 3


@pytest.mark.cluster
def test_a_checkpoint_of_ranks_that_drifted_apart_names_the_rank_and_tensor(research):
    _, run = research
    assert ckpt.load(run / "checkpoints" / "step_00000001").state["loop_state"]["ranks_equal"] is True
    assert ckpt.load(run / "checkpoints" / "step_00000002").state["loop_state"]["ranks_equal"] is False
    assert ("mlxdist.torch.save_checkpoint: step 2: rank 1's w differs from rank 0's (1 tensor(s) on other ranks "
            "do): the ranks drifted apart; rank 0's state is saved") in (run / "stderr").read_text()


# ------------------------------------------------------------- one process


@pytest.fixture
def one_rank(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE",
                "MLXDIST_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    md.init(device="cpu")


class NoClosure(torch.optim.SGD):
    """As TRM's AdamATan2: `step(self)`."""

    def step(self):  # noqa: D102
        return super().step()


def _linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def test_an_optimizer_whose_step_takes_no_closure_steps(one_rank):
    model, ref = _linear(), _linear()
    opt = md.DistributedOptimizer(NoClosure(model.parameters(), lr=0.5), model)
    x = torch.randn(4, 3)
    opt.backward(model(x).pow(2).mean(), count=4)
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    assert torch.allclose(model.weight, ref.weight, atol=1e-7)


def test_a_summed_loss_under_the_default_mean_is_refused_in_one_line(one_rank):
    model = _linear()
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    opt = md.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ConfigError, match=r"the loss is a sum over its units .* pass reduction='sum'"):
        opt.backward(torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), count=4)
    with pytest.raises(ConfigError):  # a scaled sum, TRM's (1 / global_batch) * loss, too
        md.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model).backward(
            0.125 * model(x).pow(2).sum(), count=4)
    for reduction, loss in ((None, torch.nn.functional.cross_entropy(model(x), y)),
                            ("mean", 0.125 * model(x).pow(2).sum()),  # said explicitly: trusted
                            ("sum", model(x).pow(2).sum())):
        md.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, reduction).backward(loss, 4)


def test_an_optimizer_of_none_of_the_models_parameters_without_rows_is_one_line(one_rank):
    other = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ConfigError, match="holds none of the model's trainable parameters"):
        md.DistributedOptimizer(torch.optim.SGD([other], lr=0.1), _linear())


@dataclass
class Carry:
    z: torch.Tensor
    steps: torch.Tensor
    data: dict


def test_tensor_state_and_two_optimizers_round_trip_through_a_checkpoint(one_rank, tmp_path):
    model = _linear()
    opts = [torch.optim.AdamW([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1, momentum=0.9)]
    model(torch.randn(4, 3)).sum().backward()
    for o in opts:
        o.step()
    carry = Carry(torch.randn(4, 5).to(torch.bfloat16), torch.arange(4, dtype=torch.int32),
                  {"halted": torch.tensor([True, False, True, True])})
    ema = {"weight": model.weight.detach() * 2, "nested": [torch.ones(2), (torch.zeros(1), 7)]}
    rng = torch.get_rng_state()
    md.save_checkpoint(tmp_path, 5, model, opts, carry=md.rows(carry), ema=ema, rng=rng, epoch=2)
    saved_w, saved_momentum = model.weight.detach().clone(), opts[1].state[model.bias]["momentum_buffer"].clone()
    fresh = _linear(1)
    fresh_opts = [torch.optim.AdamW([fresh.weight], lr=0.1), torch.optim.SGD([fresh.bias], lr=0.1, momentum=0.9)]
    got = md.load_checkpoint(tmp_path, fresh, fresh_opts, classes=[Carry])
    assert got["step"] == 5 and got["epoch"] == 2
    assert torch.equal(fresh.weight, saved_w)
    assert torch.equal(fresh_opts[1].state[fresh.bias]["momentum_buffer"], saved_momentum)
    assert torch.equal(fresh_opts[0].state[fresh.weight]["exp_avg"], opts[0].state[model.weight]["exp_avg"])
    c = got["carry"]
    assert isinstance(c, Carry) and c.z.dtype == torch.bfloat16 and torch.equal(c.z, carry.z)
    assert c.steps.dtype == torch.int32 and torch.equal(c.data["halted"], carry.data["halted"])
    assert torch.equal(got["ema"]["weight"], ema["weight"]) and got["ema"]["nested"][1][1] == 7
    assert isinstance(got["ema"]["nested"][1], tuple) and torch.equal(got["rng"], rng)
    with pytest.raises(ConfigError, match="it holds 2 optimizer"):
        md.load_checkpoint(tmp_path, fresh, fresh_opts[0])


def test_state_that_is_neither_json_nor_tensors_is_one_line(one_rank, tmp_path):
    with pytest.raises(ConfigError, match="state 'state/sched' is a object"):
        md.save_checkpoint(tmp_path, 1, _linear(), sched=object())
    with pytest.raises(ConfigError, match=r"md.rows\(carry\) holds tensors of \[3, 4\] rows"):
        md.save_checkpoint(tmp_path, 1, _linear(), carry=md.rows([torch.zeros(3), torch.zeros(4)]))


def test_an_iterable_whose_items_hold_no_global_batch_is_one_line(one_rank):
    rows = md.DistributedIterable([{"x": torch.zeros(8, 2)}, {"x": torch.zeros(5, 2)}], 8)
    with pytest.raises(ConfigError, match="item 1 holds no tensor or array of global_batch=8 rows"):
        list(rows)


# ------------------------------------------------------------- hydra

HYDRA_MAIN = """
import os, hydra, torch
import mlxdist.torch as md

@hydra.main(config_path=None, version_base=None)
def main(cfg):
    if os.environ["CASE"] == "before-init":
        md.shares(8)
    md.init(device="cpu")
    md.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), torch.nn.Linear(1, 1))

main()
"""


@pytest.mark.parametrize("case, message", [
    ("before-init", "error: mlxdist.torch: call mlxdist.torch.init() first"),
    ("after-init", "error: mlxdist.torch.DistributedOptimizer(SGD): it holds none of the model's trainable"),
])
def test_an_mlxdist_error_under_hydra_main_stays_one_line_and_exit_2(tmp_path, case, message):
    pytest.importorskip("hydra")
    (tmp_path / "script.py").write_text(HYDRA_MAIN)
    r = subprocess.run([sys.executable, "script.py", f"hydra.run.dir={tmp_path}"], capture_output=True,
                       text=True, env=env() | {"CASE": case}, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error: ")] == [
        line for line in r.stderr.splitlines() if line.startswith(message)], r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
