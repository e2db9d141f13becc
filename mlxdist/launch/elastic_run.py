"""`launch/mlxrun --elastic`: keep a job going when a host dies, is cut off or stalls.

Each job runs under the ordinary `supervisor.Supervisor` (which ends a failed job within
seconds and cleans up). When one fails, every host is asked, through the same ssh path mpirun
uses, whether it answers and which checkpoint verifies on it
(`python -m mlxdist.state.checkpointer probe`); `elastic.plan_restart` decides the next job, whose
rank 0 is the host holding the newest whole copy (`--resume auto` there finds it) and whose
global batch is the checkpoint's. With `--rejoin`, dropped hosts are polled while the job runs;
one that answers again is taken back at the next checkpoint (the job stops there, saving,
and restarts with it).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..markers import Exit, RestartCounts
from ..state.run_lock import ELASTIC_ENV
from .elastic import (
    Copy,
    ElasticSettings,
    GiveUp,
    Probe,
    RejoinWatch,
    failure_reason,
    plan_restart,
    restart_args,
    restart_line,
    worth_restarting,
)
from .hosts import NETWORK_TIMEOUT_S, Remote, host_answers, network_problem
from .job import Launch
from .supervisor import Supervisor

PROBE_TIMEOUT_S = 60.0  # hashing a big checkpoint takes a while
REJOIN_POLL_S = 2.0


def _say(text: str) -> None:
    print(f"mlxrun: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ProbeTarget:
    """How to run the checkpoint probe on a host: same python, directory and run dir as the ranks."""

    python: str
    cwd: str
    run_dir: str

    def script(self) -> str:
        path = os.environ.get("PYTHONPATH")
        env = f"PYTHONPATH={shlex.quote(path)} " if path else ""
        return (f"cd {shlex.quote(self.cwd)} && {env}{shlex.quote(self.python)} -m mlxdist.state.checkpointer "
                f"probe {shlex.quote(self.run_dir)}")


def probe_host(host: str, remote: Remote, target: ProbeTarget) -> Probe:
    why = network_problem(host)
    if why:
        return Probe(host, answered=False, why=why)
    r = remote.run(host, target.script(), timeout=PROBE_TIMEOUT_S)
    if r.returncode is None:
        return Probe(host, answered=False, why=f"no answer within {PROBE_TIMEOUT_S:.0f}s")
    lines = r.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if r.returncode == 0 and lines else None
    except json.JSONDecodeError:
        data = None
    if data is None:
        return Probe(host, answered=False, why=f"the checkpoint probe failed there ({r.why})")
    newest = data.get("newest")
    copy = (Copy(host, newest["path"], int(newest["step"]), newest.get("global_batch"))
            if newest else None)
    return Probe(host, answered=True, name=data.get("host", ""), newest=copy,
                 unusable=tuple(data.get("unusable", ())))


def probe_all(hosts: list[str], remote: Remote, target: ProbeTarget) -> list[Probe]:
    """Ask every host at once; the answers come back in `hosts` order."""
    out: dict[str, Probe] = {}

    def one(h: str) -> None:
        out[h] = probe_host(h, remote, target)

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROBE_TIMEOUT_S + NETWORK_TIMEOUT_S + 5)
    return [out.get(h, Probe(h, answered=False, why="the probe did not return")) for h in hosts]


class RejoinWatcher:
    """While a job runs: poll the dropped hosts; when one answers, stop the job at the next
    checkpoint so the supervisor can restart it with the host back in."""

    def __init__(self, sup: Supervisor, dropped: list[str], remote: Remote, immediate: bool) -> None:
        self.sup, self.dropped, self.remote = sup, dropped, remote
        self.watch = RejoinWatch(immediate)
        self.back: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rejoin-watch")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.wait(REJOIN_POLL_S):
            for h in self.dropped:
                if h not in self.back and host_answers(h, self.remote):
                    self.back.append(h)
                    self.watch.host_back(self.sup.checkpoints_seen)
                    _say(f"elastic: {h} answers again; it rejoins at the next checkpoint")
            if self.watch.stop_now(self.sup.checkpoints_seen):
                self.sup.request_stop(f"elastic: rejoining {', '.join(self.back)}")
                return


@dataclass
class ElasticRun:
    launch: Launch
    settings: ElasticSettings
    train_args: list[str]
    python: str
    tcp_links: int
    env: list[str]
    grace: float
    target: ProbeTarget
    checkpoint_every: int

    def run(self) -> int:
        try:
            with tempfile.TemporaryDirectory(prefix="mlxrun-elastic-") as tmp:
                return self._loop(Path(tmp))
        except KeyboardInterrupt:
            _say("interrupted between jobs; nothing is running. Continue with --resume auto [exit 130]")
            return int(Exit.KILLED)

    def _loop(self, tmp: Path) -> int:
        remote = self.launch.remote()
        everyone = [h.name for h in self.launch.hosts]
        launch, hosts, dropped = self.launch, list(everyone), []
        counts, failures, extra = RestartCounts(), 0, []
        # One value for all of this run's jobs: a restarted job may take the run folder's lock
        # over from the job before it (which has ended), even when that job's writer ran on a
        # host now gone, on a disk they share.
        elastic_run = f"{ELASTIC_ENV}={secrets.token_hex(8)}"
        while True:
            tag = secrets.token_hex(4)
            cmd = launch.command([*self.train_args, *extra], python=self.python, tcp_links=self.tcp_links,
                                 env=[*self.env, *counts.env(), elastic_run], tag=tag)
            sup = Supervisor(cmd, n_ranks=launch.n_ranks, hosts=hosts, remote=remote, tag=tag, grace=self.grace)
            watcher = None
            if self.settings.rejoin and dropped:
                watcher = RejoinWatcher(sup, dropped, remote, immediate=not self.checkpoint_every)
                watcher.start()
            outcome = sup.run()
            if watcher is not None:
                watcher.stop()
            rejoining = (watcher.back if watcher is not None and sup.asked_stop and not sup.stops
                         and sup.complete is not None and sup.complete[1] == "signal" else [])
            if rejoining:
                _say(f"job stopped at step {sup.complete[0]} to take back {', '.join(rejoining)}")
                reason, after_failure = "rejoin", False
                candidates = hosts + [h for h in everyone if h in rejoining]
            else:
                reason = failure_reason(outcome.code)
                if reason is None:  # finished, stopped by the user, or a usage error
                    after = (f" (after {counts.restarts} elastic restart(s), {counts.lost_steps} step(s) lost)"
                             if outcome.code == Exit.OK and counts.restarts else "")
                    _say(f"{outcome.message}{after} [exit {int(outcome.code)}]")
                    return int(outcome.code)
                _say(outcome.message)
                after_failure, candidates = True, hosts
            _say(f"elastic: asking {len(candidates)} host(s) whether they answer and which checkpoint they hold")
            probes = probe_all(candidates, remote, self.target)
            for p in probes:
                for line in p.unusable:
                    _say(f"{p.label}: {line}")
            if after_failure and not worth_restarting(outcome.code, probes):
                _say(f"elastic: every host answers, so a restart would fail the same way; not restarting "
                     f"[exit {int(outcome.code)}]")
                return int(outcome.code)
            decision = plan_restart(self.settings, probes, last_step=sup.last_step if after_failure else 0,
                                    failures_so_far=failures, after_failure=after_failure)
            if isinstance(decision, GiveUp):
                _say(f"{decision.message} [exit {int(decision.code)}]")
                return int(decision.code)
            failures += after_failure
            counts = RestartCounts(counts.restarts + 1, counts.lost_steps + decision.steps_lost)
            _say(restart_line(counts.restarts, reason, decision, probes))
            hosts = decision.hosts
            dropped = [h for h in everyone if h not in hosts]
            launch = self.launch.subset(hosts, tmp / f"hostfile-{counts.restarts}")
            extra = restart_args(decision)
