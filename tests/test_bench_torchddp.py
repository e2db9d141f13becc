"""`bench torchddp`'s two plain loops: DDP over gloo and the same lines on mlxdist.torch (your-loop
mode) train the same model on the same batches, so their losses agree step by step; a faster
your-loop row that trained something else would compare nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, env, mpirun_path

from mlxdist.bench.torchddp import _free_port, rate_bits


def test_rate_bits() -> None:
    assert rate_bits("1gbit") == 1e9 and rate_bits("100mbit") == 1e8
    with pytest.raises(ValueError):
        rate_bits("1gb")


@pytest.mark.cluster
def test_yourloop_matches_ddp_step_by_step(tmp_path) -> None:
    mpirun = mpirun_path()
    steps, out = 3, {}
    for loop in ("ddp", "yourloop"):
        e = env() | {"MLXDIST_DDP_MASTER": f"127.0.0.1:{_free_port()}", "MLXDIST_DDP_OUT": str(tmp_path / loop)}
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", "-x",
               "OPENBLAS_NUM_THREADS", "-x", "MLXDIST_DDP_MASTER", "-x", "MLXDIST_DDP_OUT", sys.executable, "-m",
               "mlxdist.bench.ddp_worker", "--loop", loop, "--preset", "tiny", "--steps", str(steps)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=e)
        assert res.returncode == 0, res.stdout + res.stderr
        out[loop] = json.loads((tmp_path / loop).read_text())
    for loop in out:
        assert len(out[loop]["step_s"]) == steps and all(t > 0 for t in out[loop]["step_s"])
    assert out["yourloop"]["loss"] == pytest.approx(out["ddp"]["loss"], abs=1e-6)  # measured: equal
