"""The logic `bench cluster` reports with and the commands it builds, without namespace hosts
(the bench itself needs root and minutes: `python -m mlxdist.bench cluster`; docs/measurements.md
"Side by side on two unequal hosts" has its runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxdist.bench.cluster import (
    equal_split_bound,
    mlx_launch_command,
    mlx_launch_hostfile,
    mlx_lm_config,
    of_ideal,
    parse_reports,
    ring_hostfile,
    ssh_standin,
    step_rate,
    tokens_per_s,
)
from mlxdist.bench.finetune import lora_overrides

S = {"steps": 12, "batch": 6, "seq": 48, "layers": 4, "rank": 8, "alpha": 16.0, "targets": "q_proj,v_proj",
     "lr": 1e-4, "skip": 2}


def test_an_equal_split_with_one_host_at_half_speed_reaches_two_thirds_of_the_ideal() -> None:
    # The anchor: hosts at 100 and 50 tokens/s, split equally, step at the slow one's pace.
    assert equal_split_bound([100.0, 50.0]) == pytest.approx(2 / 3)
    assert equal_split_bound([80.0, 80.0]) == pytest.approx(1.0)
    assert of_ideal(138.0, [100.0, 50.0]) == pytest.approx(0.92)


def test_tokens_per_s_counts_the_steps_between_the_first_and_last_kept_report() -> None:
    times = [0.0, 5.0, 7.0, 9.0, 11.0]  # a slow first step (compilation), then 2 s a step
    assert tokens_per_s(times, 288, skip=1) == pytest.approx(3 * 288 / 6.0)
    with pytest.raises(RuntimeError, match="need more than 5"):
        tokens_per_s(times, 288, skip=4)


def test_step_rate_sums_the_timed_spans_of_every_rank_share() -> None:
    events = [{"event": "start"}, *({"event": "step", "shares": sh, "step_s": t}
                                    for sh, t in (([8, 8], 9.0), ([8, 8], 1.0), ([11, 5], 1.0), ([11, 5], 2.0)))]
    assert step_rate(events, skip=1) == pytest.approx(48 / 4.0)


def test_mlx_lm_report_lines_are_read_and_other_output_is_not() -> None:
    lines = [(1.0, "Trainable parameters: 0.030% (0.041M/135.515M)"),
             (2.0, "     1    6.674 \u25bc      97    0.2k"),
             (3.5, "  \x1b[2m   2\x1b[0m    \x1b[1;33m6.735 \u25b2\x1b[0m    \x1b[1m1,201\x1b[0m    \x1b[2m  0.5k\x1b[0m"),
             (4.0, "Iter 2: Val loss 6.1")]
    assert parse_reports(lines) == [(2.0, 1, 6.674), (3.5, 2, 6.735)]


def test_mlx_lm_trains_what_mlxdist_trains() -> None:
    data = Path("/data")
    cfg = mlx_lm_config("/model", data, Path("/out"), S)
    ours = dict(o.split("=", 1) for o in lora_overrides("/model", data / "train.jsonl", S))
    assert cfg["model"] == ours["model.path"] and cfg["num_layers"] == int(ours["finetune.layers"])
    assert cfg["lora_parameters"] == {"rank": 8, "scale": 16.0 / 8, "dropout": 0.0,
                                      "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    assert cfg["batch_size"] == int(ours["train.batch_size"]) and cfg["iters"] == int(ours["train.steps"])
    assert cfg["learning_rate"] == float(ours["train.lr"]) and cfg["optimizer"] == "adam"
    assert cfg["max_seq_length"] == int(ours["data.seq_len"]) + 1 and cfg["mask_prompt"] is True


def test_launch_files_and_command() -> None:
    assert ring_hostfile(["10.0.0.1", "10.0.0.2"], 5000) == [["10.0.0.1:5000"], ["10.0.0.2:5001"]]
    hf = mlx_launch_hostfile([("h1", "10.0.0.1"), ("h2", "10.0.0.2")])
    assert hf["backend"] == "ring" and [h["ips"] for h in hf["hosts"]] == [["10.0.0.1"], ["10.0.0.2"]]
    cmd = mlx_launch_command(Path("/h.json"), Path("/c.yaml"), python="/venv/bin/python")
    assert cmd[0] == "/venv/bin/mlx.launch" and cmd[cmd.index("--") + 1:] == ["-m", "mlx_lm", "lora", "-c", "/c.yaml"]


def test_ssh_standin_runs_mlx_launch_scripts_under_bash_through_the_agent(tmp_path) -> None:
    # A stand-in agent that evaluates its command with sh, as the rig's does: the bash-only
    # script mlx.launch sends (arrays, [[ ]]) must still run, its options dropped.
    agent = tmp_path / "agent"
    agent.write_text('#!/bin/sh\necho "host=$1" >&2\nshift\neval "$*"\n')
    agent.chmod(0o755)
    ssh = tmp_path / "ssh"
    ssh.write_text(ssh_standin(agent))
    ssh.chmod(0o755)
    script = "if [[ -d / ]]; then cmd=(echo 'a b' ok); \"${cmd[@]}\"; fi"
    res = subprocess.run([str(ssh), "-tt", "-o", "LogLevel=QUIET", "node1", script], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "a b ok\n" and "host=node1" in res.stderr


def test_bad_rows_are_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "mlxdist.bench", "cluster", "--rows", "lora,jax"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--rows lora,jax: expected a comma list of lora, torch" in res.stderr
