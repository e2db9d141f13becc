"""A Hugging Face Trainer + PEFT LoRA script on mlxdist (`from mlxdist.hf import Trainer`, its one
`# md` line): 3 + 5 samples on two ranks train exactly like one process with 8, only rank 0
writes, and a resumed run equals the uninterrupted one.

Each rank of a two-rank run works in a folder of its own (an Open MPI app context each, with its
own working directory), as two Macs without a shared disk: rank 1 must write nothing there, and
resuming from a checkpoint only rank 0 has sends it to rank 1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import env, mlxdist_diff_lines, mpirun_path, with_mlxdist_lines

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


# -- a public script: transformers' examples/pytorch/language-modeling/run_clm.py ---------------

PUBLIC = Path(__file__).parent / "public" / "hf_run_clm"
CLM = ["--do_train", "--block_size", "16", "--per_device_train_batch_size", "8", "--num_train_epochs", "2",
       "--optim", "sgd", "--learning_rate", "0.5", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
       "--seed", "0", "--output_dir", "out"]
CLM_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": "./hf_cache"}  # each rank's own, in its folder


def _clm_inputs(base: Path) -> None:
    """A tiny GPT-2 (2 layers, 32 wide, dropout 0) and a word-level tokenizer of 30 words in
    base/model, and 52 lines of 7 words: the script keeps 5% for validation and trains on 21
    blocks of 16 tokens, batches of 8, 8 and 5 an epoch."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(30)]
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                            model_max_length=64).save_pretrained(base / "model")
    GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=1, eos_token_id=1).save_pretrained(base / "model")
    rng = np.random.default_rng(0)
    (base / "train.txt").write_text("".join(" ".join(rng.choice(words, 7)) + "\n" for _ in range(52)))


def _clm(base: Path, name: str, script: Path, np_: int = 0) -> str:
    """The script in base/name (1 process), or base/name/rank0 and rank1 (2 ranks, 3:5)."""
    e = env() | CLM_ENV
    e["PYTHONPATH"] = f"{e['PYTHONPATH']}{os.pathsep}{PUBLIC / 'stubs'}"  # `evaluate`: imported, not used
    app = [sys.executable, str(script), "--config_name", str(base / "model"), "--tokenizer_name",
           str(base / "model"), "--train_file", str(base / "train.txt"), *CLM]
    if not np_:
        (base / name).mkdir()
        r = subprocess.run(app, capture_output=True, text=True, env=e, timeout=240, cwd=base / name)
    else:
        (base / name / "rank0").mkdir(parents=True)
        (base / name / "rank1").mkdir()
        e["MLXDIST_CONFIG"] = str(base / "split.yaml")
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", *[x for k in ["PYTHONPATH",
               "OPENBLAS_NUM_THREADS", *CLM_ENV, "MLXDIST_CONFIG"] for x in ("-x", k)],
               "-np", "1", "--wdir", str(base / name / "rank0"), *app, ":",
               "-np", "1", "--wdir", str(base / name / "rank1"), *app]
        r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def clm(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """run_clm.py as published (transformers.Trainer), with its one mlxdist line on 1 process,
    and on 2 ranks; each trains 6 steps (2 epochs of 8, 8, 5), shuffled by the Trainer's seed."""
    base = tmp_path_factory.mktemp("run_clm")
    _clm_inputs(base)
    (base / "split.yaml").write_text(SPLIT)
    ours = with_mlxdist_lines(PUBLIC / "run_clm.py", base / "patched")
    logs = {"plain": _clm(base, "plain", PUBLIC / "run_clm.py"), "one": _clm(base, "one", ours),
            "two": _clm(base, "two", ours, np_=2)}
    return base, logs


def _clm_weights(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(out / "model.safetensors")


def _clm_compare(a: Path, b: Path) -> float:
    x, y = _clm_weights(a), _clm_weights(b)
    assert x.keys() == y.keys()
    return max(float(np.abs(x[k] - y[k]).max()) for k in x)


def _clm_losses(out: Path) -> list[float]:
    return [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]


@pytest.mark.cluster
def test_run_clm_with_one_added_line_on_one_process_is_plain_transformers(clm):
    """`Trainer` sits in a multi-name `from transformers import (...)`: one line added after it
    rebinds the name, and nothing else changes. The Trainer's own DataLoader is kept (its seeded
    shuffle, the last batch of 5): the same 6 steps, weights and logged losses as
    transformers.Trainer."""
    changed = mlxdist_diff_lines(PUBLIC / "run_clm.py")
    assert changed == ["+from mlxdist.hf import Trainer  # mlxdist: after the import above, it rebinds `Trainer`"]
    base, logs = clm
    worst = _clm_compare(base / "plain" / "out", base / "one" / "out")
    print(f"run_clm.py, 1 process: mlxdist.hf.Trainer against transformers.Trainer, largest weight difference "
          f"{worst:.1e}")
    assert worst < 1e-6
    plain, ours = _clm_losses(base / "plain" / "out"), _clm_losses(base / "one" / "out")
    assert len(plain) == 6 and np.allclose(plain, ours, atol=1e-6)
    assert "Num examples = 21" in logs["one"] and "Instantaneous batch size per device = 8" in logs["one"]


@pytest.mark.cluster
def test_run_clm_on_2_ranks_equals_plain_transformers_and_says_who_is_who(clm):
    """3:5 of every batch of 8 (of the last, 5: 2 + 3): the weights and the logged (cluster's)
    losses of one process; each rank's line and the Trainer's log give its share; only rank 0
    writes."""
    base, logs = clm
    worst = _clm_compare(base / "plain" / "out", base / "two" / "rank0" / "out")
    print(f"run_clm.py, 2 ranks (3:5) against transformers.Trainer on 1 process: largest weight difference "
          f"{worst:.1e}")
    assert worst < 1e-6
    assert np.allclose(_clm_losses(base / "plain" / "out"), _clm_losses(base / "two" / "rank0" / "out"), atol=1e-6)
    log = logs["two"]
    for rank, share in ((0, 3), (1, 5)):
        assert f"mlxdist.hf: rank {rank} of 2 (" in log and f"{share} of each batch of 8 " \
            f"(per_device_train_batch_size={share})" in log
    assert "Instantaneous batch size per device = 3" in log  # rank 0's log (rank 1 does not log)
    assert "Total train batch size (w. parallel, distributed & accumulation) = 8" in log
    assert not (base / "two" / "rank1" / "out").exists()
