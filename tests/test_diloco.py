"""DiLoCo's outer loop against a numpy reference of the same algorithm written here.

Ranks are simulated as threads that meet in a small in-process collective (sum and
all-gather in rank order): the outer step is pure arithmetic, so what is tested is the
algorithm, the sample weighting, the fragment schedule, the wire codecs and the state;
the real transports are tested with the collectives themselves.
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np
import pytest

from mlxdist.cluster.codec import BLOCK, BlockQuantCodec, bf16_bits, make_codec
from mlxdist.state.checkpoint import from_safetensors, to_safetensors
from mlxdist.sync.diloco import DiLoCo, OuterOptimizer
from mlxdist.sync.fragments import partition
from mlxdist.sync.overlap import OverlappedSync

# A tiny tanh MLP regression: parameter sizes 48, 8, 16, 2.
SHAPES = [(6, 8), (8,), (8, 2), (2,)]
# Largest-first into the lightest fragment, worked out by hand for these sizes.
GROUPS = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]], 3: [[0], [2], [1, 3]]}
LR, MU = 0.7, 0.9


def init_weights(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.5, s).astype(np.float32) for s in SHAPES]


def batch(rank: int, t: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([1234, rank, t])
    x = rng.normal(size=(b, 6)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]) + x[:, 1] * x[:, 2], np.cos(x[:, 3]) - 0.5 * x[:, 4]], 1)
    return x, y.astype(np.float32)


def loss_and_grad(w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    w1, b1, w2, b2 = w
    h = np.tanh(x @ w1 + b1)
    e = h @ w2 + b2 - y
    dout = 2 * e / len(x)
    dz = (dout @ w2.T) * (1 - h * h)
    return float((e * e).sum() / len(x)), [x.T @ dz, dz.sum(0), h.T @ dout, dout.sum(0)]


def eval_loss(w: list[np.ndarray]) -> float:
    x, y = batch(99, 0, 512)
    return loss_and_grad(w, x, y)[0]


class AdamW:
    def __init__(self, lr=0.02, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd
        self.t, self.m, self.v = 0, None, None

    def step(self, w: list[np.ndarray], g: list[np.ndarray]) -> list[np.ndarray]:
        if self.m is None:
            self.m = [np.zeros_like(a) for a in w]
            self.v = [np.zeros_like(a) for a in w]
        self.t += 1
        out = []
        for i, (p, d) in enumerate(zip(w, g, strict=True)):
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * d
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * d * d
            mh = self.m[i] / (1 - self.b1 ** self.t)
            vh = self.v[i] / (1 - self.b2 ** self.t)
            out.append((p * (1 - self.lr * self.wd) - self.lr * mh / (np.sqrt(vh) + self.eps)).astype(np.float32))
        return out


def inner_step(rank, t, b, local, adam):
    x, y = batch(rank, t, b)
    return adam.step(local, loss_and_grad(local, x, y)[1])


# ---- the reference: the algorithm as the paper states it, float64 outer state ----

def reference(batches, periods, fragments, rounds, wire_f32=True, start=None):
    """DiLoCo by hand. periods[round][rank] = inner steps of that rank in that round.
    Fragment k of a round syncs once every rank has done (k+1)*H_r//F steps of it."""
    n = len(batches)
    groups = GROUPS[fragments]
    if start is None:
        anchors = [w.astype(np.float64) for w in init_weights()]
        mom = [np.zeros(s) for s in SHAPES]
        local = [[w.copy() for w in init_weights()] for _ in range(n)]
        adams = [AdamW() for _ in range(n)]
        steps = [0] * n
        samples = [[0] * fragments for _ in range(n)]  # per rank, per fragment, since its last sync
    else:
        anchors, mom, local, adams, steps, samples = start
    for rnd in range(rounds):
        pos = [0] * n
        for k in range(fragments):
            for r in range(n):
                while pos[r] < (k + 1) * periods[rnd][r] // fragments:
                    local[r] = inner_step(r, steps[r], batches[r], local[r], adams[r])
                    steps[r] += 1
                    pos[r] += 1
                    samples[r] = [s + batches[r] for s in samples[r]]
            total = sum(samples[r][k] for r in range(n))
            for i in groups[k]:
                g = sum(samples[r][k] * (anchors[i] - local[r][i].astype(np.float64)) for r in range(n)) / total
                mom[i] = MU * mom[i] + g
                anchors[i] = anchors[i] - LR * (g + MU * mom[i])
                for r in range(n):
                    local[r][i] = anchors[i].astype(np.float32)
            for r in range(n):
                samples[r][k] = 0
    return anchors, mom, local, adams, steps


# ---- the class under test, one thread per simulated rank ----

class Cluster:
    """In-process collectives for thread-ranks: inputs meet at a barrier, results are
    computed in rank order, so every rank gets bit-identical arrays."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n

    def _exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()
        return seen

    def allreduce_sum(self, rank, arrays):
        seen = self._exchange(rank, [np.array(a, copy=True) for a in arrays])
        out = []
        for i in range(len(arrays)):
            acc = seen[0][i].copy()
            for r in range(1, self.n):
                acc = acc + seen[r][i]
            out.append(acc)
        return out

    def allgather(self, rank, arr):
        return [np.array(a, copy=True) for a in self._exchange(rank, np.array(arr, copy=True))]


def make_dl(wire="float32", fragments=1, period=4, **kw):
    return DiLoCo(init_weights(), inner_steps=period, outer_lr=LR, outer_momentum=MU, wire=wire,
                  fragments=fragments, **kw)


class RankState:
    def __init__(self, dl: DiLoCo):
        self.dl = dl
        self.local = [w.copy() for w in init_weights()]
        self.adam = AdamW()
        self.t = 0
        self.rounds = 0
        self.stats = []


def drive(r, s, batch_size, allreduce_sum, allgather, *, rounds=None, max_steps=None, periods=None):
    """One rank's training loop, as the trainer runs it: inner step, then any due outer syncs."""
    while (rounds is None or s.rounds < rounds) and (max_steps is None or s.t < max_steps):
        s.local = inner_step(r, s.t, batch_size, s.local, s.adam)
        s.t += 1
        for k in s.dl.advance(batch_size):
            idx = s.dl.fragment_params(k)
            new = s.dl.outer_step(k, [s.local[i] for i in idx], allreduce_sum, allgather)
            s.stats.append(s.dl.last)
            for i, w in zip(idx, new, strict=True):
                s.local[i] = w
            if s.dl.cursor == 0:
                s.rounds += 1
                if periods is not None and s.rounds < len(periods):
                    s.dl.set_period(periods[s.rounds][r])


def on_threads(n, cluster, body):
    """body(r) on one thread per simulated rank; the first error ends every rank and is raised."""
    errors = []

    def guarded(r):
        try:
            body(r)
        except BaseException as e:  # noqa: BLE001 (re-raised below, after the other ranks stop)
            errors.append(e)
            cluster.barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def run_ranks(states, batches, cluster, **kw):
    on_threads(len(states), cluster, lambda r: drive(r, states[r], batches[r], partial(cluster.allreduce_sum, r),
                                                     partial(cluster.allgather, r), **kw))


def simulate(batches, fragments, rounds, periods, wire="float32", **kw):
    states = [RankState(make_dl(wire, fragments, periods[0][r], **kw)) for r in range(len(batches))]
    run_ranks(states, batches, Cluster(len(batches)), rounds=rounds, periods=periods)
    return states


def assert_same_anchors(states):
    for s in states[1:]:
        for a, b in zip(states[0].dl.anchors, s.dl.anchors, strict=True):
            assert np.array_equal(a, b)


# ---- tests ----

def test_partition_balances_by_size_and_is_deterministic():
    sizes = [int(np.prod(s)) for s in SHAPES]
    for f, expected in GROUPS.items():
        assert partition(sizes, f) == expected
    big = [7, 100, 3, 50, 50, 20, 9, 1]
    parts = partition(big, 3)
    loads = sorted(sum(big[i] for i in p) for p in parts)
    assert loads == [70, 70, 100]  # the 100 stands alone; the rest split evenly
    assert sorted(i for p in parts for i in p) == list(range(len(big)))
    with pytest.raises(ValueError, match="dist.fragments=5 exceeds"):
        partition([1, 2, 3], 5)


def test_outer_optimizer_matches_torch_sgd_nesterov():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=10).astype(np.float32)
    grads = [rng.normal(size=10).astype(np.float32) for _ in range(5)]
    tp = torch.nn.Parameter(torch.tensor(p0))
    opt = torch.optim.SGD([tp], lr=LR, momentum=MU, nesterov=True)
    ours = OuterOptimizer(LR, MU)
    p = p0
    for g in grads:
        tp.grad = torch.tensor(g)
        opt.step()
        p = ours.step(0, p, g)
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batches,fragments,period", [([3, 5], 1, 4), ([2, 3, 7], 1, 5), ([3, 5], 2, 6),
                                                      ([2, 3, 7], 3, 6)])
def test_diloco_equals_reference(batches, fragments, period):
    rounds = 4
    periods = [[period] * len(batches)] * rounds
    states = simulate(batches, fragments, rounds, periods)
    anchors, mom, local, _, _ = reference(batches, periods, fragments, rounds)
    assert_same_anchors(states)
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(states[0].dl.anchors[i], anchors[i].reshape(-1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(states[0].dl.outer.buf[i], mom[i].reshape(-1), rtol=1e-5, atol=1e-5)
        for r, s in enumerate(states):
            np.testing.assert_allclose(s.local[i], local[r][i], rtol=1e-5, atol=1e-5)
    # It learned something, and the per-sync stats add up.
    assert eval_loss([a.reshape(s) for a, s in zip(states[0].dl.anchors, SHAPES, strict=True)]) < \
        0.7 * eval_loss(init_weights())
    # Each fragment weighs the samples since its own last sync: a full round's, except
    # in the first round, where fragment k has seen (k+1)/F of one.
    expected = [sum(batches) * (period if rnd else (k + 1) * period // fragments)
                for rnd in range(rounds) for k in range(fragments)]
    assert [st.total_samples for st in states[0].stats] == expected


def test_time_boxed_rounds_weight_unequal_step_counts_by_samples():
    """A fast rank does more inner steps per round than a slow one; nobody waits mid-round."""
    batches = [4, 2, 3]
    periods = [[9, 3, 5], [9, 2, 5], [8, 3, 6], [9, 3, 6]]  # each rank's own round length
    states = simulate(batches, 2, len(periods), periods)
    anchors, _, local, _, steps = reference(batches, periods, 2, len(periods))
    assert [s.t for s in states] == steps == [sum(p[r] for p in periods) for r in range(3)]
    assert_same_anchors(states)
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(states[0].dl.anchors[i], anchors[i].reshape(-1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(states[2].local[i], local[2][i], rtol=1e-5, atol=1e-5)


def test_bf16_bits_match_mlx():
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=1000).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 1000),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1.00390625, 1.01171875], np.float32)])
    ours = bf16_bits(x)
    theirs = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16", "int8", "int4"])
def test_codec_roundtrip_size_and_error(wire):
    codec = make_codec(wire)
    rng = np.random.default_rng(2)
    x = (rng.normal(size=1024) * rng.uniform(0.01, 10, size=1024)).astype(np.float32)
    payload = codec.encode(x)
    assert payload.dtype == np.uint8 and payload.size == codec.nbytes(x.size)
    y = codec.decode(payload, x.size)
    if wire == "float32":
        assert np.array_equal(x, y)
    elif wire == "bfloat16":
        np.testing.assert_allclose(y, x, rtol=2**-8)
    elif wire == "float16":
        np.testing.assert_allclose(y, x, rtol=2**-11)
        residual = np.zeros_like(x)
        assert np.array_equal(codec.decode(codec.encode(x, residual), x.size) + residual, x)  # error feedback
    else:
        assert np.all(np.abs(y - x) <= codec.step_bound(x) * (1 + 1e-6))
    ratio = codec.nbytes(x.size) / (4 * x.size)
    assert ratio == pytest.approx({"float32": 1, "bfloat16": 0.5, "float16": 0.5, "int8": (1 + 4 / BLOCK) / 4, "int4": (0.5 + 4 / BLOCK) / 4}[wire])


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_keeps_the_long_run_sum_within_one_step(bits):
    """Small steady components sit below a block's rounding step: without error feedback
    they are dropped every time and the summed update drifts linearly; with it, the
    decoded sum trails the true sum by exactly the residual, at most half a step."""
    codec = BlockQuantCodec(bits)
    rng = np.random.default_rng(3)
    n, syncs = 4 * BLOCK, 300
    drift = rng.uniform(-0.004, 0.004, n).astype(np.float32)
    true_sum, ef_sum, plain_sum = (np.zeros(n, np.float64) for _ in range(3))
    residual = np.zeros(n, np.float32)
    bound = np.zeros(n)
    for _ in range(syncs):
        x = drift.copy()
        x[::BLOCK] = rng.normal(size=n // BLOCK).astype(np.float32)  # one large value per block
        true_sum += x
        y = x + residual
        bound = codec.step_bound(y)
        ef_sum += codec.decode(codec.encode(x, residual), n)
        plain_sum += codec.decode(codec.encode(x), n)
    ef_err = np.abs(ef_sum - true_sum)
    plain_err = np.abs(plain_sum - true_sum)
    # Exact identity: the gap is the residual still to be sent (float64 sums of fp32 values).
    np.testing.assert_allclose(true_sum - ef_sum, residual, atol=1e-4)
    assert np.all(ef_err <= bound + 1e-4)
    # Measured (300 syncs, true sums ~0.57 median): int8 gap max 0.0053 / median 0.0013 with
    # error feedback vs 0.38 / 0.27 without; int4 0.045 / 0.0072 vs 1.13 / 0.54.
    assert ef_err.max() < 0.1 * plain_err.max()
    assert np.median(ef_err) < 0.05 * np.median(plain_err)


@pytest.mark.parametrize("wire,tol", [("bfloat16", 0.001), ("int8", 0.002), ("int4", 0.02)])
def test_lossy_wire_trains_like_fp32_and_keeps_ranks_identical(wire, tol):
    """Measured eval-loss gap to the fp32 wire: bf16 0.006%, int8 0.013%, int4 0.34%."""
    batches, rounds = [2, 3, 7], 6
    periods = [[5] * 3] * rounds
    ref = simulate(batches, 2, rounds, periods, "float32")
    got = simulate(batches, 2, rounds, periods, wire)
    assert_same_anchors(got)
    loss = [eval_loss([a.reshape(s) for a, s in zip(st[0].dl.anchors, SHAPES, strict=True)]) for st in (ref, got)]
    assert abs(loss[1] - loss[0]) <= tol * loss[0] + 1e-3, loss
    full = got[0].dl.fragment_bytes(0) + got[0].dl.fragment_bytes(1)
    assert sum(s.bytes for s in got[0].stats[:2]) == full


def _save(states):
    """Each rank's checkpoint, through the checkpoint module's safetensors encoding."""
    out = []
    for s in states:
        arrays = {f"diloco.{k}": v for k, v in s.dl.state_dict().items()}
        arrays.update({f"local.{i}": w for i, w in enumerate(s.local)})
        arrays.update({f"adam.m.{i}": m for i, m in enumerate(s.adam.m)})
        arrays.update({f"adam.v.{i}": v for i, v in enumerate(s.adam.v)})
        out.append((from_safetensors(to_safetensors(arrays)), s.t, s.adam.t, s.rounds))
    return out


def _restore(saved, wire, fragments, period, rank_state=True):
    states = []
    for arrays, t, adam_t, rounds in saved:
        dl = make_dl(wire, fragments, period)
        dl.load_state_dict({k[len("diloco."):]: v for k, v in arrays.items() if k.startswith("diloco.")}, rank_state)
        s = RankState(dl)
        s.local = [arrays[f"local.{i}"] for i in range(len(SHAPES))]
        s.adam.m = [arrays[f"adam.m.{i}"] for i in range(len(SHAPES))]
        s.adam.v = [arrays[f"adam.v.{i}"] for i in range(len(SHAPES))]
        s.adam.t, s.t, s.rounds = adam_t, t, rounds
        states.append(s)
    return states


@pytest.mark.parametrize("wire", ["float32", "int8"])
def test_resume_mid_round_equals_no_interruption(wire):
    batches, fragments, period, steps = [2, 3, 7], 3, 6, 28  # stop at 16: mid-round, cursor 2
    whole = [RankState(make_dl(wire, fragments, period)) for _ in batches]
    run_ranks(whole, batches, Cluster(3), max_steps=steps)
    first = [RankState(make_dl(wire, fragments, period)) for _ in batches]
    run_ranks(first, batches, Cluster(3), max_steps=16)
    assert first[0].dl.cursor == 2 and first[0].dl.round_steps == 4
    if wire == "int8":
        assert any(np.abs(r).max() > 0 for r in first[1].dl.residuals.values())
    resumed = _restore(_save(first), wire, fragments, period)
    run_ranks(resumed, batches, Cluster(3), max_steps=steps)
    for a, b in zip(whole, resumed, strict=True):
        assert a.dl.cursor == b.dl.cursor and a.dl.round_steps == b.dl.round_steps
        for x, y in zip(a.dl.anchors + a.local, b.dl.anchors + b.local, strict=True):
            assert np.array_equal(x, y)


def test_resume_on_fewer_ranks_continues_from_the_global_state():
    batches, fragments, period = [2, 3, 7], 2, 6
    first = [RankState(make_dl("float32", fragments, period)) for _ in batches]
    run_ranks(first, batches, Cluster(3), max_steps=9)  # fragment 0 synced at 3, 9 inside round 2
    saved = _save(first)[:2]
    dl0 = first[0].dl
    assert dl0.cursor == 1
    resumed = _restore(saved, "float32", fragments, period, rank_state=False)
    for s in resumed:
        s.local = s.dl.anchor_weights()
        assert s.dl.round_steps == 3 and s.dl.samples == [0, 0]
    run_ranks(resumed, batches[:2], Cluster(2), max_steps=9 + 3 + 2 * period)
    assert_same_anchors(resumed)
    # The reference picks up the same global state with 2 ranks: finish the round's last
    # fragment (3 steps), then two full rounds.
    anchors = [a.astype(np.float64).reshape(s) for a, s in zip(dl0.anchors, SHAPES, strict=True)]
    mom = [dl0.outer.buf[i].astype(np.float64).reshape(s) for i, s in enumerate(SHAPES)]
    local = [[a.reshape(s).copy() for a, s in zip(dl0.anchors, SHAPES, strict=True)] for _ in range(2)]
    adams = [r.adam for r in _restore(saved, "float32", fragments, period)]
    steps = [9, 9]
    # Tail of the interrupted round: only fragment 1 is left, after 3 more steps.
    n = 2
    samples = [0] * n
    for r in range(n):
        for _ in range(3):
            local[r] = inner_step(r, steps[r], batches[r], local[r], adams[r])
            steps[r] += 1
            samples[r] += batches[r]
    for i in GROUPS[2][1]:
        g = sum(samples[r] * (anchors[i] - local[r][i]) for r in range(n)) / sum(samples)
        mom[i] = MU * mom[i] + g
        anchors[i] = anchors[i] - LR * (g + MU * mom[i])
        for r in range(n):
            local[r][i] = anchors[i].astype(np.float32)
    start = (anchors, mom, local, adams, steps, [[s, 0] for s in samples])
    anchors, _, _, _, _ = reference(batches[:2], [[period] * 2] * 2, fragments, 2, start=start)
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(resumed[0].dl.anchors[i], anchors[i].reshape(-1), rtol=1e-5, atol=1e-5)


def test_one_codec_registry_says_what_the_wire_can_sum():
    """fp32/bf16/fp16 are summed hop by hop (data parallel, sharding: `dist.wire_dtype`);
    int8/int4 must be all-gathered and decoded, so a summing exchange refuses them by key."""
    x = np.array([1.0, -2.5, 3e-3, 65504.0], np.float32)
    for name, dtype in (("float32", np.float32), ("bfloat16", np.uint16), ("float16", np.float16)):
        codec = make_codec(name, "dist.wire_dtype", summable=True)
        wire = codec.to_wire(x)
        assert codec.summable and wire.dtype == dtype == codec.wire_dtype
        np.testing.assert_allclose(codec.from_wire(wire), x, rtol=2**-8)
    assert not make_codec("int8").summable and not make_codec("int4").summable
    with pytest.raises(ValueError, match="dist.wire_dtype=int8: this exchange sums on the wire"):
        make_codec("int8", "dist.wire_dtype", summable=True)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="dist.inner_steps=2 is below dist.fragments=3"):
        make_dl(fragments=3, period=2)
    with pytest.raises(ValueError, match="dist.outer_wire"):
        make_codec("int3")
    dl = make_dl(fragments=2)
    state = dl.state_dict()
    with pytest.raises(ValueError, match="resume with dist.fragments=2"):
        make_dl(fragments=1).load_state_dict(state)


MPI_SCRIPT = """
import json, sys
import numpy as np
from mlxdist.cluster.transport import make_transport
from mlxdist.sync.comm import allgather_from_transport, allreduce_from_transport
from mlxdist.sync.overlap import OverlappedSync
from mlxdist.cluster.world import init_world
from tests.test_diloco import RankState, drive, inner_step, make_dl

wire, fragments, period, rounds, batches, delay, out = json.loads(sys.argv[1])
world = init_world()
r, b = world.rank, batches[world.rank]
s = RankState(make_dl(wire, fragments, period))
if delay is None:
    transport = make_transport(world, "mpi4py")
    drive(r, s, b, allreduce_from_transport(transport), allgather_from_transport(transport), rounds=rounds)
else:  # background exchanges on a channel of their own
    channel = make_transport(world, "mpi4py").channel()
    ov = OverlappedSync(s.dl, allreduce_from_transport(channel), allgather_from_transport(channel), delay=delay,
                        alpha=0.5)
    while s.t < rounds * period:
        s.local = inner_step(r, s.t, b, s.local, s.adam)
        s.t += 1
        ov.step()
        for k in s.dl.advance(b):
            ov.submit(k, [s.local[i] for i in s.dl.fragment_params(k)])
        for k, new, _ in ov.ready(lambda idx: [s.local[i] for i in idx]):
            for i, w in zip(s.dl.fragment_params(k), new):
                s.local[i] = w
    for k, new, _ in ov.ready(lambda idx: [s.local[i] for i in idx], drain=True):  # as a run ends
        for i, w in zip(s.dl.fragment_params(k), new):
            s.local[i] = w
    ov.close()
np.savez(f"{out}/rank{r}.npz", *s.dl.anchors, *s.local)
"""


def _mpirun(tmp_path, batches, fragments, wire, period, rounds, delay=None):
    import json
    import subprocess
    import sys

    from tests.helpers import env, mpirun_path

    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-np", str(len(batches)), "-x", "PYTHONPATH",
           "-x", "OPENBLAS_NUM_THREADS", sys.executable, "-c", MPI_SCRIPT,
           json.dumps([wire, fragments, period, rounds, batches, delay, str(tmp_path)])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(len(batches))]
    got = [[f[f"arr_{i}"] for i in range(len(f.files))] for f in got]
    n = len(SHAPES)
    for g in got[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got[0][:n], g[:n], strict=True))
    return got


@pytest.mark.parametrize("batches,fragments,wire", [([3, 5], 1, "float32"), ([2, 3, 7], 3, "float32"),
                                                    ([2, 3, 7], 2, "int8")])
def test_real_mpirun_ranks_match(tmp_path, batches, fragments, wire):
    """The same loop on real mpirun ranks over the job's collectives (mpi4py transport)."""
    period, rounds, n = 6, 3, len(SHAPES)
    got = _mpirun(tmp_path, batches, fragments, wire, period, rounds)
    if wire == "float32":
        anchors, _, local, _, _ = reference(batches, [[period] * len(batches)] * rounds, fragments, rounds)
        for i in range(n):
            np.testing.assert_allclose(got[0][i], anchors[i].reshape(-1), rtol=1e-5, atol=1e-5)
            for r in range(len(batches)):
                np.testing.assert_allclose(got[r][n + i], local[r][i], rtol=1e-5, atol=1e-5)
    else:  # decoded and summed in rank order in float64: bit-identical to the simulation
        sim = simulate(batches, fragments, rounds, [[period] * len(batches)] * rounds, wire)
        for i in range(n):
            assert np.array_equal(got[0][i], sim[0].dl.anchors[i])


def test_real_mpirun_background_sync_matches_streaming_reference(tmp_path):
    """Exchanges on a worker thread over a transport channel, under real MPI."""
    batches, period, fragments, rounds, delay, n = [2, 3, 7], 6, 3, 4, 1, len(SHAPES)
    got = _mpirun(tmp_path, batches, fragments, "float32", period, rounds, delay)
    anchors, local = reference_overlapped(batches, period, fragments, period * rounds, delay, 0.5)
    for i in range(n):
        np.testing.assert_allclose(got[0][i], anchors[i].reshape(-1), rtol=1e-5, atol=1e-5)
        for r in range(len(batches)):
            np.testing.assert_allclose(got[r][n + i], local[r][i], rtol=1e-5, atol=1e-5)


def reference_overlapped(batches, period, fragments, steps, delay, alpha):
    """Streaming DiLoCo by hand: fragment k's pseudo-gradient is taken when the round
    reaches (k+1)*H//F steps; its outer step lands `delay` steps later, and the local
    weights become alpha*local + (1-alpha)*anchor (just the anchor when delay is 0).
    At the end every sync still in flight lands, in order, as when a run ends."""
    n = len(batches)
    groups = GROUPS[fragments]
    anchors = [w.astype(np.float64) for w in init_weights()]
    mom = [np.zeros(s) for s in SHAPES]
    local = [[w.copy() for w in init_weights()] for _ in range(n)]
    adams = [AdamW() for _ in range(n)]
    samples = [[0] * fragments for _ in range(n)]
    landing = {}
    for t in range(1, steps + 1):
        for r in range(n):
            local[r] = inner_step(r, t - 1, batches[r], local[r], adams[r])
            samples[r] = [s + batches[r] for s in samples[r]]
        pos = (t - 1) % period + 1
        for k in range(fragments):
            if pos == (k + 1) * period // fragments:
                total = sum(samples[r][k] for r in range(n))
                g = {i: sum(samples[r][k] * (anchors[i] - local[r][i].astype(np.float64)) for r in range(n)) / total
                     for i in groups[k]}
                landing[t + delay] = (k, g)
                for r in range(n):
                    samples[r][k] = 0
        for when in sorted(w for w in landing if w <= t or t == steps):
            k, g = landing.pop(when)
            for i in groups[k]:
                mom[i] = MU * mom[i] + g[i]
                anchors[i] = anchors[i] - LR * (g[i] + MU * mom[i])
                for r in range(n):
                    a = anchors[i].astype(np.float32)
                    local[r][i] = a if delay == 0 else np.float32(alpha) * local[r][i] + np.float32(1 - alpha) * a
    return anchors, local


def run_overlapped(batches, period, fragments, steps, delay, alpha, wire="float32"):
    cluster = Cluster(len(batches))
    states = [RankState(make_dl(wire, fragments, period)) for _ in batches]

    def body(r):
        s = states[r]
        ov = OverlappedSync(s.dl, partial(cluster.allreduce_sum, r), partial(cluster.allgather, r),
                            delay=delay, alpha=alpha)
        try:
            while s.t < steps:
                s.local = inner_step(r, s.t, batches[r], s.local, s.adam)
                s.t += 1
                ov.step()
                for k in s.dl.advance(batches[r]):
                    ov.submit(k, [s.local[i] for i in s.dl.fragment_params(k)])
                for k, new, _ in ov.ready(lambda idx: [s.local[i] for i in idx], drain=s.t == steps):
                    for i, w in zip(s.dl.fragment_params(k), new, strict=True):
                        s.local[i] = w
        finally:
            ov.close()

    on_threads(len(batches), cluster, body)
    return states


@pytest.mark.parametrize("delay", [1, 2, 5])
def test_overlapped_fragments_equal_the_streaming_reference(delay):
    batches, period, fragments, steps = [2, 3, 7], 6, 3, 6 * 4
    states = run_overlapped(batches, period, fragments, steps, delay, 0.5)
    anchors, local = reference_overlapped(batches, period, fragments, steps, delay, 0.5)
    assert_same_anchors(states)
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(states[0].dl.anchors[i], anchors[i].reshape(-1), rtol=1e-5, atol=1e-5)
        for r, s in enumerate(states):
            np.testing.assert_allclose(s.local[i], local[r][i], rtol=1e-5, atol=1e-5)
    # The delay matters: the blocking reference ends elsewhere.
    blocking, _ = reference_overlapped(batches, period, fragments, steps, 0, 0.5)
    assert max(np.abs(a - b).max() for a, b in zip(anchors, blocking, strict=True)) > 1e-3


def test_overlap_with_no_delay_is_the_blocking_sync():
    batches, period, fragments = [3, 5], 6, 2
    a = run_overlapped(batches, period, fragments, 18, 0, 0.5, "int8")
    b = [RankState(make_dl("int8", fragments, period)) for _ in batches]
    run_ranks(b, batches, Cluster(2), max_steps=18)
    for x, y in zip(a, b, strict=True):
        assert all(np.array_equal(p, q) for p, q in zip(x.dl.anchors + x.local, y.dl.anchors + y.local, strict=True))
    with pytest.raises(ValueError, match="must be below dist.inner_steps=6"):
        OverlappedSync(make_dl(fragments=2, period=6), None, delay=6)
