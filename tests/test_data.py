import threading
import time

import numpy as np
import pytest

from mlxdist.control.step_plan import StepPlan
from mlxdist.data import ByteTokenizer, GlobalSampler, Prefetcher, rank_slice
from mlxdist.data.datasets import TokenWindows
from mlxdist.data.shards import ShardFile, TokenStream, read_shards, write_shards


def test_sampler_is_deterministic_and_a_permutation():
    a, b = GlobalSampler(100, seed=7), GlobalSampler(100, seed=7)
    first = a.indices(0, 100)
    assert np.array_equal(first, b.indices(0, 100))
    assert sorted(first.tolist()) == list(range(100))
    assert not np.array_equal(first, GlobalSampler(100, seed=8).indices(0, 100))
    # crossing an epoch boundary: the next epoch is another permutation
    both = a.indices(90, 20)
    assert np.array_equal(both[:10], first[90:])
    assert np.array_equal(both[10:], GlobalSampler(100, 7).indices(100, 10))


@pytest.mark.parametrize("shares", [[8], [3, 5], [5, 3], [2, 2, 4], [1, 6, 1]])
def test_step_samples_do_not_depend_on_the_split(shares):
    s = GlobalSampler(1000, seed=1)
    step_samples = []
    for r in range(len(shares)):
        b, e = rank_slice(shares, r)
        step_samples.append(s.indices(40 + b, e - b))
    assert np.array_equal(np.concatenate(step_samples), s.indices(40, 8))


def test_plan_splits_global_batch_by_node_batch():
    plan = StepPlan.initial([32, 16], accum=2, global_batch=None)
    assert plan.global_batch == 96 and plan.shares == [64, 32]
    assert plan.accumulation(0) == 2 and plan.accumulation(1) == 2


def test_windows_overlap_and_tokenizer_roundtrip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo wörld", eos=True)
    assert tok.decode(ids) == "héllo wörld"
    w = TokenWindows(TokenStream([np.arange(20)]), seq_len=5, overlap=2)
    assert w.window(0).tolist() == [0, 1, 2, 3, 4, 5]
    assert w.window(1).tolist() == [3, 4, 5, 6, 7, 8]
    assert len(w) == 5


def test_shards_roundtrip(tmp_path):
    docs = [np.arange(10), np.arange(300, 305)]
    index = write_shards(docs, tmp_path, shard_tokens=8)
    assert index["tokens"] == 15 and len(index["shards"]) == 2
    stream, _ = read_shards(tmp_path)
    assert len(stream) == 15 and all(isinstance(a, ShardFile) for a in stream.arrays)
    assert stream.read(0, 15).tolist() == list(range(10)) + list(range(300, 305))
    assert stream.read(7, 12).tolist() == [7, 8, 9, 300, 301]  # crosses the shard boundary
    assert stream.view(8, 15).read(1, 4).tolist() == [9, 300, 301]
    with pytest.raises(FileNotFoundError, match="mlxdist.prepare"):
        read_shards(tmp_path / "missing")


def test_bad_shard_index_and_vocab_mismatch_are_one_line_errors(tmp_path):
    from mlxdist.config import ConfigError, DataConfig
    from mlxdist.data.datasets import build_datasets

    write_shards([np.arange(500) % 300], tmp_path, vocab_size=300)
    cfg = DataConfig(source="shards", path=str(tmp_path), seq_len=16)
    with pytest.raises(ConfigError, match="vocabulary of 300 > model.vocab_size 258"):
        build_datasets(cfg, 0, vocab_size=258)
    assert len(build_datasets(cfg, 0, vocab_size=300)[0]) > 0
    (tmp_path / "shards.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid shard index"):
        read_shards(tmp_path)


def test_prefetch_delivers_in_order_and_measures_wait():
    with Prefetcher(lambda s: s * 10, start=3, depth=2) as p:
        assert [p.get(s) for s in range(3, 8)] == [30, 40, 50, 60, 70]
        assert p.wait_seconds >= 0


def test_prefetch_error_is_raised_in_main_thread():
    def produce(step):
        if step == 2:
            raise OSError("disk on fire")
        return step

    with Prefetcher(produce, start=0, depth=3) as p:
        assert p.get(0) == 0 and p.get(1) == 1
        with pytest.raises(RuntimeError, match="producing step 2 failed.*disk on fire"):
            p.get(2)


def test_prefetch_closes_cleanly_while_blocked():
    before = threading.active_count()
    p = Prefetcher(lambda s: time.sleep(0.01) or s, start=0, depth=1)
    time.sleep(0.1)  # the worker is now blocked on a full queue
    p.close()
    assert threading.active_count() <= before
