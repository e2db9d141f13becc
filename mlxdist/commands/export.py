"""`python -m mlxdist.export RUN_DIR --out DIR`: a trained pretrained-base run as a HF directory;
`... --task MODULE:CALLABLE` (or `--config YAML`): a run of that task as files its own code loads
(`export_task.py`); `--base DIR --adapter ADAPTER --format mlx-lm|fused`: an adapter for mlx-lm,
or merged.

A task's factory is named on the command line, never taken from the checkpoint: rebuilding the
model imports and calls it, and a state.json is data that whoever can write the run folder can
rewrite. The checkpoint's task.factory is only compared with the one given.

The directory (config.json, model.safetensors, tokenizer files) opens with transformers'
`from_pretrained` and mlx-lm's `load` as it is, so a fine-tune leaves this project in the
format every other tool reads, with no conversion step. A task's export holds the model's
whole state dict, which `load_state_dict(..., strict=True)` / MLX `load_weights(..., strict=True)`
takes, an EMA copy, and a PEFT model's adapter directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from ..models.pretrained import PretrainedError, hf_dir, inspect, to_hf_state

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json", "generation_config.json")
_DTYPES = {"float32": np.float32, "float16": np.float16}


class ExportError(ValueError):
    pass


def export_hf(weights: dict[str, np.ndarray], base_path: str | os.PathLike, out_dir: str | os.PathLike,
              dtype: str = "float32") -> Path:
    """Write `weights` (by MLX/HF parameter name) as a HF directory of the base's architecture."""
    if dtype not in _DTYPES:
        raise ExportError(f"--dtype {dtype}: expected one of {', '.join(_DTYPES)}")
    info = inspect(base_path)
    quantized = sorted(n for n in weights if n.endswith((".scales", ".biases")))
    if quantized:
        raise ExportError(f"weight {quantized[0]} is quantized; export needs float weights "
                          "(train with model.quantize unset, or merge adapters into a float base)")
    from safetensors.numpy import save_file

    src = hf_dir(base_path, info)
    config = dict(info.hf_config) if not info.is_gguf else json.loads((src / "config.json").read_text())
    if info.is_gguf:
        config["rope_theta"] = info.hf_config["rope_theta"]
    rp = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rp, dict) and "rope_theta" in rp:
        config["rope_theta"] = rp["rope_theta"]  # mlx-lm's llama reads only the top-level key
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["torch_dtype"] = dtype
    config["dtype"] = dtype
    hf = to_hf_state(weights, info.model_type)
    if info.model_type == "gpt2":
        # The original OpenAI key names: transformers adds its `transformer.` prefix itself,
        # mlx-lm's GPT-2 reads only these.
        hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
        config.setdefault("n_ctx", config.get("n_positions", 1024))
    if config.get("tie_word_embeddings", True):
        hf.pop("lm_head.weight", None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v.astype(_DTYPES[dtype])) for k, v in hf.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.export",
                                description="Export a run's newest valid checkpoint: a pretrained model's run as a "
                                            "Hugging Face directory; a task's run, with --task naming the "
                                            "task.factory it trained with, as the model's whole state dict, its EMA "
                                            "and a PEFT adapter, for your own code (run it from the directory you "
                                            "trained from, so the task's module imports).")
    p.add_argument("run_dir", nargs="?", help="the run directory (holds checkpoints/)")
    p.add_argument("--out", required=True, help="directory to write (must be empty or absent)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="dtype of the written weights (default float32; a task's export keeps the model's own dtypes)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.add_argument("--task", metavar="MODULE:CALLABLE",
                   help="a task's run: the task.factory that rebuilds its model, the one it was trained with; "
                        "export imports and calls it, so name only code you trust (without --task, export says "
                        "which factory the checkpoint names and imports nothing)")
    p.add_argument("--config", metavar="YAML",
                   help="a task's run: your config; its task.factory counts as --task, and its task.args, where it "
                        "sets them, replace the checkpoint's (e.g. a base's path on this machine)")
    p.add_argument("--base", help="with --adapter: the base model directory (Hugging Face layout)")
    p.add_argument("--adapter", help="a PEFT adapter dir (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--format", choices=("mlx-lm", "fused"), default="fused",
                   help="with --adapter: mlx-lm's adapter layout or a fused full model")
    p.add_argument("--quantize", type=int, choices=(4, 8), default=None,
                   help="with --adapter: the adapter was trained on a quantized base (QLoRA); quantize it the "
                        "same way before merging")
    args = p.parse_args(argv)
    if args.adapter:
        if not args.base:
            p.error("--adapter needs --base")
        return _export_adapter(args)
    if not args.run_dir:
        p.error("give a RUN_DIR, or --base and --adapter")
    from ..state import checkpoint as ckpt

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        print(f"error: --out {out}: exists and is not empty; pass --force to write into it", file=sys.stderr)
        return 2
    checkpoints = Path(args.run_dir) / "checkpoints"
    if out.resolve().is_relative_to(checkpoints.resolve()):
        print(f"error: --out {out}: inside the run's checkpoints ({checkpoints}); export writes elsewhere",
              file=sys.stderr)
        return 2
    loaded = ckpt.load_latest(checkpoints, warn=lambda m: print(m, file=sys.stderr))
    if loaded is None:
        print(f"error: {args.run_dir}: no valid checkpoint in {checkpoints}", file=sys.stderr)
        return 2
    from .export_task import trained_factory

    if trained_factory(loaded.state):
        return _export_task(loaded, out, args)
    if args.task or args.config:
        print(f"error: {'--task' if args.task else '--config'}: {loaded.path} trained the built-in language "
              "model, not a task; drop it", file=sys.stderr)
        return 2
    config = loaded.state.get("config", {})
    base = config.get("model", {}).get("path")
    if not base:
        print(f"error: {loaded.path}: the run did not start from a pretrained model (model.path is unset); "
              "export needs its base's config and tokenizer", file=sys.stderr)
        return 2
    try:
        export_hf(loaded.weights, base, out, args.dtype or "float32")
    except (ExportError, PretrainedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {loaded.path.name} to {out}; open it with transformers' "
          f"AutoModelForCausalLM.from_pretrained('{out}') or mlx_lm.load('{out}')")
    return 0


def _named_task(loaded, args: argparse.Namespace) -> tuple[str | None, str, dict | None]:
    """(the factory the user named, where, the task.args of their --config or None): from
    --task and --config only, so nothing the checkpoint says picks the code."""
    from ..config import ConfigError, load_config
    from .export_task import TaskExportError

    if not args.config:
        return args.task, "--task", None
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        raise TaskExportError(str(e)) from None
    named = cfg.task.factory
    if not named:
        raise TaskExportError(f"--config {args.config}: sets no task.factory; give your task's config, or --task")
    if args.task and args.task != named:
        raise TaskExportError(f"--task {args.task} and --config {args.config} (task.factory {named}) name "
                              "different factories; give one")
    return named, "--task" if args.task else f"--config {args.config}", \
        dict(cfg.task.args) if "task.args" in cfg.explicit else None


def _export_task(loaded, out: Path, args: argparse.Namespace) -> int:
    """A task's run: the model rebuilt by the factory the user named, the checkpoint over it,
    the whole state out."""
    from .export_task import TaskExportError, check_factory, export_task

    try:
        named, where, task_args = _named_task(loaded, args)
        factory = check_factory(loaded, named, where)
    except TaskExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dtype is not None:
        print(f"error: --dtype {args.dtype}: a task's export ({factory}) writes each tensor in the model's own "
              "dtype; drop --dtype (cast in your own code after loading)", file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir():
        print(f"error: --out {out}: a file, not a directory", file=sys.stderr)
        return 2
    try:
        result = export_task(loaded, out, factory, task_args)
    except TaskExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {loaded.path.name} of task {factory} to {out} ({', '.join(result.files)}); load it in your "
          "own code (README.txt there says how):")
    for line in result.lines:
        print(f"  {line}")
    return 0


def _export_adapter(args: argparse.Namespace) -> int:
    """A run's PEFT adapter -> mlx-lm's adapter layout, or a fused full model."""
    from ..models.adapters import load_peft_into_mlx, read_peft, save_fused, save_mlx_lm_adapter

    base = Path(args.base)
    try:
        if not (base / "config.json").exists():
            raise ValueError(f"--base {base}: no config.json (not a model directory)")
        if args.format == "mlx-lm":
            state, cfg = read_peft(args.adapter)
            import json

            n_layers = json.loads((base / "config.json").read_text()).get("num_hidden_layers")
            if not n_layers:
                raise ValueError(f"{base / 'config.json'}: no num_hidden_layers")
            out = save_mlx_lm_adapter(state, cfg, int(n_layers), args.out)
            print(f"wrote mlx-lm adapter to {out} (mlx_lm.load('{base}', adapter_path='{out}'))")
            return 0
        import mlx.nn as nn
        from mlx_lm.utils import load_model

        from ..models.lora import fuse

        model, config = load_model(base)
        if args.quantize:
            nn.quantize(model, group_size=32, bits=args.quantize)
        info = load_peft_into_mlx(model, args.adapter)
        report = fuse(model, dequantize=True)
        out = save_fused(model, config, args.out, base_dir=base, dequantized=report.dequantized)
        note = (f"; the base was {args.quantize}-bit: dequantized, then merged in full precision"
                if report.dequantized else "")
        print(f"fused {report.fused} {info.method} layers into {out}{note}")
        return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1



if __name__ == "__main__":
    sys.exit(main())
