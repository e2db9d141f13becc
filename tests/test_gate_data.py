"""Shards, their index, instruction JSONL and the event logs pass the gate (issue 50, items 6
and 8): a FIFO named as a shard, a shard cut short under a running job, a shards.json of the
wrong shape, JSONL that is not UTF-8 and a log line with a field of the wrong type are each
one line naming the file (and the field or line) and what to do; never a hang, never SIGBUS,
never a traceback. A report still comes out of a log with bad lines, and says where they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST, env, logged_steps, run_train, train_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxdist.config import ConfigError, DataConfig
from mlxdist.data.instruct import build_instruct_datasets
from mlxdist.data.shards import INDEX, read_shards, write_shards

RUN = ["data.source=shards", "data.seq_len=32", "model.preset=tiny", "metrics.port=0", "train.progress=false",
       "train.eval_every=0", "train.batch_size=16", "checkpoint.every=0"]


def _shards(d: Path, tokens: int = 1000) -> Path:
    write_shards([np.arange(tokens) % 250 for _ in range(4)], d, shard_tokens=tokens)
    return d


def _errors(stderr: str) -> list[str]:
    # Open MPI's output forwarding once put a NUL before an aborting rank's line (seen in CI).
    return [line.lstrip("\0") for line in stderr.splitlines() if line.lstrip("\0").startswith("error:")]


def _edit_index(data: Path, edit) -> None:
    index = json.loads((data / INDEX).read_text())
    edit(index)
    (data / INDEX).write_text(json.dumps(index))


# ------------------------------------------------------------------ shards must be regular files


def test_a_fifo_named_as_a_shard_is_one_line_and_exit_2_not_a_hang(tmp_path):
    data = _shards(tmp_path / "data")
    os.remove(data / "shard_00001.bin")
    os.mkfifo(data / "shard_00001.bin")  # was: the run opened it and waited for a writer for good
    r = run_train([*RUN, "train.steps=1", f"data.path={data}", f"train.out_dir={tmp_path / 'run'}"], timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = _errors(r.stderr)
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "shard_00001.bin" in errors[0] and "not a regular file" in errors[0] and "shards[1].file" in errors[0]


def test_a_fifo_as_the_index_is_refused_as_not_a_regular_file(tmp_path):
    data = _shards(tmp_path / "data")
    os.remove(data / INDEX)
    os.mkfifo(data / INDEX)
    with pytest.raises(ConfigError) as e:
        read_shards(data)
    line = str(e.value)
    assert "\n" not in line and f"{data / INDEX}: shard index is not a regular file" in line, line


# ------------------------------------------------------------------ a shard cut short under a running job


def test_a_shard_cut_short_under_a_running_2_rank_job_ends_it_with_one_line_not_sigbus(tmp_path):
    data = _shards(tmp_path / "data", tokens=200_000)
    run = tmp_path / "run"
    cut = data / "shard_00001.bin"
    args = [*RUN, "train.steps=100000", f"data.path={data}", f"train.out_dir={run}"]
    proc = subprocess.Popen(train_command(args, np_=2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and len(logged_steps(run)) < 3:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.truncate(cut, 1000)  # 500 of its 200,000 tokens left: the next window there reads past the end
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, (proc.returncode, err[-3000:])  # was 135: SIGBUS in a memmap read, no line
    lines = [line for line in _errors(err) if str(cut) in line]
    assert lines and "1,000 bytes now but was 400,000" in lines[0] and "keep shards unchanged" in lines[0], err[-3000:]
    assert "Traceback" not in err


# ------------------------------------------------------------------ shards.json through a schema


def _set(field: str, value):
    def edit(index):
        if field.startswith("shards["):
            i, key = int(field[7]), field.split(".", 1)[1]
            index["shards"][i][key] = value
        else:
            index[field] = value
    return edit


INDEX_CASES = {
    "not UTF-8": (b'{"dtype": "uint16",\n "shards": [{"file": "caf\xe9.bin"}]}', "shard index is not UTF-8 text (byte 45, line 2)"),
    "not JSON": (b'{"dtype": "uint16",\n "shards": [', "shard index is not valid JSON (line 2, column 13)"),
    "tokens a string": (_set("shards[0].tokens", "1000"), "'shards[0].tokens' is '1000', not a whole number"),
    "a negative count": (_set("shards[1].tokens", -5), "'shards[1].tokens' is -5, not a whole number from 0"),
    "file not a string": (_set("shards[2].file", 7), "'shards[2].file' is 7, not a string"),
    "dtype unknown": (_set("dtype", "uint12"), "'dtype' is 'uint12', not one of 'uint8', 'uint16'"),
    "vocab_size a string": (_set("vocab_size", "258"), "'vocab_size' is '258', not a whole number"),
    "shards not a list": (_set("shards", {"file": "shard_00000.bin"}), "'shards' is {'file': "),
    "tokens not the file's size": (_set("shards[3].tokens", 999),
                                   "'shards[3].tokens' says 999 but {data}/shard_00003.bin is 2,000 bytes"),
    "total not the shards' sum": (_set("tokens", 3999), "'tokens' is 3,999 but its shards hold 4,000"),
}


@pytest.mark.parametrize("case", INDEX_CASES)
def test_a_shard_index_of_the_wrong_shape_is_one_line_naming_the_field(tmp_path, case):
    data = _shards(tmp_path / "data")
    bad, said = INDEX_CASES[case]
    if isinstance(bad, bytes):
        (data / INDEX).write_bytes(bad)
    else:
        _edit_index(data, bad)
    with pytest.raises(ConfigError) as e:
        read_shards(data)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"data.path: {data / INDEX}: "), line
    assert said.replace("{data}", str(data.resolve())) in line and "python -m mlxdist.prepare" in line, line


def test_a_shard_index_that_is_not_utf8_is_exit_2_from_the_cli(tmp_path):
    data = _shards(tmp_path / "data")
    (data / INDEX).write_bytes((data / INDEX).read_bytes().replace(b'"uint16"', b'"uint\xff16"'))
    r = run_train([*RUN, "train.steps=1", f"data.path={data}", f"train.out_dir={tmp_path / 'run'}"], timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]  # was 1: a UnicodeDecodeError that named no file
    errors = _errors(r.stderr)
    assert len(errors) == 1 and f"{data / INDEX}: shard index is not UTF-8 text" in errors[0], r.stderr[-2000:]


# ------------------------------------------------------------------ instruction JSONL


def _finishes(fn, fifo: Path, seconds: float = 20):
    """fn()'s exception (or None) when it returns within `seconds`; else the FIFO it waits on is
    opened for writing once, which lets it go, and the test fails."""
    out: list = []

    def call():
        try:
            fn()
            out.append(None)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail(f"still reading {fifo} after {seconds}s: it waited for a writer")
    return out[0]


def test_instruct_jsonl_not_utf8_is_one_line_naming_file_and_line(tmp_path):
    data = tmp_path / "sft"
    data.mkdir()
    lines = [json.dumps({"prompt": f"Q{i} ", "completion": f"A{i}"}).encode() for i in range(4)]
    lines[2] = b'{"prompt": "caf\xe9 ", "completion": "A2"}'  # Latin-1, as a spreadsheet export writes it
    (data / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(source="jsonl", path=str(data), seq_len=16)
    with pytest.raises(ConfigError) as e:
        build_instruct_datasets(cfg, seed=0, tok=None)  # refused before any token is made
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{data / 'train.jsonl'}:3: not UTF-8 text (byte 16 of the line)"), line
    assert "save it as UTF-8" in line


def test_instruct_jsonl_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    data = tmp_path / "sft"
    data.mkdir()
    os.mkfifo(data / "train.jsonl")
    cfg = DataConfig(source="jsonl", path=str(data), seq_len=16)
    e = _finishes(lambda: build_instruct_datasets(cfg, seed=0, tok=None), data / "train.jsonl")
    assert isinstance(e, ConfigError) and "\n" not in str(e), e
    assert f"{data / 'train.jsonl'}: JSONL file is not a regular file" in str(e)


# ------------------------------------------------------------------ the report's log reader


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    r = run_train([*FAST, "train.steps=5", f"train.out_dir={out}"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _report(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxdist.report", *map(str, args)], capture_output=True, text=True,
                          timeout=60, env=env())


def test_report_skips_log_lines_of_the_wrong_type_counts_them_and_names_the_first(logged_run, tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    log = run / "logs" / "rank0.jsonl"
    good = (logged_run / "logs" / "rank0.jsonl").read_bytes()
    n = good.count(b"\n")
    step = json.loads(good.splitlines()[-1]) | {"event": "step"}
    bad = [json.dumps(step | {"step": "x"}).encode(),  # was: int('x'), a traceback and no report
           json.dumps(step | {"step": 98, "sync_s": "slow"}).encode(),  # was: str / float, a traceback
           json.dumps(step | {"step": 99, "host": "caf\u00e9"}).encode().replace(b"caf\\u00e9", b"caf\xe9")]
    log.write_bytes(good + b"\n".join(bad) + b"\n")
    r = _report(run, "--out", tmp_path / "report")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "- steps: 5 (ended: completed)" in r.stdout, r.stdout  # none of the bad lines counted as a step
    said = [ln for ln in r.stdout.splitlines() if "unreadable log lines ignored" in ln]
    assert said == [f"- unreadable log lines ignored: 3 (the first: {log}:{n + 1}: 'step' is 'x', not a whole "
                    "number from 0 to 4,611,686,018,427,387,904; is it the right file, or was it edited?)"], r.stdout
    assert (tmp_path / "report" / "loss.png").is_file() and "Traceback" not in r.stderr


def test_report_names_a_line_that_is_not_utf8(logged_run, tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    lines = (logged_run / "logs" / "rank0.jsonl").read_bytes().splitlines()
    lines.insert(1, lines[1].replace(b'"host": "', b'"host": "\xff'))
    (run / "logs" / "rank0.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    r = _report(run, "--out", tmp_path / "report")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"unreadable log lines ignored: 1 (the first: {run / 'logs' / 'rank0.jsonl'}:2: not UTF-8 text" in r.stdout


def test_report_on_a_fifo_log_is_one_line_and_exit_2_not_a_hang(logged_run, tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank0.jsonl").write_bytes((logged_run / "logs" / "rank0.jsonl").read_bytes())
    os.mkfifo(run / "logs" / "rank1.jsonl")
    r = _report(run, "--out", tmp_path / "report")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"report: {run / 'logs' / 'rank1.jsonl'}: event log is not a regular file (a FIFO, " \
                               "device or socket); give a plain file as the event log", r.stderr


# ------------------------------------------------------------------ fuzz: data or one line

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)), derandomize="FUZZ_EXAMPLES" not in os.environ, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
           | st.sampled_from(["shard_00000.bin", "../x", "/etc/passwd", "uint16", "float32", "step", "x\0y", ""]))
trees = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                         max_size=4), max_leaves=20)


def _mutated(data: bytes) -> st.SearchStrategy[bytes]:
    n = len(data)
    flip = st.tuples(st.integers(0, n - 1), st.integers(0, 255)).map(lambda t: data[:t[0]] + bytes([t[1]]) + data[t[0] + 1:])
    cut = st.integers(0, n).map(lambda i: data[:i])
    splice = st.tuples(st.integers(0, n), st.binary(max_size=20)).map(lambda t: data[:t[0]] + t[1] + data[t[0]:])
    return flip | cut | splice


def _data_or_one_line(fn):
    try:
        return fn()
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        return None


@pytest.fixture(scope="module")
def fuzz_shards(tmp_path_factory) -> Path:
    return _shards(tmp_path_factory.mktemp("fuzz") / "data", tokens=100)


def _read_all(data: Path):
    stream, index = read_shards(data, vocab_size=258)
    stream.read(0, len(stream))
    return index


@FUZZ
@given(st.data())
def test_fuzz_a_shard_index_reads_or_is_one_line(fuzz_shards, data):
    good = json.loads((fuzz_shards / INDEX).read_text())
    edited = dict(good)
    edited[data.draw(st.sampled_from(["dtype", "vocab_size", "tokens", "shards", "extra"]))] = data.draw(trees)
    entry = dict(good["shards"][0])
    entry[data.draw(st.sampled_from(["file", "tokens", "extra"]))] = data.draw(trees)
    with_entry = good | {"shards": [entry, *good["shards"][1:]]}
    text = data.draw(st.sampled_from([edited, with_entry]).map(lambda t: json.dumps(t).encode())
                     | _mutated(json.dumps(good).encode()))
    (fuzz_shards / INDEX).write_bytes(text)
    try:
        _data_or_one_line(lambda: _read_all(fuzz_shards))
    finally:
        (fuzz_shards / INDEX).write_text(json.dumps(good))


@FUZZ
@given(line=_mutated(json.dumps({"prompt": "What is two plus two? ", "completion": "Four."}).encode()) | trees.map(
    lambda t: json.dumps(t).encode()))
def test_fuzz_an_instruct_line_reads_or_is_one_line(tmp_path, line):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps({"text": "fine"}).encode() + b"\n" + line.replace(b"\n", b" ") + b"\n")
    from mlxdist.data.instruct import read_jsonl

    _data_or_one_line(lambda: read_jsonl(path))


@FUZZ
@given(st.data())
def test_fuzz_a_log_line_is_read_or_skipped_and_the_summary_comes_out(logged_run, tmp_path, data):
    from mlxdist.commands.report import load_run, summarize

    lines = (logged_run / "logs" / "rank0.jsonl").read_bytes().splitlines()
    step = json.loads(lines[0])
    key = data.draw(st.sampled_from(sorted(step) + ["extra"]))
    line = data.draw(st.just(step).map(lambda s: json.dumps(s | {key: data.draw(trees)}).encode())
                     | _mutated(lines[0]))
    run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank0.jsonl").write_bytes(b"\n".join([line.replace(b"\n", b" "), *lines[1:]]) + b"\n")
    loaded = load_run(run)
    text = summarize(loaded, run)  # a step of any number, or the line skipped and said
    assert "- steps: " in text and loaded.bad_lines == ("unreadable log lines ignored: 1" in text)
