"""`python -m mlxdist.generate --model PATH | --checkpoint RUN`: stream text.

Pretrained models (a Hugging Face dir or a .gguf, a run fine-tuned from one, a LoRA adapter
on one) decode with the ecosystem's own KV-cached generators: `mlx_lm.stream_generate` on
the MLX engine, transformers' `generate` on torch, with adapters kept unmerged. The old
no-cache loop re-ran the whole context for every token (2.8 tokens/s against mlx-lm's 11.5
on SmolLM2-135M). Built-in presets (byte-level models trained from scratch here) still
draw through `engine.common.sample_tokens`: one numpy draw from fp32 logits, so the same
weights, prompt and seed give the same text on either engine.

Flag names follow mlx_lm.generate (`--model --max-tokens --temp --top-p --adapter-path`),
with the older `--tokens --temperature --adapter` kept as aliases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError
from ..engine.registry import ENGINES, engine_spec
from ..models.errors import PretrainedError
from ..state import checkpoint as ckpt

DEFAULT_PROMPT = "Hello! Who are you?"
ERRORS = (ckpt.CheckpointError, PretrainedError, ConfigError, FileNotFoundError, ValueError)


class GenerateError(ValueError):
    """A one-line problem with the command line (exit 2)."""


@dataclass
class Request:
    """What to generate, whichever engine does it."""

    prompt: str
    chat: bool | None  # None: use the chat template when the tokenizer has one (as mlx_lm does)
    system: str | None
    max_tokens: int
    temp: float
    top_p: float
    seed: int


def is_model_path(p: Path) -> bool:
    """A Hugging Face directory or a GGUF file (what `model.path` takes), not an mlxdist run."""
    return p.suffix.lower() == ".gguf" or (p / "config.json").is_file()


# -------------------------------------------------------------------------------------------
# Prompt: the same template decision and encoding as mlx_lm.generate, on either engine


def has_chat_template(tok: Any) -> bool:
    """mlx-lm's TokenizerWrapper knows templates of its own; a plain transformers tokenizer
    has one when `chat_template` is set."""
    flag = getattr(tok, "has_chat_template", None)
    return bool(flag) if flag is not None else bool(getattr(tok, "chat_template", None))


def prompt_ids(tok: Any, req: Request, where: str) -> tuple[list[int], bool]:
    """(token ids, whether the chat template was applied), encoded as mlx_lm.generate does:
    special tokens (e.g. a BOS) are added only when no template is, since a template writes
    its own."""
    chat = has_chat_template(tok) if req.chat is None else req.chat
    if chat and not has_chat_template(tok):
        raise GenerateError(f"--chat: the tokenizer of {where} has no chat template; drop --chat")
    text = req.prompt
    if chat:
        messages = [{"role": "system", "content": req.system}] if req.system is not None else []
        messages.append({"role": "user", "content": text})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif req.system is not None:
        raise GenerateError("--system-prompt: needs the chat template; drop --no-chat")
    ids = list(tok.encode(text, add_special_tokens=not chat))
    if not ids:
        raise GenerateError("--prompt: encodes to no tokens; give some text")
    return ids, chat


# -------------------------------------------------------------------------------------------
# MLX: mlx-lm's model, tokenizer and stream_generate


def mlx_tokenizer(model_path: str | Path):
    """mlx-lm's TokenizerWrapper (streaming detokenizer, EOS ids from config.json) for a base,
    loaded exactly as `mlx_lm.load` loads it; a GGUF file's comes from its cached HF conversion."""
    from mlx_lm.utils import load_tokenizer

    from ..models.pretrained import hf_dir

    d = hf_dir(model_path)
    config = json.loads((d / "config.json").read_text())
    return load_tokenizer(d, eos_token_ids=config.get("eos_token_id"))


def mlx_model_from_path(model_path: str | Path, adapter: str | None = None):
    """An mlx-lm model of the base (a GGUF dequantized to fp32, as training sees it), with an
    adapter applied unmerged: PEFT's layout (what mlxdist writes) or mlx-lm's."""
    from ..models.pretrained import load_mlx

    model, _ = load_mlx(model_path)
    if adapter is not None:
        a = Path(adapter).expanduser()
        if (a / "adapters.safetensors").is_file():
            from mlx_lm.tuner.utils import load_adapters

            load_adapters(model, str(a))
        else:
            from ..models.adapters import load_peft_into_mlx

            load_peft_into_mlx(model, a)
    model.eval()
    return model


def _for_generation(cfg: Config) -> Config:
    """Training-only settings off: mlx-lm's gradient checkpointing patches the layer class,
    which has no business in a KV-cached decode."""
    return replace(cfg, model=replace(cfg.model, grad_checkpoint_every=0))


def mlx_model_from_checkpoint(cfg: Config, weights: dict):
    """The trained model (base + its adapters, or fully trained weights) through the engine
    that trained it, so checkpoint names map the same way as on resume."""
    from mlx.utils import tree_unflatten

    from ..engine.mlx_engine import MLXEngine

    engine = MLXEngine(_for_generation(cfg))
    engine.set_weights(weights)
    engine.model.update(tree_unflatten(list(engine.params.items())))
    engine.model.eval()
    return engine.model


def generate_mlx(model, tokenizer, ids: list[int], req: Request, on_text: Callable[[str], None] | None = None,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
    """Tokens drawn by `mlx_lm.stream_generate` (KV cache, mlx-lm's sampler). `on_text` gets
    mlx-lm's text segments (what mlx_lm.generate prints: a leading space of the reply is
    dropped), `on_token` each token but the EOS. The list ends with the EOS token if one
    stopped it."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(req.seed)
    sampler = make_sampler(req.temp, req.top_p)
    tokens: list[int] = []
    for r in stream_generate(model, tokenizer, ids, max_tokens=req.max_tokens, sampler=sampler):
        tokens.append(int(r.token))  # each token comes once; the last response carries the last one
        if on_token is not None and r.finish_reason != "stop":
            on_token(int(r.token))
        if on_text is not None:
            on_text(r.text)
    return tokens


# -------------------------------------------------------------------------------------------
# torch: transformers' model and generate, PEFT adapters unmerged


@contextlib.contextmanager
def _quiet_deprecations() -> Iterator[None]:
    """PEFT calls transformers APIs that warn about their own future renames: noise between
    the user and the text, about nothing they can change."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def torch_model_from_path(model_path: str | Path, adapter: str | None, device: str):
    """A transformers model of the base (fp32) with a PEFT adapter wrapped around it."""
    from ..engine.torch_engine import select_device
    from ..models.pretrained import load_torch

    dev, _ = select_device(device)
    module, _ = load_torch(model_path, dev)
    hf = module.hf
    if adapter is not None:
        a = Path(adapter).expanduser()
        if (a / "adapters.safetensors").is_file() and not (a / "adapter_model.safetensors").is_file():
            raise GenerateError(f"--adapter {a}: mlx-lm's layout (adapters.safetensors) loads on --engine mlx only; "
                                "for torch use a PEFT adapter (a run's adapter/ dir)")
        from peft import PeftModel

        with _quiet_deprecations():
            hf = PeftModel.from_pretrained(hf, str(a), is_trainable=False)
    hf.eval()
    return hf


def torch_model_from_checkpoint(cfg: Config, weights: dict, device: str):
    """The trained model through the torch engine (its PEFT adapters stay injected, unmerged)."""
    from ..engine.torch_engine import TorchEngine

    with _quiet_deprecations():
        engine = TorchEngine(_for_generation(cfg), device)
    engine.set_weights(weights)
    hf = getattr(engine.model, "peft", None) or engine.model.hf
    hf.eval()
    return hf


def generate_torch(hf, ids: list[int], eos_ids: tuple[int, ...], req: Request,
                   on_token: Callable[[int], None]) -> list[int]:
    """Tokens from transformers' `generate` (KV cache). Every sampling knob is set here, so
    the model's generation_config cannot add a top-k or a repetition penalty mlx-lm would not
    apply; EOS is not passed to `on_token`, as mlx-lm does not print it."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Tokens(BaseStreamer):
        def __init__(self):
            self.prompt_seen, self.done = False, False

        def put(self, value):
            if not self.prompt_seen:  # generate() first hands over the prompt
                self.prompt_seen = True
                return
            for t in value.reshape(-1).tolist():
                if self.done or t in eos_ids:
                    self.done = True
                    continue
                on_token(int(t))

        def end(self):
            pass

    sampling = req.temp > 0
    gc = GenerationConfig(max_new_tokens=req.max_tokens, do_sample=sampling,
                          temperature=req.temp if sampling else 1.0, top_p=req.top_p if sampling else 1.0,
                          top_k=0 if sampling else None, min_p=None, repetition_penalty=1.0, num_beams=1,
                          eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])
    torch.manual_seed(req.seed)
    device = next(hf.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.no_grad():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc, streamer=Tokens())
    return [int(t) for t in out[0, len(ids):].tolist()]


# -------------------------------------------------------------------------------------------
# The command


def _load_checkpoint(source: Path) -> tuple[Config, dict]:
    """(the run's config, the checkpoint's weights): the newest valid checkpoint of a run dir."""
    from ..config import config_from_dict

    if (source / ckpt.MANIFEST).exists() or source.name.startswith("step_"):
        loaded = ckpt.load(source)
    else:
        root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
        loaded = ckpt.load_latest(root, warn=lambda m: print(m, file=sys.stderr))
        if loaded is None:
            raise ckpt.CheckpointError(f"--checkpoint {source}: no valid checkpoint under it "
                                       "(give an mlxdist run dir or one of its checkpoints/step_* dirs)")
    from .export_task import shown, trained_factory

    factory = trained_factory(loaded.state)
    if factory:  # read as data: generate never imports a task's code
        run = loaded.path.parent.parent if loaded.path.parent.name == "checkpoints" else "RUN_DIR"
        raise ckpt.CheckpointError(f"{loaded.path}: trained task.factory={shown(factory)}, not the built-in language "
                                   "model, and generate imports no task code; export the model's weights with "
                                   f"python -m mlxdist.export {run} --out DIR --task {shown(factory)} (if you "
                                   "trust that code) and load them into your model")
    cfg = config_from_dict(loaded.state["config"])
    return cfg, loaded.weights


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mlxdist.generate",
        description="Stream text from a pretrained model (--model) or an mlxdist run (--checkpoint). "
                    "mlx_lm.generate's flag names work too.")
    src = p.add_argument_group("what to load (exactly one of --model, --checkpoint)")
    src.add_argument("--model", help="a pretrained model: a Hugging Face directory or a .gguf file")
    src.add_argument("--checkpoint", metavar="RUN",
                     help="an mlxdist run dir (its newest valid checkpoint) or one checkpoint dir; a run "
                          "fine-tuned from a pretrained model brings its base and adapters along")
    src.add_argument("--adapter-path", "--adapter", dest="adapter",
                     help="with --model: a LoRA/DoRA adapter dir to apply unmerged (PEFT's layout, e.g. "
                          "RUN/adapter; mlx-lm's adapters.safetensors layout on --engine mlx)")
    g = p.add_argument_group("prompt")
    g.add_argument("--prompt", "-p", default=None,
                   help=f"the prompt; '-' reads stdin (default: 'def ' for byte-level runs, '{DEFAULT_PROMPT}' "
                        "for pretrained models)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the tokenizer's chat template (default: on when the tokenizer has "
                        "one, as mlx_lm does); --no-chat continues the raw prompt and echoes it")
    g.add_argument("--ignore-chat-template", dest="chat", action="store_false", default=None,
                   help="same as --no-chat (mlx_lm's name)")
    g.add_argument("--system-prompt", default=None, help="a system message before the prompt (chat template only)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", "--tokens", "-m", dest="max_tokens", type=int, default=200,
                   help="most tokens to generate (default 200); generation stops earlier at an EOS token")
    s.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8,
                   help="sampling temperature; 0 for greedy (default 0.8)")
    s.add_argument("--top-p", dest="top_p", type=float, default=1.0,
                   help="nucleus sampling mass for pretrained models (default 1.0: off)")
    s.add_argument("--seed", type=int, default=0, help="random seed of the draw (default 0)")
    s.add_argument("--context", type=int, default=None,
                   help="built-in presets only: tokens of context the no-cache sampler sees (default: the run's "
                        "seq_len)")
    r = p.add_argument_group("where")
    r.add_argument("--engine", choices=ENGINES, default="mlx",
                   help="mlx (mlx_lm.stream_generate) or torch (transformers' generate); default mlx")
    r.add_argument("--device", default="auto", help="torch engine: auto, cpu, mps, cuda or cuda:N (default auto)")
    return p


def _request(args: argparse.Namespace, default_prompt: str) -> Request:
    prompt = args.prompt if args.prompt is not None else default_prompt
    prompt = sys.stdin.read() if prompt == "-" else prompt.replace("\\n", "\n").replace("\\t", "\t")
    if args.max_tokens <= 0:
        raise GenerateError(f"--max-tokens {args.max_tokens}: give a positive number")
    if not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p {args.top_p}: give a number in (0, 1]")
    return Request(prompt, args.chat, args.system_prompt, args.max_tokens, args.temp, args.top_p, args.seed)


def _source(args: argparse.Namespace) -> tuple[str | None, Path | None, str | None]:
    """(model path, checkpoint path, a note to print): exactly one path set. `--checkpoint MODEL`
    is still read as `--model MODEL` (older commands and run banners say so), with a note."""
    if (args.model is None) == (args.checkpoint is None):
        raise GenerateError("give exactly one of --model PATH (a Hugging Face dir or .gguf) and "
                            "--checkpoint RUN (an mlxdist run or checkpoint dir)")
    if args.adapter is not None:
        a = Path(args.adapter).expanduser()
        if not (a / "adapter_config.json").is_file():
            raise GenerateError(f"--adapter {a}: no adapter_config.json here; give an adapter dir (a run's "
                                "adapter/, PEFT's layout, or mlx-lm's)")
    if args.model is not None:
        m = Path(args.model).expanduser()
        if not m.exists():
            raise GenerateError(f"--model {m}: no such file or directory (give a Hugging Face dir or a .gguf file)")
        if m.is_dir() and not is_model_path(m) and ((m / "checkpoints").is_dir() or (m / ckpt.MANIFEST).exists()):
            raise GenerateError(f"--model {m}: an mlxdist run or checkpoint; pass it as --checkpoint {m}")
        return str(m), None, None
    c = Path(args.checkpoint).expanduser()
    if is_model_path(c):
        return str(c), None, f"note: --checkpoint {c} is a pretrained model; say --model {c} (--checkpoint is " \
                             "for mlxdist runs)"
    if not c.exists():
        raise GenerateError(f"--checkpoint {c}: no such directory")
    if args.adapter is not None:
        raise GenerateError("--adapter: a checkpoint brings its own adapters; drop --adapter, or use "
                            "--model BASE --adapter DIR")
    return None, c, None


class _Stream:
    """Prints text as tokens arrive: a multi-byte character split across tokens is printed
    once it is whole (decode everything, print what is new). `trim_first_space` drops a
    leading space of the reply, as mlx-lm's streaming detokenizer does, so a chat reply reads
    the same from either engine; a continuation of an echoed prompt keeps it."""

    def __init__(self, decode: Callable[[list[int]], str], trim_first_space: bool = False):
        self.decode, self.trim, self.ids, self.shown = decode, trim_first_space, [], 0

    def _text(self) -> str:
        text = self.decode(self.ids)
        return text[1:] if self.trim and text.startswith(" ") else text

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self._text()
        if text.endswith("\ufffd"):
            return
        _write(text[self.shown:])
        self.shown = len(text)

    def close(self) -> None:
        _write(self._text()[self.shown:])


def _decoder(tok: Any) -> Callable[[list[int]], str]:
    """The tokens' text as the bytes say: no clean-up of spaces before punctuation, which
    mlx-lm's detokenizers do not do either."""
    return lambda ids: tok.decode(ids, clean_up_tokenization_spaces=False)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _pretrained(args: argparse.Namespace, model_path: str, cfg: Config | None,
                weights: dict | None) -> tuple[list[int], float]:
    """(tokens, seconds spent generating them) from mlx-lm or transformers."""
    req = _request(args, DEFAULT_PROMPT)
    if args.context is not None:
        raise GenerateError("--context: only for built-in presets; pretrained models keep their whole context "
                            "in the KV cache")
    run = _PRETRAINED[engine_spec(args.engine).generator]
    return run(args, model_path, cfg, weights, req)


def _mlx_lm(args: argparse.Namespace, model_path: str, cfg: Config | None, weights: dict | None,
            req: Request) -> tuple[list[int], float]:
    tok = mlx_tokenizer(model_path)
    ids, chat = prompt_ids(tok, req, model_path)
    model = (mlx_model_from_checkpoint(cfg, weights) if cfg is not None
             else mlx_model_from_path(model_path, args.adapter))
    t = time.perf_counter()
    if chat:  # mlx_lm.generate's own text, segment by segment
        return generate_mlx(model, tok, ids, req, on_text=_write), time.perf_counter() - t
    _write(req.prompt)
    stream = _Stream(_decoder(tok))
    out = generate_mlx(model, tok, ids, req, on_token=stream.push)
    stream.close()
    return out, time.perf_counter() - t


def _transformers(args: argparse.Namespace, model_path: str, cfg: Config | None, weights: dict | None,
                  req: Request) -> tuple[list[int], float]:
    from ..data.hf_tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    ids, chat = prompt_ids(tok.tok, req, model_path)
    hf = (torch_model_from_checkpoint(cfg, weights, args.device) if cfg is not None
          else torch_model_from_path(model_path, args.adapter, args.device))
    if not chat:
        _write(req.prompt)
    stream = _Stream(_decoder(tok.tok), trim_first_space=chat)
    t = time.perf_counter()
    out = generate_torch(hf, ids, tok.eos_ids, req, stream.push)
    stream.close()
    return out, time.perf_counter() - t


_PRETRAINED = {"mlx-lm": _mlx_lm, "transformers": _transformers}  # by the engine registry's `generator`


def _check_weights_fit(where: str, cfg: Config, weights: dict) -> None:
    """The model a checkpoint's config describes is built only when its weights are that
    model's: a config edited to dim 65536 and 512 layers would otherwise allocate GiBs before
    any weight is looked at."""
    from ..models.init import param_shapes
    from ..models.presets import param_count, resolve

    want = param_shapes(resolve(cfg.model))
    have = {n: tuple(a.shape) for n, a in weights.items()}
    wrong = [n for n in want if have.get(n) != want[n]]
    if wrong:
        n = wrong[0]
        raise ckpt.CheckpointError(f"--checkpoint {where}: its config describes a model of {param_count(resolve(cfg.model)):,} "
                                   f"parameters whose '{n}' is {want[n]}, but its weights hold "
                                   f"{have.get(n, 'no such array')} ({len(wrong)} differ); the config in "
                                   "state.json does not match the weights: is it the right checkpoint, or was it edited?")


def _preset(args: argparse.Namespace, cfg: Config, weights: dict) -> tuple[list[int], float]:
    """A byte-level model trained here: the engine's own forward and the numpy draw."""
    from ..data.tokenizer import ByteTokenizer
    from ..engine import make_engine

    req = _request(args, "def ")
    if args.chat:
        raise GenerateError("--chat: this run trained a byte-level model with no chat template")
    if args.top_p != 1.0 or args.system_prompt is not None:
        raise GenerateError("--top-p/--system-prompt: for pretrained models; a built-in preset samples "
                            "with --temp only")
    tok = ByteTokenizer()
    ids = tok.encode(req.prompt).tolist()
    if not ids:
        raise GenerateError("--prompt: empty; give at least one character")
    _check_weights_fit(args.checkpoint, cfg, weights)
    engine = make_engine(args.engine, cfg, device=args.device)
    if not engine.capabilities.generation:  # `engine.base.Generation`
        raise GenerateError(f"--engine {args.engine}: this engine does not generate (its capabilities offer no "
                            "sample()); use another --engine")
    engine.set_weights(weights)
    _write(req.prompt)
    stream = _Stream(tok.decode)
    t = time.perf_counter()
    out = engine.sample(ids, req.max_tokens, req.temp, req.seed, args.context, None, stream.push)
    stream.close()
    return out, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        model_path, run, note = _source(args)
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from ..engine import prepare_process

    prepare_process(args.engine)  # may re-exec the process (Linux BLAS): notes come after it
    if note:
        print(note, file=sys.stderr)
    try:
        if run is None:
            try:
                tokens, seconds = _pretrained(args, model_path, None, None)
            except PretrainedError as e:  # its messages name the config key, this command has a flag
                raise PretrainedError(str(e).replace("model.path: ", "--model: ", 1)) from None
        else:
            cfg, weights = _load_checkpoint(run)
            tokens, seconds = (_pretrained(args, cfg.model.path, cfg, weights) if cfg.model.path
                               else _preset(args, cfg, weights))
    except ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _write("\n")
    print(f"[{len(tokens)} tokens in {seconds:.2f} s: {len(tokens) / max(seconds, 1e-9):.1f} tokens/s]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
