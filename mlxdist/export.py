"""`python -m mlxdist.export`: turn a run's PEFT adapter into mlx-lm's adapter layout or a
fused full model, for people who serve with mlx-lm or want one self-contained directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.export")
    p.add_argument("--base", required=True, help="the base model directory (Hugging Face layout)")
    p.add_argument("--adapter", required=True, help="a PEFT adapter dir (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--format", choices=("mlx-lm", "fused"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--quantize", type=int, choices=(4, 8), default=None,
                   help="the adapter was trained on a quantized base (QLoRA): quantize it the same way before merging")
    args = p.parse_args(argv)

    from .models.adapters import load_peft_into_mlx, read_peft, save_fused, save_mlx_lm_adapter

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

        from .models.lora import fuse

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
