"""The ring's two halves with unequal ranges (`ring_reduce_scatter`, `ring_allgather`), which
the sharded strategy uses between hosts: exact sums on the owner, and every rank ending with
the same bits, for ranges of any size (empty ones too)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, mpirun_path

PROG = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    from mlxdist.cluster.codec import bf16_bits
    from mlxdist.cluster.ring import ring_allgather, ring_reduce_scatter

    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    sizes = [1000, 7, 33_333, 1]  # flat arrays of a model's gradients; ranges straddle them
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])

    def owners_of(weights):
        cuts = np.concatenate([[0], np.cumsum(weights) / sum(weights) * total]).astype(int)
        cuts[-1] = total
        out = []
        for a in range(len(sizes)):
            ranges = []
            for o in range(n):
                lo, hi = max(cuts[o], offsets[a]), min(cuts[o + 1], offsets[a + 1])
                ranges.append((int(lo - offsets[a]), int(hi - offsets[a])) if hi > lo else (0, 0))
            out.append(ranges)
        return out

    for weights in ([1] * n, [8] + [1] * (n - 1), [0] + [1] * (n - 1)):
        owners = owners_of(weights)
        rng = np.random.default_rng(7)
        everyone = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]
        mine = np.zeros(sum(o[r][1] - o[r][0] for o in owners), np.float32)
        ring_reduce_scatter(comm, everyone[r], owners, mine, segment_bytes=400, window=3)
        sums = [np.sum([everyone[q][a] for q in range(n)], axis=0, dtype=np.float64) for a in range(len(sizes))]
        want = np.concatenate([sums[a][o[r][0]:o[r][1]] for a, o in enumerate(owners)])
        assert np.max(np.abs(mine - want), initial=0) < 1e-5, (weights, r)
        full = [np.full(s, np.nan, np.float32) for s in sizes]
        at = 0
        for a, o in enumerate(owners):
            lo, hi = o[r]
            full[a][lo:hi] = mine[at:at + hi - lo]
            at += hi - lo
        ring_allgather(comm, full, owners, segment_bytes=400, window=3)
        flat = np.concatenate(full)
        assert np.max(np.abs(flat - np.concatenate(sums))) < 1e-5, (weights, r)
        every = comm.allgather(flat.tobytes())
        assert all(x == every[0] for x in every), "ranks hold different bits"

    # bfloat16 on the wire (uint16 bit patterns): each hop's sum rounded as MLX rounds.
    ranges = [(total * o // n, total * (o + 1) // n) for o in range(n)]
    x = np.random.default_rng(r).standard_normal(total).astype(np.float32)
    lo, hi = ranges[r]
    mine = np.zeros(hi - lo, np.uint16)
    ring_reduce_scatter(comm, [bf16_bits(x)], [ranges], mine, segment_bytes=64, window=2)
    ref = np.sum([np.random.default_rng(q).standard_normal(total).astype(np.float32) for q in range(n)], axis=0)
    got = (mine.astype(np.uint32) << 16).view(np.float32)
    assert np.max(np.abs(got - ref[lo:hi])) < 0.05 * n, np.max(np.abs(got - ref[lo:hi]))
    if r == 0:
        print("SHARD RING OK", n)
""")


@pytest.mark.cluster
@pytest.mark.parametrize("n", [1, 2, 3])
def test_ring_halves_with_unequal_ranges_are_exact(tmp_path: Path, n: int) -> None:
    prog = tmp_path / "ring_shard.py"
    prog.write_text(PROG)
    res = subprocess.run([mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-x", f"PYTHONPATH={ROOT}",
                          "-np", str(n), sys.executable, str(prog)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SHARD RING OK {n}" in res.stdout
