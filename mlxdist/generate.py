"""`python -m mlxdist.generate --checkpoint DIR`: sample text from a trained checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.generate")
    p.add_argument("--checkpoint", required=True, help="a checkpoint dir, or a run dir (its newest valid one)")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("mlx", "torch"), default="mlx")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)

    from . import checkpoint as ckpt
    from .config import config_from_dict
    from .data.tokenizer import ByteTokenizer
    from .engine import make_engine

    path = Path(args.checkpoint)
    try:
        if (path / ckpt.MANIFEST).exists() or path.name.startswith("step_"):
            loaded = ckpt.load(path)
        else:
            root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
            loaded = ckpt.load_latest(root, warn=lambda m: print(m, file=sys.stderr))
            if loaded is None:
                raise ckpt.CheckpointError(f"no valid checkpoint under {path}")
    except (ckpt.CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cfg = config_from_dict(loaded.state["config"])
    engine = make_engine(args.engine, cfg, device=args.device)
    engine.set_weights(loaded.weights)
    tok = ByteTokenizer()
    ids = engine.sample(tok.encode(args.prompt).tolist(), args.tokens, args.temperature, args.seed)
    print(args.prompt + tok.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
