"""Shards are data, not code: a token id outside the model's vocabulary and a shard entry
that points outside data.path are one line and exit 2, never a segfault or a stray read."""

import json
import os

import numpy as np
import pytest
from helpers import run_train

from mlxdist.config import ConfigError, DataConfig
from mlxdist.data.datasets import build_datasets
from mlxdist.data.prefetch import Prefetcher
from mlxdist.data.shards import INDEX, read_shards, write_shards

BAD_FILE, BAD_AT, BAD_ID = "shard_00002.bin", 123, 60000  # stream offset 2123: window 66, not a fingerprint probe
RUN = ["data.source=shards", "data.seq_len=32", "model.preset=tiny", "metrics.port=0", "train.progress=false",
       "train.eval_every=0", "train.steps=1", "train.batch_size=64", "checkpoint.every=0", "data.prefetch=2"]


def _shards(d, bad: int | None = BAD_ID):
    """Four files of 1000 tokens; one id set to `bad` (read in step 1: 2 x 64 windows >= all 122)."""
    write_shards([np.arange(1000) % 250 for _ in range(4)], d, shard_tokens=1000)
    if bad is not None:
        ids = np.memmap(d / BAD_FILE, dtype=np.uint16, mode="r+")
        ids[BAD_AT] = bad
        ids.flush()
    return d


def _errors(stderr: str) -> list[str]:
    # Open MPI's output forwarding once put a NUL before an aborting rank's line (seen in CI).
    return [line.lstrip("\0") for line in stderr.splitlines() if line.lstrip("\0").startswith("error:")]


def _names_the_bad_id(line: str) -> bool:
    return (BAD_FILE in line and f"position {BAD_AT}" in line and f"token id {BAD_ID}" in line
            and "re-tokenize" in line and f"model.vocab_size={BAD_ID + 1}" in line)


def test_out_of_vocab_id_is_one_line_and_exit_2_and_the_fixed_data_trains(tmp_path):
    data = _shards(tmp_path / "data")
    r = run_train([*RUN, f"data.path={data}", f"train.out_dir={tmp_path / 'bad'}"], timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(_errors(r.stderr)) == 1 and _names_the_bad_id(_errors(r.stderr)[0]), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    _shards(data, bad=257)  # re-tokenized: the largest id the 258-token vocabulary holds
    r = run_train([*RUN, f"data.path={data}", f"train.out_dir={tmp_path / 'good'}"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_out_of_vocab_id_under_mpirun_ends_the_job_with_the_line(tmp_path):
    data = _shards(tmp_path / "data")
    r = run_train([*RUN, f"data.path={data}", f"train.out_dir={tmp_path / 'run'}"], np_=2, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]  # was 139: a rank segfaulted
    assert any(_names_the_bad_id(line) for line in _errors(r.stderr)), r.stderr[-3000:]


def test_window_read_names_file_position_and_id_also_for_negative_ids(tmp_path):
    data = _shards(tmp_path / "data")
    train, _ = build_datasets(DataConfig(source="shards", path=str(data), seq_len=32), 0, vocab_size=258)
    assert train.window(65).max() < 258
    with pytest.raises(ConfigError) as e:
        train.window(66)
    assert _names_the_bad_id(str(e.value))
    index = json.loads((data / INDEX).read_text())
    (data / INDEX).write_text(json.dumps(index | {"dtype": "int16"}))
    np.memmap(data / BAD_FILE, dtype=np.int16, mode="r+")[BAD_AT] = -3
    stream, _ = read_shards(data, vocab_size=258)
    with pytest.raises(ConfigError, match=f"{BAD_FILE}: token id -3 at position {BAD_AT} .*re-tokenize"):
        stream.read(2000, 3000)


def test_data_error_in_the_prefetch_thread_reaches_the_loop_as_itself():
    def produce(step):
        if step == 1:
            raise ConfigError("data.path: x.bin: token id 9 at position 0 is outside the model's vocabulary")
        return step

    with Prefetcher(produce, start=0, depth=2) as p:
        assert p.get(0) == 0
        with pytest.raises(ConfigError, match="^data.path: x.bin: token id 9 at position 0"):
            p.get(1)


@pytest.mark.parametrize("source,need", [("synthetic", 256), ("builtin", 258)])
def test_byte_sources_need_a_vocabulary_that_holds_their_ids(source, need):
    with pytest.raises(ConfigError, match=f"model.vocab_size: data.source={source} .* set model.vocab_size={need}"):
        build_datasets(DataConfig(source=source, seq_len=32), 0, vocab_size=need - 1)


def _point_at(data, entry: str) -> None:
    index = json.loads((data / INDEX).read_text())
    index["shards"][0]["file"] = entry
    (data / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_entry_outside_data_path_is_refused(tmp_path, how):
    data = _shards(tmp_path / "data", bad=None)
    outside = tmp_path / "outside.bin"
    (np.arange(1000) % 250).astype(np.uint16).tofile(outside)
    entry = {"dotdot": "../outside.bin", "absolute": str(outside), "symlink": "link.bin"}[how]
    if how == "symlink":
        os.symlink(outside, data / "link.bin")
    _point_at(data, entry)
    with pytest.raises(ConfigError) as e:
        read_shards(data)
    line = str(e.value)
    assert "\n" not in line and INDEX in line and f"'{entry}'" in line and "must lie inside data.path" in line
    if how == "symlink":  # a link that stays inside data.path is fine
        os.replace(data / "shard_00000.bin", data / "real.bin")
        os.remove(data / "link.bin")
        os.symlink("real.bin", data / "link.bin")
        assert len(read_shards(data)[0]) == 4000


def test_escaping_entry_is_exit_2_from_the_cli(tmp_path):
    data = _shards(tmp_path / "data", bad=None)
    _point_at(data, "../../etc/passwd")
    r = run_train([*RUN, f"data.path={data}", f"train.out_dir={tmp_path / 'run'}"], timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = _errors(r.stderr)
    assert len(errors) == 1 and "'../../etc/passwd'" in errors[0] and "inside data.path" in errors[0], r.stderr
