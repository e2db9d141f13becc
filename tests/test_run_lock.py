"""A run folder holds one run, and nothing there is lost to a second one (issue 50): a run
started into a folder another run is using is refused in one line naming it (every rank of an
mpirun job ends), a lock left by a dead run on this host is taken over and said, one from
another host is not; `prepare` does not replace a corpus without --overwrite; and a
train.out_dir that cannot be a run folder (NUL, a file, empty, a full disk, --overwrite over a
linked checkpoints/) is one line, exit 2, with everything that was there kept."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import FAST, env, logged_steps, run_train, train_command

from mlxdist.markers import RESTARTS_ENV
from mlxdist.state import checkpoint as ckpt
from mlxdist.state import run_lock

LOCK = run_lock.LOCK_NAME


def _listing(root: Path) -> dict[str, str]:
    """Every path under `root` with its sha256 (directories: "dir", links: their target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = (f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
                    else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def _one_error(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(train_command(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())


def _wait_for_checkpoint(proc: subprocess.Popen, run: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ((run / LOCK).exists() and ckpt.list_checkpoints(run / "checkpoints")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the first run wrote no checkpoint: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)


# ----- two runs, one folder -----------------------------------------------------------------------


def test_a_second_run_into_a_running_folder_is_refused_and_the_first_goes_on(tmp_path):
    run = tmp_path / "run"
    first = _start([*FAST, "train.steps=100000", "checkpoint.every=2", "checkpoint.keep_last=2", f"train.out_dir={run}"])
    try:
        _wait_for_checkpoint(first, run)
        holder = json.loads((run / LOCK).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname(), holder
        # The worst second run: a fresh one with --overwrite, which used to delete the first's checkpoints.
        r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}", "--overwrite"], timeout=120)
        line = _one_error(r)
        assert line.startswith(f"error: train.out_dir {run} is in use by another run (pid {first.pid} on this host "
                               f"({socket.gethostname()}) since "), line
        assert f"run id {holder['run_id']}" in line and "nothing was changed" in line
        assert "wait for it to end, or give this run another train.out_dir" in line
        # ... and one that would continue it: both would have written step_N and logs/rank0.jsonl.
        r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}", "--resume", "auto"], timeout=120)
        assert "is in use by another run" in _one_error(r)
        assert first.poll() is None, "the first run stopped"
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert not (run / LOCK).exists(), "the lock outlived its run (stopped by SIGTERM)"
    steps = [e["step"] for e in logged_steps(run)]
    assert steps == list(range(1, len(steps) + 1)) and steps, steps  # one run's steps, none twice
    ids = {ckpt.run_id_of(p) for p in ckpt.list_checkpoints(run / "checkpoints")}
    assert ids == {holder["run_id"]}, ids
    assert all(ckpt.verify(p) is None for p in ckpt.list_checkpoints(run / "checkpoints"))
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 100000  # not the refused run's


def test_every_rank_of_a_refused_mpirun_job_ends(tmp_path):
    """The holder is this test's own process (alive on this host); the job is refused by rank 0
    and its other rank ends too, instead of waiting in a collective."""
    run = tmp_path / "run"
    lock, _ = run_lock.take(run, "held-by-the-test")
    try:
        t0 = time.monotonic()
        r = run_train([*FAST, "train.steps=2", f"train.out_dir={run}"], np_=2, timeout=120)
        assert r.returncode == 2, r.stderr
        refusals = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(refusals) == 1 and f"is in use by another run (pid {os.getpid()} on this host" in refusals[0], \
            r.stderr
        assert time.monotonic() - t0 < 60
        assert json.loads((run / LOCK).read_text())["run_id"] == "held-by-the-test"
        assert sorted(p.name for p in run.iterdir()) == [LOCK]
    finally:
        lock.release()
    assert not run.exists(), "the lock's own folder stays after release though nothing else is in it"


def test_a_killed_runs_lock_is_taken_over_and_said(tmp_path):
    run = tmp_path / "run"
    first = _start([*FAST, "train.steps=100000", "checkpoint.every=2", f"train.out_dir={run}"])
    _wait_for_checkpoint(first, run)
    first.kill()  # kill -9: nothing released, the lock file stays
    first.communicate(timeout=60)
    assert json.loads((run / LOCK).read_text())["pid"] == first.pid
    r = run_train([*FAST, "train.steps=1", "checkpoint.every=2", f"train.out_dir={run}", "--resume", "auto"],
                  timeout=120)
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("run lock:")]
    assert len(said) == 1 and said[0].startswith(f"run lock: the run that held {run} (pid {first.pid} on this host "), \
        r.stderr
    assert said[0].endswith("is no longer running; taken over"), said[0]
    assert "resumed from" in r.stderr
    assert not (run / LOCK).exists()


def _foreign_lock(run: Path, **fields) -> bytes:
    run.mkdir(parents=True)
    holder = {"host": "another-mac.local", "pid": 4242, "run_id": "20250101-000000-0badc0de",
              "since": time.time() - 3600, **fields}
    (run / LOCK).write_text(json.dumps(holder))
    return (run / LOCK).read_bytes()


def test_a_lock_from_another_host_is_not_taken_over(tmp_path):
    run = tmp_path / "run"
    held = _foreign_lock(run)
    before = _listing(run)
    line = _one_error(run_train([*FAST, "train.steps=1", f"train.out_dir={run}"]))
    assert line.startswith(f"error: train.out_dir {run} is locked by a run on another host (pid 4242 on host "
                           "another-mac.local since "), line
    assert f"if it has ended, remove {run / LOCK} and start again" in line and "another train.out_dir" in line
    assert (run / LOCK).read_bytes() == held and _listing(run) == before


def test_the_next_job_of_an_elastic_run_takes_the_lock_from_the_job_before(tmp_path):
    """`launch/mlxrun --elastic` restarts only once the job before has ended; its writer may have
    been on a host that is gone (a shared disk)."""
    run = tmp_path / "run"
    _foreign_lock(run, elastic="e1a571c")
    r = run_train([*FAST, "train.steps=1", f"train.out_dir={run}", "--resume", "none"],
                  extra_env={RESTARTS_ENV: "1", run_lock.ELASTIC_ENV: "e1a571c"})
    assert r.returncode == 0, r.stderr
    assert "run lock: taken over from the previous job of this elastic run (pid 4242 on host another-mac.local" \
        in r.stderr
    assert not (run / LOCK).exists()


def test_a_start_that_fails_lets_the_lock_go(tmp_path):
    """A lock left by a dead run here is taken over, then let go when the start fails."""
    run = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _foreign_lock(run, host=socket.gethostname(), pid=dead.pid)
    r = run_train([*FAST, "train.steps=1", f"train.out_dir={run}", "task.factory=no_such_module_here:make"])
    assert r.returncode == 2 and "no_such_module_here" in r.stderr, r.stderr
    assert f"(pid {dead.pid} on this host" in r.stderr and "is no longer running; taken over" in r.stderr
    assert not (run / LOCK).exists()


LOOP = """
import sys, time
import mlx.core as mx
import mlx.nn as nn
import mlxdist.mlx as md

md.init()
model = nn.Linear(3, 2)
mx.eval(model.parameters())
md.save_checkpoint(sys.argv[1], int(sys.argv[2]), model)
print("saved", flush=True)
if sys.argv[3] == "hold":
    time.sleep(120)
"""


def test_a_loop_of_your_own_holds_its_run_folder_from_its_first_save(tmp_path):
    script, run = tmp_path / "loop.py", tmp_path / "run"
    script.write_text(LOOP)
    first = subprocess.Popen([sys.executable, str(script), str(run), "1", "hold"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env())
    try:
        assert first.stdout.readline().strip() == "saved", first.communicate(timeout=60)
        r = subprocess.run([sys.executable, str(script), str(run), "2", "go"], capture_output=True, text=True,
                           env=env(), timeout=120)
        line = _one_error(r)
        assert line.startswith(f"error: mlxdist.mlx.save_checkpoint: run_dir {run} is in use by another run "
                               f"(pid {first.pid} on this host"), line
        assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_00000001"]
    finally:
        first.kill()  # kill -9: its lock is left behind, and taken over by the next save
        first.communicate(timeout=60)
    r = subprocess.run([sys.executable, str(script), str(run), "2", "go"], capture_output=True, text=True, env=env(),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"mlxdist.mlx: run lock: the run that held {run} (pid {first.pid} on this host" in r.stderr, r.stderr
    assert not (run / LOCK).exists(), "the lock outlived the loop's process"


# ----- prepare ------------------------------------------------------------------------------------


def _prepare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxdist.prepare", *args], capture_output=True, text=True, env=env(),
                          cwd=cwd, timeout=120)


def test_prepare_does_not_replace_a_corpus_without_overwrite(tmp_path):
    (tmp_path / "big.txt").write_text("the corpus that took a day to gather " * 2000)
    (tmp_path / "small.txt").write_text("a test\n")
    r = _prepare("big.txt", "--out", "corpus", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    corpus = tmp_path / "corpus"
    tokens = json.loads((corpus / "shards.json").read_text())["tokens"]
    before = _listing(corpus)

    line = _one_error(_prepare("small.txt", "--out", "corpus", cwd=tmp_path))
    assert line == (f"error: --out corpus already holds a prepared corpus ({tokens:,} tokens, shards.json); nothing "
                    "was changed: give a new --out, or add --overwrite to replace it"), line
    assert _listing(corpus) == before

    (tmp_path / "a_file").write_text("mine")
    line = _one_error(_prepare("small.txt", "--out", "a_file", cwd=tmp_path))
    assert line.startswith("error: --out a_file is a file, not a folder"), line
    assert (tmp_path / "a_file").read_text() == "mine"

    # --overwrite replaces a corpus prepare wrote, never the user's other files.
    (corpus / "notes.txt").write_text("keep me")
    line = _one_error(_prepare("small.txt", "--out", "corpus", "--overwrite", cwd=tmp_path))
    assert "holds files prepare did not write (notes.txt)" in line, line
    assert (corpus / "notes.txt").read_text() == "keep me"
    (corpus / "notes.txt").unlink()
    r = _prepare("small.txt", "--out", "corpus", "--overwrite", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((corpus / "shards.json").read_text())["tokens"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "big.txt", "corpus", "small.txt"]

    # An empty folder is no corpus: prepare fills it.
    (tmp_path / "empty").mkdir()
    assert _prepare("small.txt", "--out", "empty", cwd=tmp_path).returncode == 0


# ----- run folders that cannot be one -------------------------------------------------------------


def test_a_nul_in_out_dir_is_one_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text('train:\n  out_dir: "runs/x\\0y"\n')
    line = _one_error(run_train(["--config", str(config), *FAST, "train.steps=1"], cwd=tmp_path))
    assert line.startswith("error: train.out_dir 'runs/x\\x00y' holds a NUL character"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_an_out_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("a file of mine")
    line = _one_error(run_train([*FAST, "train.steps=1", f"train.out_dir={tmp_path / 'run'}"]))
    assert line.startswith(f"error: train.out_dir {tmp_path / 'run'} is a file, not a folder"), line
    line = _one_error(run_train([*FAST, "train.steps=1", f"train.out_dir={tmp_path / 'run' / 'sub'}"]))
    assert f"{tmp_path / 'run'} is a file, not a folder" in line, line
    assert (tmp_path / "run").read_text() == "a file of mine"


def test_an_empty_out_dir_is_refused_not_the_working_directory(tmp_path):
    line = _one_error(run_train([*FAST, "train.steps=1", "train.out_dir="], cwd=tmp_path))
    assert line.startswith("error: train.out_dir is empty"), line
    assert "train.out_dir=runs/NAME" in line
    assert list(tmp_path.iterdir()) == []


def test_an_out_dir_on_a_full_disk_is_one_line(tmp_path):
    """A tmpfs filled to the last byte, in a mount namespace of the test's own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a small tmpfs")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m failed: {probe.stderr.decode().strip()}")
    disk, run = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    cmd = " ".join(f"'{a}'" for a in train_command([*FAST, "train.steps=1", f"train.out_dir={run}"]))
    script = (f"mount -t tmpfs -o size=200k tmpfs '{disk}' || exit 99; head -c 1M /dev/zero > '{disk}/filler' "
              f"2>/dev/null; {cmd}; echo rc=$?; ls -A '{disk}'")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env(), timeout=120)
    if r.returncode == 99:
        pytest.skip(f"mount -t tmpfs failed: {r.stderr.strip()}")
    assert "rc=2" in r.stdout, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: train.out_dir {run}: cannot write its lock "), r.stderr
    assert "No space left on device" in errors[0] and "free some space there" in errors[0]
    assert r.stdout.split("rc=2", 1)[1].split() == ["filler"]  # nothing left behind, the filler kept


def test_overwrite_does_not_delete_through_a_linked_checkpoints_folder(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "big-disk" / "checkpoints"
    r = run_train([*FAST, "train.steps=1", f"train.out_dir={run}"])
    assert r.returncode == 0, r.stderr
    elsewhere.parent.mkdir()
    (run / "checkpoints").rename(elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    before, kept = _listing(run), _listing(elsewhere)
    line = _one_error(run_train([*FAST, "train.steps=1", f"train.out_dir={run}", "--overwrite"]))
    assert line.startswith(f"error: train.out_dir {run}: checkpoints -> {elsewhere} is a symbolic link, and "
                           "--overwrite does not delete through a link; nothing was changed"), line
    assert f"rm {run / 'checkpoints'}" in line and "another train.out_dir" in line
    assert _listing(run) == before and _listing(elsewhere) == kept
