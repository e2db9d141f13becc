"""`launch/mlxrun --hostfile hosts.json`: hostfiles written by `mlx.distributed_config`
launch like Open MPI ones, with their `envs` and their path handed to every rank."""

import json
import subprocess
import sys

from helpers import ROOT, env


def _mlxrun(*args, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "launch" / "mlxrun"), *args], capture_output=True,
                          text=True, env=env(), timeout=timeout)


def _write(tmp_path, hosts, envs=()):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"backend": "jaccl", "envs": list(envs),
                              "hosts": [{"ssh": h, "ips": ["127.0.0.1"], "rdma": [None, None]} for h in hosts]}))
    return hf


def test_dry_run_converts_and_exports(tmp_path):
    hf = _write(tmp_path, ["localhost", "localhost"], envs=["MLX_METAL_FAST_SYNCH=1"])
    r = _mlxrun("--hostfile", str(hf), "--dry-run", "--", "train.steps=1")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip()
    assert "-np 2" in cmd and f"MLXDIST_MLX_HOSTFILE={hf}" in cmd and "MLX_METAL_FAST_SYNCH=1" in cmd
    assert "mlx.distributed_config hostfile (2 ranks, backend jaccl)" in r.stderr


def test_json_hostfile_trains_diloco_on_localhost(tmp_path):
    hf = _write(tmp_path, ["localhost", "localhost"])
    out = tmp_path / "run"
    r = _mlxrun("--hostfile", str(hf), "--", "data.source=synthetic", "data.seq_len=16", "model.preset=tiny",
                "train.steps=4", "metrics.port=0", "dist.mode=diloco", "dist.inner_steps=2",
                f"train.out_dir={out}", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "2 rank(s)" in r.stderr and (out / "checkpoints" / "step_00000004").is_dir()
    assert "diloco: step 4: fragment 1/1 synced" in r.stderr


def test_broken_json_hostfile_is_one_line(tmp_path):
    hf = tmp_path / "hosts.json"
    hf.write_text('{"hosts": [{"ssh": "studio", "ips": [}')
    r = _mlxrun("--hostfile", str(hf), "--dry-run")
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"error: hostfile {hf}: not valid JSON"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
