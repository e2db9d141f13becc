"""The all-reduce benchmark runs end to end, and the mpi4py ring it measures sums
exactly: a fast sync that is wrong would silently split the ranks' weights."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, env, mpirun_path

from mlxdist.bench.allreduce import busbw_gbs, default_sizes, parse_size


def test_sizes_and_busbw() -> None:
    assert parse_size("64M") == 64 * 2**20 and parse_size("1k") == 1024
    assert parse_size("4096") == 4096
    assert default_sizes(False)[0] == 1024 and default_sizes(False)[-1] == 256 * 2**20
    assert busbw_gbs(10**9, 1.0, 2) == pytest.approx(1.0)
    assert busbw_gbs(10**9, 1.0, 4) == pytest.approx(1.5)


@pytest.mark.cluster
def test_quick_run_prints_all_transports() -> None:
    mpirun_path()
    res = subprocess.run(
        [sys.executable, "-m", "mlxdist.bench.allreduce", "--quick", "--sizes", "1M"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    head = next(ln for ln in lines if ln.lstrip().startswith("size"))
    for t in ("raw-mpi4py", "mpi4py", "mlx-mpi", "mlx-ring"):
        assert f"{t} ms" in head, head
    rows = [ln for ln in lines if re.match(r"\s*\d+ (B|KiB|MiB|GiB) ", ln)]
    assert len(rows) >= 3 and any(r.strip().startswith("1 MiB") for r in rows)
    for row in rows:
        cells = [c.split() for c in row.split("|")[1:]]
        assert len(cells) == 4, row
        for ms, gbs in cells:
            assert float(ms) > 0 and float(gbs) > 0, row


RING = textwrap.dedent("""
    import sys
    import mlx.core as mx
    import numpy as np
    from mlxdist.cluster.ring import ring_allreduce
    from mlxdist.cluster.transport import MpiTransport
    from mlxdist.models.weights import checksum
    from mlxdist.sync.grad import GradSync
    from mlxdist.cluster.world import init_world

    world = init_world("mpi4py")
    r, n = world.rank, world.size
    # Odd lengths (chunks of unequal size), one smaller than the segment, several arrays.
    lens = [1, 7, 100_003, 70_001, 300_000]
    srcs = [np.arange(k, dtype=np.float32) % 97 + r for k in lens]
    outs = [np.empty_like(s) for s in srcs]
    ring_allreduce(world.comm, srcs, outs, segment_bytes=4096, window=3)
    for k, o in zip(lens, outs):
        want = n * (np.arange(k, dtype=np.float32) % 97) + n * (n - 1) / 2
        assert np.array_equal(o, want), (k, o[:5], want[:5])
    coll = MpiTransport(world)
    for wire, ring in [(w, g) for w in ("float32", "float16", "bfloat16") for g in (False, True)]:
        coll.multi_host = ring  # one host: the ring forced, as between hosts
        sync = GradSync(coll, bucket_mb=0.5, wire_dtype=wire)
        grads = [mx.full((k,), float(r + 1)) for k in (3, 64, 200_000, 1 << 20)]
        for _ in range(2):  # the second call reuses the cached buffers
            out, stats = sync.all_sum(grads)
            mx.eval(out)
            for g, o in zip(grads, out):
                assert o.shape == g.shape and o.dtype == mx.float32
                assert bool(mx.all(o == n * (n + 1) / 2).item()), (wire, g.shape)
        sums = world.allgather(checksum([np.array(o) for o in out]))
        assert len(set(sums)) == 1, sums
    if r == 0:
        print("RING OK", n)
""")


@pytest.mark.cluster
@pytest.mark.parametrize("n", [2, 3])
def test_ring_allreduce_exact(tmp_path: Path, n: int) -> None:
    prog = tmp_path / "ring.py"
    prog.write_text(RING)
    res = subprocess.run(
        [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-x", f"PYTHONPATH={ROOT}",
         "-np", str(n), sys.executable, str(prog)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"RING OK {n}" in res.stdout


def test_bench_measures_between_the_hosts_of_a_hostfile(tmp_path: Path) -> None:
    """What the README tells Mac users to run between their Macs (here the one-host hostfile)."""
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "mlxdist.bench.allreduce", "--hostfile",
                        str(ROOT / "hostfiles" / "localhost.hosts"), "--transports", "raw-mpi4py,mpi4py",
                        "--sizes", "4K,64K", "--only-sizes", "--quick", "--json", str(out)],
                       capture_output=True, text=True, env=env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    merged = json.loads(out.read_text())
    assert merged["n"] == 2 and set(merged["results"]) == {"raw-mpi4py", "mpi4py"}
    assert all(float(v) > 0 for t in merged["results"].values() for v in t.values())
