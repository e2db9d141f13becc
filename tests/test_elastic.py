"""Elastic runs (`launch/mlxrun --elastic`): the restart policy as plain Python, the per-host
checkpoint copies and their probe on real files, the supervisor's side of it on real
processes, then on three namespace hosts (cluster `mlxel`, subnet 10.83.15): a host dies, the
host running rank 0 dies with its disk, a cut link heals and the host rejoins, and too few
hosts are left.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, env, namespace_cluster

from mlxdist import markers
from mlxdist.config import CheckpointConfig
from mlxdist.launch.elastic import (
    Copy,
    ElasticSettings,
    GiveUp,
    Probe,
    RejoinWatch,
    Restart,
    newest_copy,
    plan_restart,
    restart_args,
    restart_line,
    worth_restarting,
)
from mlxdist.launch.supervisor import Supervisor
from mlxdist.markers import Exit, RestartCounts
from mlxdist.state import checkpoint as ckpt
from mlxdist.state.checkpointer import Checkpointer, all_copies, newest_whole

# ----- the policy ------------------------------------------------------------------------


def _probe(host, step=None, answered=True, why=""):
    copy = Copy(host, f"/run/{host}/step_{step:08d}", step, 12) if step is not None else None
    return Probe(host, answered, name=f"mac-{host}", newest=copy, why=why)


def test_restart_on_survivors_from_the_newest_copy_held_by_any_of_them():
    probes = [_probe("a", 6), _probe("b", 9), _probe("c", 12, answered=False, why="unreachable")]
    r = plan_restart(ElasticSettings(min_hosts=2), probes, last_step=13, failures_so_far=0, after_failure=True)
    assert isinstance(r, Restart)
    # c's copy is newer but c does not answer; b holds the newest usable one, so b runs rank 0.
    assert r.hosts == ["b", "a"] and r.resume.step == 9 and r.steps_lost == 4 and r.dropped == ["c"]
    assert restart_args(r) == ["train.global_batch=12", "--resume", "auto"]
    line = restart_line(1, "host lost", r, probes)
    assert "reason host lost; hosts b (mac-b), a (mac-a); dropped c (mac-c): unreachable" in line
    assert line.endswith("resuming from step 9 (/run/b/step_00000009 on b); steps lost 4")


def test_ties_keep_the_current_order_and_no_checkpoint_restarts_from_the_start():
    assert newest_copy([_probe("a", 6), _probe("b", 6)]).host == "a"
    r = plan_restart(ElasticSettings(), [_probe("a"), _probe("b")], last_step=2, failures_so_far=0,
                     after_failure=True)
    assert r.hosts == ["a", "b"] and r.resume is None and r.steps_lost == 2
    assert restart_args(r) == ["--resume", "none"]


def test_too_few_hosts_or_too_many_restarts_give_up_with_one_line():
    probes = [_probe("a", 6), _probe("b", answered=False, why="no answer"), _probe("c", answered=False)]
    g = plan_restart(ElasticSettings(min_hosts=2), probes, last_step=7, failures_so_far=0, after_failure=True)
    assert isinstance(g, GiveUp) and g.code == Exit.GAVE_UP == 5
    assert "only 1 of 3 hosts answer" in g.message and "--min-hosts 2" in g.message
    assert "newest whole one: step 6 (/run/a/step_00000006 on a)" in g.message and "\n" not in g.message
    g = plan_restart(ElasticSettings(max_restarts=2), probes, last_step=7, failures_so_far=2, after_failure=True)
    assert isinstance(g, GiveUp) and "--max-restarts 2 used up" in g.message
    # A rejoin is not a failure: it never uses up the restarts.
    assert isinstance(plan_restart(ElasticSettings(max_restarts=2), probes, last_step=0, failures_so_far=2,
                                   after_failure=False), Restart)


def test_which_failures_are_worth_a_restart():
    everyone = [_probe("a"), _probe("b")]
    one_gone = [_probe("a"), _probe("b", answered=False)]
    assert worth_restarting(Exit.STALLED, everyone) and worth_restarting(Exit.HOST_LOST, everyone)
    assert worth_restarting(Exit.FAILED, one_gone) and not worth_restarting(Exit.FAILED, everyone)
    assert not worth_restarting(Exit.USAGE, one_gone)


def test_rejoin_waits_for_the_next_checkpoint():
    w = RejoinWatch(immediate=False)
    assert not w.stop_now(3)
    w.host_back(3)
    assert not w.stop_now(3) and w.stop_now(4)
    w2 = RejoinWatch(immediate=True)
    w2.host_back(0)
    assert w2.stop_now(0)


def test_restart_counts_reach_the_metrics(monkeypatch):
    from prometheus_client import generate_latest

    from mlxdist.telemetry.metrics import Metrics

    assert RestartCounts.from_env({"MLXDIST_RESTARTS": "2", "MLXDIST_LOST_STEPS": "x"}) == RestartCounts(2, 0)
    monkeypatch.setenv("MLXDIST_RESTARTS", "2")
    monkeypatch.setenv("MLXDIST_LOST_STEPS", "5")
    text = generate_latest(Metrics(0, "h").registry).decode()
    assert 'mlxdist_restarts_total{host="h",rank="0"} 2.0' in text
    assert 'mlxdist_lost_steps_total{host="h",rank="0"} 5.0' in text


# ----- checkpoint copies on every host, and the probe ------------------------------------


def _save(directory: Path, step: int, gb: int = 12) -> Path:
    w = {"w": np.full(4, step, np.float32)}
    return ckpt.save(directory, step, w, {"m.w": w["w"]}, {"step": step, "position": step * gb, "global_batch": gb})


def test_writers_and_where_they_write(tmp_path):
    every = CheckpointConfig(on_every_host=True)
    assert Checkpointer(every, tmp_path, host="a", rank=0).write_dir == tmp_path / "checkpoints"
    c = Checkpointer(every, tmp_path, host="b", rank=1, local_rank=0)
    assert c.writes and c.write_dir == tmp_path / "replicas" / "b"
    assert not Checkpointer(every, tmp_path, host="a", rank=1, local_rank=1).writes
    assert not Checkpointer(CheckpointConfig(), tmp_path, host="b", rank=1).writes


def test_resume_and_probe_find_the_newest_whole_copy_on_this_host(tmp_path):
    _save(tmp_path / "checkpoints", 3)
    _save(tmp_path / "replicas" / "b", 3)
    newest = _save(tmp_path / "replicas" / "b", 6)
    assert [p.parent.name + "/" + p.name for p in all_copies(tmp_path)] == [
        "b/step_00000006", "checkpoints/step_00000003", "b/step_00000003"]
    (newest / "model.safetensors").write_bytes(b"rot")  # this host's newest copy rotted
    r = subprocess.run([sys.executable, "-m", "mlxdist.state.checkpointer", "probe", str(tmp_path)],
                       capture_output=True, text=True, env=env(), timeout=60)
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["newest"] == {"path": str(tmp_path / "checkpoints" / "step_00000003"), "step": 3,
                                "global_batch": 12}
    assert "model.safetensors fails its sha256 check" in answer["unusable"][0]
    assert newest.is_dir()  # reported, never deleted
    warned = []
    loaded = Checkpointer(CheckpointConfig(resume="auto"), tmp_path).for_resume(warned.append)
    assert loaded.meta.run.step == 3 and len(warned) == 1
    shutil.rmtree(tmp_path / "checkpoints")  # rank 0's disk is gone: the replica still serves
    assert newest_whole(tmp_path, warned.append) == tmp_path / "replicas" / "b" / "step_00000003"


# ----- the supervisor's side, on real processes ---------------------------------------------


def test_supervisor_counts_steps_and_checkpoints_and_stops_on_request():
    script = ("trap 'echo \"mlxdist-complete: step 4 reason signal\"; exit 0' USR1; "
              f"echo '{markers.ready_line(0)}'; echo 'mlxdist-step: 3'; echo 'mlxdist-checkpoint: 3'; "
              "echo visible; while :; do sleep 0.1; done")
    sup = Supervisor(["sh", "-c", script], n_ranks=1, hosts=[], remote=None, tag="t")
    t = threading.Thread(target=lambda: (time.sleep(1.5), sup.request_stop("test")), daemon=True)
    t.start()
    outcome = sup.run()
    assert outcome.code == Exit.OK and sup.asked_stop and sup.stops == 0
    assert (sup.last_step, sup.checkpoints_seen, sup.complete) == (3, 1, (4, "signal"))
    assert markers.parse_progress("mlxdist-step: 12") == ("step", 12)
    assert markers.parse_progress("x mlxdist-step: 12") is None


class _InterruptOnCommand(io.StringIO):
    """Stdout on which the job's command line arrives together with a Ctrl-C: a user who
    presses it the moment mlxrun shows the command, before mpirun has even started."""

    def write(self, text: str) -> int:
        n = super().write(text)
        if "sh -c" in text:
            os.kill(os.getpid(), signal.SIGINT)
        return n


def test_ctrl_c_as_the_command_appears_is_held_until_the_ranks_are_ready():
    script = ("trap 'echo \"mlxdist-complete: step 2 reason signal\"; exit 0' USR1; sleep 0.5; "
              f"echo '{markers.ready_line(0)}'; while :; do sleep 0.1; done")
    err = io.StringIO()
    sup = Supervisor(["sh", "-c", script], n_ranks=1, hosts=[], remote=None, tag="t", out=_InterruptOnCommand(),
                     err=err)
    outcome = sup.run()
    assert outcome.code == Exit.OK and sup.stops == 1 and sup.complete == (2, "signal"), err.getvalue()
    assert "0/1 ranks ready; passing the stop on when all are" in err.getvalue()


def test_elastic_flags_are_checked(tmp_path):
    def mlxrun(*args):
        return subprocess.run([sys.executable, str(ROOT / "launch" / "mlxrun"), *args], capture_output=True,
                              text=True, env=env(), timeout=60)

    hosts = str(ROOT / "hostfiles" / "localhost.hosts")
    r = mlxrun("--hostfile", hosts, "--rejoin", "--dry-run")
    assert r.returncode == 2 and "need --elastic" in r.stderr
    r = mlxrun("--hostfile", hosts, "--elastic", "--min-hosts", "2", "--dry-run")
    assert r.returncode == 2 and "--min-hosts 2: the job has only 1 host(s)" in r.stderr
    r = mlxrun("--hostfile", hosts, "--elastic", "--dry-run", "--", "checkpoint.every=3", "train.lrr=1")
    assert r.returncode == 2 and "unknown key 'train.lrr'" in r.stderr
    r = mlxrun("--hostfile", hosts, "--elastic", "--dry-run", "--", f"train.out_dir={tmp_path}")
    assert r.returncode == 0 and "checkpoint.on_every_host=true" in r.stderr


# ----- three namespace hosts -------------------------------------------------------------

MLXRUN = [sys.executable, str(ROOT / "launch" / "mlxrun")]
STALL_S = 5
TRAIN = ["data.source=synthetic", "data.seq_len=16", "model.preset=tiny", "model.dtype=float32", "metrics.port=0",
         "train.progress=false", "train.eval_every=0", "train.warmup_steps=2", "dist.backend=mpi4py",
         "train.batch_size=4", f"dist.stall_timeout_s={STALL_S}", "checkpoint.every=3",
         "checkpoint.on_every_host=true", "dist.sync_weights_every=0"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from namespace_cluster(tmp_path_factory, 3, "mlxel", "10.83.15")


@pytest.fixture
def healed(cluster):
    """Every host's cable back in and nothing left running after each test, pass or fail."""
    yield cluster
    for h in cluster.hosts:
        with contextlib.suppress(Exception):
            cluster.heal(h)
        cluster.kill(h)
    deadline = time.monotonic() + 20
    while not all(cluster.reachable(1, h) for h in (2, 3)) and time.monotonic() < deadline:
        time.sleep(0.5)


class _Job:
    """launch/mlxrun in the background, its output collected by a thread."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if text in self.out:
                return True
            time.sleep(0.1)
        return text in self.out

    def finish(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.proc.kill()
        self.proc.wait()
        self._reader.join(5)
        return code


def _elastic(c, out: Path, steps: int, *opts: str) -> _Job:
    return _Job([*MLXRUN, "--simcluster", str(c.state_dir), "--elastic", *opts, "--", *TRAIN,
                 f"train.steps={steps}", f"train.out_dir={out}"])


def _events(out: Path, rank: int = 0) -> list[dict]:
    path = out / "logs" / f"rank{rank}.jsonl"
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a killed process
            events.append(json.loads(line))
    return events


def _until_step(job: _Job, out: Path, step: int) -> None:
    deadline = time.monotonic() + 120
    while not any(e["event"] == "step" and e["step"] >= step for e in _events(out)):
        if job.proc.poll() is not None or time.monotonic() > deadline:
            job.finish(1)
            pytest.fail(f"no step {step} before the fault:\n{job.out[-3000:]}")
        time.sleep(0.1)


def _trajectory(out: Path) -> tuple[list[dict], list[int]]:
    """Rank 0's step events across restarts as the run kept them (a restart from step s drops
    the logged steps after s), and the last step of each job before a restart."""
    kept: list[dict] = []
    ends: list[int] = []
    for e in _events(out):
        if e["event"] != "step":
            continue
        if kept and e["step"] <= kept[-1]["step"]:
            ends.append(kept[-1]["step"])
            kept = [k for k in kept if k["step"] < e["step"]]
        kept.append(e)
    return kept, ends


def _assert_contiguous(out: Path, steps: int, global_batch: int = 12) -> list[dict]:
    kept, _ = _trajectory(out)
    assert [e["step"] for e in kept] == list(range(1, steps + 1)), [e["step"] for e in kept]
    # The sample stream goes on where the checkpoint left it: nothing dropped, nothing repeated.
    assert [e["position"] for e in kept] == [global_batch * s for s in range(1, steps + 1)]
    assert {e["global_batch"] for e in kept} == {global_batch}
    return kept


def _restart_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "elastic_restart" in ln]


def _lost(line: str) -> int:
    return int(line.rsplit("steps lost ", 1)[1])


def _all_copies_whole(out: Path) -> list[Path]:
    copies = all_copies(out)
    assert copies and all(ckpt.verify(p) is None for p in copies), [(p, ckpt.verify(p)) for p in copies]
    return copies


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.slow
def test_lost_host_restarts_on_the_survivors(healed, tmp_path: Path) -> None:
    c, steps = healed, 24
    job = _elastic(c, tmp_path, steps, "--min-hosts", "2")
    _until_step(job, tmp_path, 5)
    c.kill(3)  # the Mac dies: its processes and its network
    c.cut(3)
    code = job.finish(240)
    out = job.out
    assert code == 0, f"exit {code}:\n{out[-4000:]}"
    restarts = _restart_lines(out)
    assert len(restarts) == 1, out[-4000:]
    assert "hosts 10.83.15.1 (mlxel1), 10.83.15.2 (mlxel2); dropped 10.83.15.3" in restarts[0], restarts[0]
    kept = _assert_contiguous(tmp_path, steps)
    _, ends = _trajectory(tmp_path)
    resumed = int(restarts[0].split("resuming from step ")[1].split()[0])
    # No end recorded: the host died just after the checkpoint the survivors resume from, nothing redone.
    end = ends[0] if ends else resumed
    assert resumed % 3 == 0 and resumed >= 3 and end - resumed - 1 <= _lost(restarts[0]) <= end - resumed
    # Same global batch on two hosts: each takes 6 samples in two micro-batches of 4 (accumulation 2).
    assert kept[-1]["shares"] == [6, 6] and kept[0]["shares"] == [4, 4, 4]
    assert f"job completed at step {steps} (after 1 elastic restart(s), {_lost(restarts[0])} step(s) lost) " \
           "[exit 0]" in out, out[-2000:]


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.slow
def test_losing_rank_0s_host_and_its_disk_resumes_from_another_hosts_copy(healed, tmp_path: Path) -> None:
    c, steps = healed, 18
    job = _elastic(c, tmp_path, steps, "--min-hosts", "2")
    _until_step(job, tmp_path, 4)
    c.kill(1)
    c.cut(1)
    # Its disk goes with it: rank 0's checkpoints are no longer there to find.
    (tmp_path / "checkpoints").rename(tmp_path / "checkpoints-on-the-lost-host")
    code = job.finish(240)
    out = job.out
    assert code == 0, f"exit {code}:\n{out[-4000:]}"
    restarts = _restart_lines(out)
    assert len(restarts) == 1 and "hosts 10.83.15.2 (mlxel2), 10.83.15.3 (mlxel3)" in restarts[0], out[-4000:]
    assert f"({tmp_path}/replicas/mlxel2/step_" in restarts[0], restarts[0]
    assert f"resumed from {tmp_path}/replicas/mlxel2/step_" in out
    _assert_contiguous(tmp_path, steps)
    assert ckpt.verify(tmp_path / "checkpoints" / f"step_{steps:08d}") is None


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.slow
def test_cut_link_heals_and_the_host_rejoins_at_a_checkpoint(healed, tmp_path: Path) -> None:
    c, steps = healed, 90
    job = _elastic(c, tmp_path, steps, "--min-hosts", "2", "--rejoin")
    _until_step(job, tmp_path, 4)
    c.cut(3)
    assert job.wait_for("elastic_restart 1", STALL_S + 60), job.out[-4000:]
    c.heal(3)
    code = job.finish(300)
    out = job.out
    assert code == 0, f"exit {code}:\n{out[-4000:]}"
    restarts = _restart_lines(out)
    assert len(restarts) == 2, out[-4000:]
    assert "reason stall" in restarts[0] and "dropped 10.83.15.3" in restarts[0]
    assert "reason rejoin" in restarts[1] and "(mlxel3)" in restarts[1] and _lost(restarts[1]) == 0
    assert "10.83.15.3 answers again; it rejoins at the next checkpoint" in out
    kept = _assert_contiguous(tmp_path, steps)
    # The rejoin stop saved where the ranks stopped, after the next periodic checkpoint.
    rejoined_at = int(restarts[1].split("resuming from step ")[1].split()[0])
    stopped = [ln for ln in out.splitlines() if "to take back 10.83.15.3" in ln]
    assert stopped and stopped[0].startswith(f"mlxrun: job stopped at step {rejoined_at} "), stopped
    assert kept[-1]["shares"] == [4, 4, 4]
    # ... and the host that came back takes its share again.
    back = [e for e in _events(tmp_path, 2) if e["event"] == "step" and e["step"] > rejoined_at]
    assert back and {e["host"] for e in back} == {"mlxel3"} and back[-1]["samples"] == 4


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.slow
def test_fewer_than_min_hosts_is_one_clear_error_with_checkpoints_intact(healed, tmp_path: Path) -> None:
    c = healed
    job = _elastic(c, tmp_path, 1000, "--min-hosts", "3")
    _until_step(job, tmp_path, 4)
    c.kill(2)
    c.cut(2)
    code = job.finish(120)
    out = job.out
    assert code == 5, f"exit {code}:\n{out[-4000:]}"
    final = out.strip().splitlines()[-1]
    assert final.startswith("mlxrun: elastic: only 2 of 3 hosts answer") and "--min-hosts 3" in final, final
    newest = int(final.split("newest whole one: step ")[1].split()[0])
    assert final.endswith("[exit 5]") and newest >= 3 and newest % 3 == 0, final
    assert not _restart_lines(out)
    copies = _all_copies_whole(tmp_path)
    assert {p.parent.name for p in copies} == {"checkpoints", "mlxel2", "mlxel3"}
