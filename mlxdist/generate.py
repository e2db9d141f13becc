"""`python -m mlxdist.generate --checkpoint RUN_DIR|CHECKPOINT|MODEL_PATH`: stream text.

The same weights, prompt and seed give the same text on either engine: the draw is made
in one place (`engine.common.sample_tokens`) from fp32 logits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import Config, ConfigError
from .state import checkpoint as ckpt


def _is_model_path(p: Path) -> bool:
    return p.suffix == ".gguf" or (p / "config.json").is_file()


def _load(source: Path, adapter: str | None) -> tuple[Config, dict | None]:
    """(config to build the engine with, weights to set or None)."""
    from .config import config_from_dict

    if _is_model_path(source):
        cfg = Config()
        cfg.model.path, cfg.data.seq_len = str(source), 2048
        if adapter is None:
            return cfg, None
        from .models.adapters import read_peft

        state, cfg.finetune = read_peft(adapter)
        return cfg, state
    if (source / ckpt.MANIFEST).exists() or source.name.startswith("step_"):
        loaded = ckpt.load(source)
    else:
        root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
        loaded = ckpt.load_latest(root, warn=lambda m: print(m, file=sys.stderr))
        if loaded is None:
            raise ckpt.CheckpointError(f"no valid checkpoint under {source}")
    cfg = config_from_dict(loaded.state["config"])
    if cfg.task.factory:
        raise ckpt.CheckpointError(f"{loaded.path}: trained task.factory={cfg.task.factory}, not the built-in "
                                   "language model; load its weights (model.safetensors.zst, by parameter name) "
                                   "into your model to use it")
    return cfg, loaded.weights


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.generate")
    p.add_argument("--checkpoint", required=True,
                   help="a run dir (its newest valid checkpoint), a checkpoint dir, or a model (HF dir or .gguf)")
    p.add_argument("--adapter", help="a PEFT adapter dir to apply, unmerged, on the --checkpoint model")
    p.add_argument("--prompt", default=None, help="default: 'def ' for byte-level runs, a greeting for models")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=None, help="tokens of context (default: the run's seq_len)")
    p.add_argument("--engine", choices=("mlx", "torch"), default="mlx")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)

    from .engine import make_engine, prepare_process

    prepare_process(args.engine)
    try:
        cfg, weights = _load(Path(args.checkpoint).expanduser(), args.adapter)
        engine = make_engine(args.engine, cfg, device=args.device)
        if weights is not None:
            engine.set_weights(weights)
        if cfg.model.path:
            from .data.hf_tokenizer import load_tokenizer

            tok = load_tokenizer(cfg.model.path)
            text = args.prompt if args.prompt is not None else "Hello! Who are you?"
            ids = tok.apply_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
            stop = set(tok.eos_ids)
        else:
            if args.chat:
                raise ConfigError("--chat: this run trained a byte-level model with no chat template")
            from .data.tokenizer import ByteTokenizer

            tok, stop = ByteTokenizer(), None
            text = args.prompt if args.prompt is not None else "def "
            ids = tok.encode(text).tolist()
    except (ckpt.CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stream = _Stream(tok, prefix="" if args.chat else text)
    engine.sample(ids, args.tokens, args.temperature, args.seed, args.context, stop, stream.push)
    stream.close()
    return 0


class _Stream:
    """Prints text as tokens arrive: a multi-byte character split across tokens is printed
    once it is whole (decode everything, print what is new)."""

    def __init__(self, tok, prefix: str):
        self.tok, self.ids, self.shown = tok, [], 0
        sys.stdout.write(prefix)
        sys.stdout.flush()

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.shown:])
        sys.stdout.flush()
        self.shown = len(text)

    def close(self) -> None:
        text = self.tok.decode(self.ids)
        sys.stdout.write(text[self.shown:] + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
