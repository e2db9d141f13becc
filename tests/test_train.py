"""End-to-end single-process runs of the real CLI: learning, resume, fallback, generation."""

import json
import shutil
import subprocess
import sys

import pytest
from helpers import (
    FAST,
    assert_same_weights,
    env,
    final_weights,
    run_train,
    stop_with_sigterm_after,
)


def _losses(run_dir):
    lines = (run_dir / "logs" / "rank0.jsonl").read_text().splitlines()
    return [e["loss"] for e in map(json.loads, lines) if e["event"] == "step"]


def test_loss_falls_on_synthetic_task(tmp_path):
    r = run_train([*FAST, "train.steps=60", "train.lr=3e-3", f"train.out_dir={tmp_path}",
                   "train.eval_every=30"])
    assert r.returncode == 0, r.stderr
    losses = _losses(tmp_path)
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses[::10]
    assert "eval: step 60" in r.stderr and "checkpoint:" in r.stderr
    saved = json.loads((tmp_path / "checkpoints" / "step_00000060" / "state.json").read_text())
    assert saved["config"]["train"]["steps"] == 60  # resolved config travels with the checkpoint


def test_resume_equals_uninterrupted(tmp_path):
    common = [*FAST, "train.steps=40", "checkpoint.every=0", "train.accum=2", "train.batch_size=4"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_train([*common, f"train.out_dir={full}"]).returncode == 0
    code, err = stop_with_sigterm_after([*common, f"train.out_dir={part}"], part, 5)
    assert code == 0, err
    assert "stopped by signal after step" in err
    stopped_at = int(err.split("stopped by signal after step ")[1].split(";")[0])
    assert 5 <= stopped_at < 40
    r = run_train([*common, f"train.out_dir={part}", "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    assert f"resumed from {part}/checkpoints/step_{stopped_at:08d}" in r.stderr
    assert_same_weights(final_weights(full), final_weights(part), atol=1e-6)


def test_resume_skips_corrupt_newest(tmp_path):
    common = [*FAST, "train.steps=6", "checkpoint.every=3", f"train.out_dir={tmp_path}"]
    assert run_train(common).returncode == 0
    newest = tmp_path / "checkpoints" / "step_00000006" / "optimizer.safetensors"
    newest.write_bytes(newest.read_bytes()[:-10])
    r = run_train([*common, "train.steps=8", "--resume", "auto"])
    assert r.returncode == 0, r.stderr
    assert "checkpoints/step_00000006 fails verification (optimizer.safetensors fails its sha256 check)" in r.stderr
    assert "resumed from" in r.stderr and "(step 3" in r.stderr
    # Moved aside, whole as it was, before this run saved its own step 6.
    aside = tmp_path / "checkpoints" / "unverified_step_00000006" / "optimizer.safetensors"
    assert aside.exists() and "moved aside to checkpoints/unverified_step_00000006" in r.stderr


def test_generate_from_checkpoint(tmp_path):
    assert run_train([*FAST, "train.steps=3", f"train.out_dir={tmp_path}"]).returncode == 0
    r = subprocess.run([sys.executable, "-m", "mlxdist.generate", "--checkpoint", str(tmp_path),
                        "--prompt", "abc", "--tokens", "12"], capture_output=True, text=True, env=env(),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("abc") and len(r.stdout.strip()) > 3


def test_builtin_corpus_default_model_runs(tmp_path):
    r = run_train(["train.steps=3", "metrics.port=0", "data.seq_len=64", "train.batch_size=2",
                   f"train.out_dir={tmp_path}"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert "data: builtin" in r.stderr and "parameters" in r.stderr and "BLAS:" in r.stderr


def test_prepare_then_train_on_shards(tmp_path):
    text = tmp_path / "a.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(50)))
    r = subprocess.run([sys.executable, "-m", "mlxdist.prepare", str(text), "--out", str(tmp_path / "tok")],
                       capture_output=True, text=True, env=env(), timeout=60)
    assert r.returncode == 0, r.stderr
    r = run_train(["data.source=shards", f"data.path={tmp_path / 'tok'}", "data.seq_len=32", "data.overlap=8",
                   "train.steps=3", "metrics.port=0", f"train.out_dir={tmp_path / 'run'}"])
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd")
def test_openblas_announced(tmp_path):
    r = run_train([*FAST, "train.steps=1", f"train.out_dir={tmp_path}"])
    assert "BLAS:" in r.stderr


def test_unusable_output_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    r = run_train([*FAST, "train.steps=2", f"train.out_dir={blocker}"])
    assert r.returncode == 2  # bad input, as every other one-line refusal
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: train.out_dir {blocker} is a file, not a folder")
    assert "Traceback" not in r.stderr and blocker.read_text() == "not a directory"


def test_cli_module_does_not_import_mlx_before_blas_reexec():
    code = "import sys, mlxdist.train; sys.exit(int(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], env=env(), timeout=60).returncode == 0
