"""The PyTorch path must run where MLX cannot be installed (a CUDA box, an Intel Mac)."""

import subprocess
import sys

import pytest
from helpers import env

pytest.importorskip("torch")

BLOCK_MLX = """
import sys
class NoMLX:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx" or name.startswith("mlx."):
            raise ModuleNotFoundError("No module named 'mlx' (blocked by test)")
sys.meta_path.insert(0, NoMLX())
from mlxdist.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_torch_engine_trains_without_mlx(tmp_path):
    r = subprocess.run([sys.executable, "-c", BLOCK_MLX, "--engine", "torch", "--device", "cpu",
                        "data.source=synthetic", "data.seq_len=16", "train.steps=3", "metrics.port=0",
                        f"train.out_dir={tmp_path}"], capture_output=True, text=True, env=env(), timeout=180)
    assert r.returncode == 0, r.stderr
    assert "engine torch" in r.stderr and (tmp_path / "checkpoints" / "step_00000003").is_dir()
