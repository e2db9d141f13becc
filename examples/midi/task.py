"""A symbolic-music transformer trained by mlxdist: pretrain on several composers, then
fine-tune on one, on real scores shipped inside the `music21` package (nothing downloaded).

    python -m mlxdist.train --config configs/pretrain.yaml            # from examples/midi
    python -m mlxdist.train --config configs/finetune-m1pro-16gb.yaml
    python task.py generate runs/finetune-bach bach.mid               # sample a MIDI file
    python task.py eval runs/finetune-bach [--base]                   # held-out loss, every window once
    python task.py prepare configs/pretrain.yaml                      # build the cache only

Scores -> MIDI (music21, once) -> REMI tokens (miditok) -> overlapping windows. The cache
matters because parsing MusicXML costs ~0.5 s a piece, and under mpirun every rank would
otherwise pay it at every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import mlxdist

PAD = 0  # miditok's PAD_None; padded targets are not counted
VOCAB = "__vocab_size__"  # stored beside the pieces: training ranks need not import miditok
SCORE_SUFFIXES = (".mxl", ".xml", ".musicxml", ".krn")  # .abc files are collections, .rntxt analyses
REMI_CONFIG = {"use_programs": True, "use_velocities": False}


def tokenizer():
    """One REMI stream for all voices (programs in it); velocities dropped: the corpus plays
    every note at one velocity, so they would be tokens with nothing to learn."""
    # Imported only when needed: miditok imports torch when present, seconds per process.
    from miditok import REMI, TokenizerConfig

    return REMI(TokenizerConfig(**REMI_CONFIG))


def _tokenizer_tag() -> str:
    # The cache is only valid for the tokenizer that made it.
    from importlib.metadata import version

    key = json.dumps([REMI_CONFIG, version("miditok")], sort_keys=True).encode()
    return hashlib.sha256(key).hexdigest()[:8]


def corpus_pieces(composer: str, limit: int | None) -> list[tuple[str, Path]]:
    """(name, path) of the composer's scores in music21's corpus, sorted so every host agrees.
    A score in two formats (Beethoven's quartets are there as .krn and .mxl) counts once:
    the copy would otherwise land on both sides of the train/eval split."""
    from music21 import corpus

    base = Path(corpus.__file__).parent / composer
    by_stem: dict[str, Path] = {}
    for path in map(Path, corpus.getComposer(composer)):
        if path.suffix in SCORE_SUFFIXES:
            stem = str(path.relative_to(base).with_suffix(""))
            if stem not in by_stem or SCORE_SUFFIXES.index(path.suffix) < SCORE_SUFFIXES.index(by_stem[stem].suffix):
                by_stem[stem] = path
    if not by_stem:
        raise ValueError(f"music21's corpus has no scores by {composer!r} (see music21.corpus.getComposer)")
    return [(str(by_stem[s].relative_to(base)), by_stem[s]) for s in sorted(by_stem)][:limit]


def _atomic(path: Path, write) -> None:
    """Ranks on one Mac may build the same cache at once: each writes a private file and
    renames it, so a reader sees a whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def to_midi(score_path: Path, midi_path: Path) -> bool:
    if not midi_path.exists():
        from music21 import converter

        try:
            _atomic(midi_path, lambda tmp: converter.parse(score_path).write("midi", fp=tmp))
        except Exception as e:  # noqa: BLE001 - a score music21 cannot convert is skipped, not fatal
            print(f"midi: skipping {score_path.name}: {type(e).__name__}: {e}", file=sys.stderr)
            return False
    return True


class Progress:
    """`prepare`'s account on stderr while it converts: scores parsed of the total, tokens so
    far and the time taken, every `every` seconds (a Beethoven quartet alone takes tens of
    seconds) and once at the end; silent when the cache has everything."""

    def __init__(self, total: int, every: float = 10.0, out=None):
        self.total, self.every, self.out = total, every, out or sys.stderr
        self.done = self.tokens = self.skipped = 0
        self.clock = time.monotonic
        self.start = self.last = self.clock()

    def line(self, composer: str) -> str:
        took = self.clock() - self.start
        skipped = f", {self.skipped} skipped" if self.skipped else ""
        return (f"prepare: {self.done}/{self.total} scores parsed ({composer}{skipped}), "
                f"{self.tokens / 1e3:.0f}k tokens so far, {int(took // 60)}m{int(took % 60):02d}s elapsed")

    def advance(self, composer: str, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        self.skipped += int(tokens == 0)
        now = self.clock()
        if self.done == self.total or now - self.last >= self.every:
            print(self.line(composer), file=self.out, flush=True)
            self.last = now


def _cached(composer: str, limit: int | None, cache: Path) -> tuple[list[tuple[str, Path]], Path, dict]:
    """The composer's pieces, its token file and what that file already holds."""
    pieces = corpus_pieces(composer, limit)
    path = cache / "tokens" / f"{composer}-{_tokenizer_tag()}.npz"
    have = {}
    if path.exists():
        with np.load(path) as saved:
            have = dict(saved)
    return pieces, path, have


def composer_tokens(composer: str, limit: int | None, cache: Path,
                    progress: Progress | None = None) -> tuple[dict[str, np.ndarray], int]:
    """name -> BOS + REMI ids + EOS for the composer's first `limit` pieces, and the
    vocabulary size; from the cache when it has them all."""
    pieces, path, have = _cached(composer, limit, cache)
    missing = [(n, p) for n, p in pieces if n not in have]
    if missing:
        import symusic

        tok = tokenizer()
        bos, eos = tok["BOS_None"], tok["EOS_None"]
        for name, score_path in missing:
            midi = cache / "midi" / composer / (name.replace("/", "__") + ".mid")
            ids = [bos, *tok(symusic.Score(midi)).ids, eos] if to_midi(score_path, midi) else []
            have[name] = np.array(ids, np.int16)  # vocabulary < 32k; empty: failed, not retried
            if progress is not None:
                progress.advance(composer, len(ids))
        have[VOCAB] = np.array(len(tok))

        def save(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **have)

        _atomic(path, save)
    return {n: have[n] for n, _ in pieces if n in have and len(have[n]) > 2}, int(have[VOCAB])


class Windows:
    """Windows of `window + 1` tokens (inputs and shifted targets) cut from each piece every
    `window - overlap` tokens; a piece's last window is padded with PAD."""

    def __init__(self, pieces: list[np.ndarray], window: int, overlap: int):
        self.pieces, self.window = pieces, window
        self.index = []
        for p, toks in enumerate(pieces):
            start = 0
            self.index.append((p, start))
            while start + window + 1 < len(toks):
                start += window - overlap
                self.index.append((p, start))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> np.ndarray:
        p, s = self.index[i]
        out = np.full(self.window + 1, PAD, np.int32)
        chunk = self.pieces[p][s:s + self.window + 1]
        out[:len(chunk)] = chunk
        return out


def split(composers, pieces, eval_every, cache) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Every `eval_every`-th piece of each composer is held out (its last one if it has fewer)."""
    train, held = [], []
    todo = sum(len([n for n, _ in listed if n not in have]) for listed, _, have in
               (_cached(c, pieces, Path(cache)) for c in composers))
    progress = None
    if todo:
        print(f"prepare: {todo} scores of {', '.join(composers)} to parse (music21 -> MIDI -> REMI tokens, "
              f"once), cached in {cache}", file=sys.stderr, flush=True)
        progress = Progress(todo)
    for composer in composers:
        named, vocab = composer_tokens(composer, pieces, Path(cache), progress)
        toks = list(named.values())
        if len(toks) < 2:
            raise ValueError(f"{composer}: {len(toks)} usable piece(s); need 2 (one is held out)")
        out = set(range(eval_every - 1, len(toks), eval_every)) or {len(toks) - 1}
        train += [t for i, t in enumerate(toks) if i not in out]
        held += [t for i, t in enumerate(toks) if i in out]
    return train, held, vocab


def music_transformer(vocab: int, dim: int = 256, layers: int = 4, heads: int = 4, ffn: int = 704):
    """A small Llama-style decoder: RMSNorm, rotary positions, SwiGLU, tied embeddings, with
    Llama's layer names (so LoRA targets read the same). Its classes are made here because MLX
    must be imported only after mlxdist has set up a fast BLAS on Linux."""
    import mlx.core as mx
    import mlx.nn as nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in "qkvo")
            self.rope = nn.RoPE(dim // heads)

        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = (p(x).reshape(b, t, heads, -1).transpose(0, 2, 1, 3) for p in (self.q_proj, self.k_proj, self.v_proj))
            o = mx.fast.scaled_dot_product_attention(self.rope(q), self.rope(k), v, scale=(dim // heads) ** -0.5,
                                                     mask="causal")
            return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, t, dim))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
            self.down_proj = nn.Linear(ffn, dim, bias=False)

        def __call__(self, x):
            return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.self_attn = nn.RMSNorm(dim), Attention()
            self.mlp_norm, self.mlp = nn.RMSNorm(dim), MLP()

        def __call__(self, x):
            x = x + self.self_attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class MusicTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = [Block() for _ in range(layers)]
            self.norm = nn.RMSNorm(dim)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.embed.as_linear(self.norm(x))

    return MusicTransformer()


def load_pretrained(model, run_dir: str) -> None:
    from mlxdist.models.weights import load_mlx
    from mlxdist.state.checkpoint import load_latest

    loaded = load_latest(Path(run_dir) / "checkpoints")
    if loaded is None:
        raise FileNotFoundError(f"init_from: no checkpoint in {run_dir}/checkpoints (run the pretraining first, "
                                "and copy that run directory to every host)")
    was = loaded.state.get("config", {}).get("task", {}).get("args", {}).get("model")
    shape = "{" + ", ".join(f"{k}: {v}" for k, v in was.items()) + "}" if isinstance(was, dict) else None
    # strict: every parameter, with its shape; a mismatch is one line
    load_mlx(model, loaded.weights, what=f"init_from {loaded.path}",
             hint=f"task.args.model must be the pretraining run's: 'task.args.model={shape}'" if shape else
             "task.args.model must be the pretraining run's")


def add_lora(model, rank: int = 8, scale: float = 2.0, targets=("self_attn.q_proj", "self_attn.v_proj"),
             layers: int = 0, dtype: str = "float32") -> None:
    """Freeze the model and wrap `targets` (names inside a block) of the last `layers` blocks
    (0: all) in low-rank adapters: mlxdist trains and all-reduces `trainable_parameters()`
    only, the adapters. mlxdist casts only what it trains, so the frozen base is cast to
    the compute dtype here."""
    import mlx.core as mx
    import mlx.nn as nn

    class LoRALinear(nn.Module):
        """W x + scale * (x A) B with W frozen; B starts at zero, so step 0 is the pretrained model."""

        def __init__(self, base: nn.Linear):
            super().__init__()
            out_dim, in_dim = base.weight.shape
            self.base = base
            self.lora_a = mx.random.uniform(-in_dim ** -0.5, in_dim ** -0.5, (in_dim, rank))
            self.lora_b = mx.zeros((rank, out_dim))

        def __call__(self, x):
            return self.base(x) + (scale * (x @ self.lora_a) @ self.lora_b).astype(x.dtype)

    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    model.freeze()
    for block in model.layers[-layers if layers else 0:]:
        for name in targets:
            *path, leaf = name.split(".")
            parent = block
            for part in path:
                parent = getattr(parent, part)
            setattr(parent, leaf, LoRALinear(getattr(parent, leaf)))


def make_task(composers=("bach",), pieces: int | None = None, window: int = 512, overlap: int = 128,
              eval_every: int = 10, cache: str = "cache", model: dict | None = None, init_from: str | None = None,
              lora: dict | None = None) -> mlxdist.Task:
    """`composers` from music21's corpus, their first `pieces` scores each (None: all);
    `model` the transformer's {dim, layers, heads, ffn}; `init_from` a pretraining run
    directory whose latest weights start the model; `lora` ({rank, scale, targets, layers})
    trains adapters on the frozen model instead of every weight."""
    if overlap >= window:
        raise ValueError(f"overlap {overlap} must be below window {window}")
    train, held, vocab = split(list(composers), pieces, eval_every, cache)

    def build(ctx):
        net = music_transformer(vocab, **(model or {}))
        if init_from:
            load_pretrained(net, init_from)
        if lora:
            add_lora(net, **lora, dtype=ctx.config.model.dtype)
        return net

    def loss(net, tokens):  # the SUM over predicted (non-PAD) tokens
        import mlx.core as mx
        import mlx.nn as nn

        targets = tokens[:, 1:]
        logits = net(tokens[:, :-1]).astype(mx.float32)  # bf16 logits lose the small probabilities
        return (nn.losses.cross_entropy(logits, targets) * (targets != PAD)).sum()

    n_tokens = sum(map(len, train))
    return mlxdist.Task(build=build, loss=loss, dataset=Windows(train, window, overlap),
                        eval_dataset=Windows(held, window, 0), count=lambda b: int((b[:, 1:] != PAD).sum()),
                        unit="tokens", data_summary=f"{len(train)} pieces by {', '.join(composers)} "
                        f"({n_tokens / 1e3:.0f}k REMI tokens), {len(held)} held out; windows of {window}")


# ---------------------------------------------------------------- a run's checkpoint
def load_run(run_dir: str, base: bool = False):
    """(task, model, checkpoint) of a run's latest checkpoint, the task rebuilt from the config
    it recorded (run from the directory it was started in). `base`: the model before training,
    as `build` makes it: for a fine-tune the init_from weights, with LoRA adapters at zero."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    from mlxdist.config import config_from_dict
    from mlxdist.state.checkpoint import load_latest
    from mlxdist.tasks import TaskContext

    loaded = load_latest(Path(run_dir) / "checkpoints")
    if loaded is None:
        raise SystemExit(f"no checkpoint in {run_dir}/checkpoints")
    cfg = config_from_dict(loaded.state["config"])
    if base and not cfg.task.args.get("init_from"):
        raise SystemExit(f"--base: {run_dir} has no task.args.init_from; its model before training is random")
    task = make_task(**cfg.task.args)
    net = task.build(TaskContext("mlx", str(mx.default_device()), cfg.train.seed, cfg))
    if not base:  # a LoRA checkpoint holds the adapters only; the base came from init_from in build
        net.update(tree_unflatten([(k, mx.array(v)) for k, v in loaded.weights.items()]))
    net.eval()
    return task, net, loaded


def evaluate(run_dir: str, base: bool = False, batch: int = 8) -> float:
    """Held-out loss per token over every held-out window once (mlxdist's own evaluation with
    `train.eval_batches=0`), of the run's latest checkpoint or, with `base`, of its start."""
    import mlx.core as mx

    task, net, loaded = load_run(run_dir, base)
    dtype = loaded.state["config"]["model"]["dtype"]
    if dtype != "float32":  # the compute dtype, as mlxdist's evaluation runs
        net.set_dtype(getattr(mx, dtype))
    data, loss_sum, tokens = task.eval_dataset, 0.0, 0
    for start in range(0, len(data), batch):
        b = task.make_batch(data, list(range(start, min(len(data), start + batch))))
        loss_sum += float(task.loss(net, mx.array(b.data)))
        tokens += b.count
    what = "before training (init_from)" if base else f"step {loaded.state.get('step', '?')}"
    print(f"{run_dir} {what}: held-out loss {loss_sum / tokens:.3f} per token over all {len(data)} held-out "
          f"windows ({tokens} tokens)")
    return loss_sum / tokens


# ---------------------------------------------------------------- generation
def generate(run_dir: str, out: str, tokens: int = 256, temperature: float = 1.0, seed: int = 0,
             prompt: int = 32) -> int:
    """Continue the first held-out piece's opening with the latest checkpoint's weights;
    writes `out` and returns the number of notes in it, read back from the file."""
    import mlx.core as mx
    import symusic

    task, net, loaded = load_run(run_dir)
    tok = tokenizer()
    seq = [int(t) for t in task.eval_dataset.pieces[0][:prompt]]
    special = [tok[t] for t in tok.special_tokens]  # never drawn: EOS would end a short sample early
    rng, context = np.random.default_rng(seed), task.dataset.window
    for _ in range(tokens):  # the whole context again per token: short and simple, fine for a sample
        z = np.array(net(mx.array([seq[-context:]]))[0, -1].astype(mx.float32), np.float64)
        z[special] = -np.inf
        if temperature <= 0:
            nxt = int(np.argmax(z))
        else:
            p = np.exp((z - z.max()) / temperature)
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        seq.append(nxt)
    tok.decode(seq).dump_midi(out)
    notes = sum(len(t.notes) for t in symusic.Score(out).tracks)  # parse the file back
    given = sum(len(t.notes) for t in tok.decode(seq[:prompt]).tracks)
    print(f"{out}: {notes} notes ({notes - given} sampled in {tokens} tokens after a {prompt}-token prompt "
          f"from a held-out piece), step {loaded.state.get('step', '?')} of {run_dir}")
    return notes


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python task.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="sample a MIDI file from a run's latest checkpoint")
    g.add_argument("run_dir")
    g.add_argument("out")
    g.add_argument("--tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt", type=int, default=32, help="tokens of a held-out piece to continue")
    e = sub.add_parser("eval", help="held-out loss per token of a run's latest checkpoint, every window once")
    e.add_argument("run_dir")
    e.add_argument("--base", action="store_true", help="the model before training: for a fine-tune, init_from's")
    pr = sub.add_parser("prepare", help="build the token cache of a config's task (before mpirun)")
    pr.add_argument("config")
    pr.add_argument("overrides", nargs="*", help="key=value, as for mlxdist.train (task.args.pieces=20)")
    a = p.parse_args(argv)
    if a.cmd in ("generate", "eval"):
        from mlxdist.blas import ensure_openblas

        ensure_openblas()  # Linux: re-exec once with the fast BLAS, before MLX loads
        if a.cmd == "eval":
            evaluate(a.run_dir, a.base)
            return 0
        return 0 if generate(a.run_dir, a.out, a.tokens, a.temperature, a.seed, a.prompt) > 0 else 1
    from mlxdist.config import load_config

    task = make_task(**load_config(a.config, a.overrides).task.args)
    print(task.data_summary, f"-> {len(task.dataset)} training windows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
