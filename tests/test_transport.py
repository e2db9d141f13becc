"""The transport's collectives on real ranks, per backend: all-reduce (fp32, bf16 bits, MLX
arrays), reduce-scatter and all-gather with unequal ranges (empty ones too), gather, broadcast,
the byte all-gather and a channel on a thread, each against numpy. One launch runs them all."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, env, mpirun_path

PROG = textwrap.dedent("""
    import sys
    import threading

    import numpy as np

    from mlxdist.cluster.codec import bf16_bits
    from mlxdist.cluster.transport import make_transport
    from mlxdist.cluster.world import init_world

    backend = sys.argv[1]
    world = init_world(backend)
    t = make_transport(world, backend)
    n, r = t.size, t.rank
    assert (n, r) == (world.size, world.rank), (n, r)
    sizes = [1000, 7, 33_333, 1, 5]  # a model's flat arrays; ranges straddle them
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    everyone = [[np.random.default_rng(100 + q).standard_normal(s).astype(np.float32) for s in sizes]
                for q in range(n)]
    sums = [np.sum([everyone[q][a] for q in range(n)], axis=0, dtype=np.float64) for a in range(len(sizes))]

    def same_everywhere(arrays, what):
        every = world.allgather(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
        assert all(x == every[0] for x in every), f"{what}: ranks hold different bits"

    def close(got, want, tol, what):
        err = max((float(np.max(np.abs(g.astype(np.float64) - w), initial=0)) for g, w in zip(got, want)), default=0)
        assert err <= tol, f"{what}: off by {err:.3g} on rank {r}"

    # all-reduce: fp32 (and with identical bits asked for), bf16 as its uint16 bits
    for identical in (False, True):
        mine = [x.copy() for x in everyone[r]]
        out = t.all_sum(mine, identical=identical)
        close(out, sums, 1e-5, f"all_sum identical={identical}")
        assert all(o is not m for o, m in zip(out, mine))
        close(mine, everyone[r], 0, "all_sum left its inputs")
        if identical:
            same_everywhere(out, "all_sum identical=True")
    out = t.all_sum([bf16_bits(x) for x in everyone[r]])
    assert all(o.dtype == np.uint16 for o in out)
    close([(o.astype(np.uint32) << 16).view(np.float32) for o in out], sums, 0.05 * n, "all_sum bf16")

    def owners_of(weights):
        cuts = np.concatenate([[0], np.cumsum(weights) / sum(weights) * total]).astype(int)
        cuts[-1] = total
        return [[(int(max(cuts[o], offsets[a]) - offsets[a]), int(min(cuts[o + 1], offsets[a + 1]) - offsets[a]))
                 if min(cuts[o + 1], offsets[a + 1]) > max(cuts[o], offsets[a]) else (0, 0) for o in range(n)]
                for a in range(len(sizes))], [(int(cuts[o]), int(cuts[o + 1])) for o in range(n)]

    # reduce-scatter, all-gather and gather with unequal ranges; rank 0 owns nothing in the last;
    # mpi4py both ways: Open MPI's collectives (one host) and the ring (forced, as between hosts)
    rounds = [(w, ring) for w in ([1] * n, [8] + [1] * (n - 1), [0] + [1] * (n - 1))
              for ring in ((False, True) if hasattr(t, "pipelined") else (False,))]
    for weights, ring in rounds:
        if ring:
            t.pipelined = True
        owners, bounds = owners_of(weights)
        want = np.concatenate([sums[a][o[r][0]:o[r][1]] for a, o in enumerate(owners)])
        for bucket in (1 << 20, 1000):  # whole, and cut into buckets that straddle arrays
            srcs = [x.copy() for x in everyone[r]]
            mine = np.zeros(sum(o[r][1] - o[r][0] for o in owners), np.float32)
            t.reduce_scatter(srcs, owners, mine, consume=True, bucket=bucket)
            close([mine], [want], 1e-5, f"reduce_scatter {weights} bucket {bucket}")
            full = [np.full(s, np.nan, np.float32) for s in sizes]
            at = 0
            for a, o in enumerate(owners):
                lo, hi = o[r]
                full[a][lo:hi] = mine[at:at + hi - lo]
                at += hi - lo
            t.all_gather(full, owners, bucket=bucket)
            close(full, sums, 1e-5, f"all_gather {weights} bucket {bucket}")
            same_everywhere(full, f"all_gather {weights}")
            vector = np.arange(total, dtype=np.float32) * 1.5
            lo, hi = bounds[r]
            got = t.gather(vector[lo:hi].copy(), bounds, total, root=n - 1, bucket=bucket)
            if r == n - 1:
                assert np.array_equal(got, vector), f"gather {weights}"
            else:
                assert got is None
        t.pipelined = False
    # a bf16 wire through the reduce-scatter (the sharded strategy's dist.wire_dtype=bfloat16)
    owners, _ = owners_of([1] * n)
    mine = np.zeros(sum(o[r][1] - o[r][0] for o in owners), np.uint16)
    t.reduce_scatter([bf16_bits(x) for x in everyone[r]], owners, mine)
    want = np.concatenate([sums[a][o[r][0]:o[r][1]] for a, o in enumerate(owners)])
    close([(mine.astype(np.uint32) << 16).view(np.float32)], [want], 0.05 * n, "reduce_scatter bf16")

    # broadcast, the byte all-gather, barrier
    bufs = [np.full(10, r, np.float32), np.arange(5, dtype=np.float32) * (r + 1)]
    t.broadcast(bufs, root=n - 1)
    assert np.array_equal(bufs[0], np.full(10, n - 1, np.float32)) and np.array_equal(bufs[1], np.arange(5) * n)
    payloads = [np.random.default_rng(q).integers(0, 256, 37).astype(np.uint8) for q in range(n)]
    got = t.all_gather_bytes(payloads[r])
    assert len(got) == n and all(np.array_equal(g, p) for g, p in zip(got, payloads)), "all_gather_bytes"
    t.barrier()

    # a channel on a thread while this thread runs its own collectives
    ch = t.channel(pipelined=True)
    res = {}

    def background():
        res["sum"] = ch.all_sum([np.full(100_003, r + 1, np.float32)])[0]
        m = np.zeros(sum(o[r][1] - o[r][0] for o in owners), np.float32)
        ch.reduce_scatter([x.copy() for x in everyone[r]], owners, m)
        res["rs"] = m

    th = threading.Thread(target=background)
    th.start()
    for _ in range(3):
        close(t.all_sum([x.copy() for x in everyone[r]]), sums, 1e-5, "all_sum beside a channel")
    th.join()
    assert np.all(res["sum"] == n * (n + 1) / 2), "channel all_sum"
    close([res["rs"]], [want], 1e-5, "channel reduce_scatter")

    # MLX arrays (the MLX engine's gradient sum): fp32 and bf16 kept as MLX arrays
    import mlx.core as mx

    out = t.all_sum_arrays([mx.full((4, 3), r + 1.0), mx.full((7,), r + 1, dtype=mx.bfloat16)])
    mx.eval(out)
    assert out[0].shape == (4, 3) and out[1].dtype == mx.bfloat16
    assert all(bool(mx.all(o.astype(mx.float32) == n * (n + 1) / 2).item()) for o in out), "all_sum_arrays"
    world.barrier()
    if r == 0:
        print("TRANSPORT OK", backend, n, type(t).__name__)
""")


def _run(tmp_path: Path, backend: str, n: int) -> subprocess.CompletedProcess:
    prog = tmp_path / "transport_checks.py"
    prog.write_text(PROG)
    cmd = [sys.executable, str(prog), backend]
    if n > 1:
        cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(n),
               "-x", "PYTHONPATH", "-x", "OPENBLAS_NUM_THREADS", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env(), cwd=ROOT)


def test_one_rank_transport_is_the_identity(tmp_path: Path) -> None:
    res = _run(tmp_path, "mpi4py", 1)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TRANSPORT OK mpi4py 1 Transport" in res.stdout


@pytest.mark.cluster
@pytest.mark.parametrize("backend, kind", [("mpi4py", "MpiTransport"), ("mlx-mpi", "MlxTransport"),
                                           ("mlx-ring", "MlxTransport")])
@pytest.mark.parametrize("n", [2, 3])
def test_every_collective_on_real_ranks(tmp_path: Path, backend: str, kind: str, n: int) -> None:
    res = _run(tmp_path, backend, n)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert f"TRANSPORT OK {backend} {n} {kind}" in res.stdout
