"""ruff lints every Python file of the project: a folder it skips by default (it excluded
`mlxdist/dist/` as build output until the package was renamed) or a script without `.py`
would otherwise go unlinted without a word."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked_python_files() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set()
    for name in out.split():
        path = ROOT / name
        if name.endswith(".py") or (path.is_file() and path.read_bytes()[:40].startswith(b"#!/usr/bin/env python")):
            files.add(name)
    return files


@pytest.fixture(scope="module")
def ruff() -> str:
    exe = shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return exe


def test_ruff_sees_every_python_file(ruff):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of the project's files")
    shown = subprocess.run([ruff, "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True).stdout
    linted = {str(Path(line.strip()).resolve().relative_to(ROOT)) for line in shown.splitlines() if line.strip()}
    missed = sorted(_tracked_python_files() - linted)
    assert not missed, f"ruff check . skips {missed}: see [tool.ruff] in pyproject.toml"
    assert any(name.startswith("mlxdist/cluster/") for name in linted)


def test_ruff_is_clean(ruff):
    r = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]


def test_import_contracts_hold():
    """The arrows DESIGN forbids (engine -> sync/cluster, models -> engine, control -> cluster,
    cluster -> sync, product -> rig/bench), as pyproject.toml's import-linter contracts."""
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    r = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:]
