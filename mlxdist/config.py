"""The run's settings: one typed dataclass tree, read from YAML plus `a.b=value` overrides.

Every problem is reported as a single `ConfigError` line that names the key and the file,
because a typo found after a 20-minute cluster launch is the most expensive kind of typo.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import gate, registry
from .optim import OPTIMIZERS
from .problems import ConfigError

_RANK_KEY = re.compile(r"rank\d+")
_LARGEST_INT = 2**53


def _range(lo: float | None = None, hi: float | None = None, choices: tuple | Callable[[], tuple] = (),
           help: str = "", param: bool = False) -> dict:
    """A field's bounds, and the line `--help` shows for it. `choices` may be a registry's names,
    read when checked (a callable: pieces registered later count); `param`: the value may be
    `name:parameter`, its name one of the choices."""
    return {"lo": lo, "hi": hi, "choices": choices, "help": help, "param": param}


def _choices(meta: dict) -> tuple:
    choices = meta.get("choices") or ()
    return tuple(choices()) if callable(choices) else choices


def _optimizer_names() -> tuple[str, ...]:
    return tuple(OPTIMIZERS)


def _help(text: str) -> dict:
    return _range(help=text)


def _read_only(self: Any, name: str, value: Any = None) -> None:
    raise dataclasses.FrozenInstanceError(
        f"config: {type(self).__name__}.{name} is read-only: a config is never written after loading; build a "
        "variant (dataclasses.replace, or load_config with key=value overrides), and put what a run decides at "
        "start in its plan (control/run_plan.py)")


def _settings(cls: type) -> type:
    """A frozen dataclass whose writes fail with a line that says what to do instead: every
    component reads one config, so a write in one would silently change what the others see."""
    cls = dataclass(frozen=True)(cls)
    cls.__setattr__ = _read_only  # type: ignore[method-assign, assignment]
    cls.__delattr__ = _read_only  # type: ignore[method-assign, assignment]
    return cls


@_settings
class ModelConfig:
    """The built-in language model: a preset (sizes overridable) or a pretrained one."""

    preset: str = field(default="tiny", metadata=_range(choices=("tiny", "small", "base", "350m", "1b")))
    dim: int | None = field(default=None, metadata=_range(8))
    n_layers: int | None = field(default=None, metadata=_range(1))
    n_heads: int | None = field(default=None, metadata=_range(1))
    n_kv_heads: int | None = field(default=None, metadata=_range(1))
    ffn_dim: int | None = field(default=None, metadata=_range(8))
    vocab_size: int = field(default=258, metadata=_range(2))
    rope_base: float = field(default=10000.0, metadata=_range(1.0))
    norm_eps: float = field(default=1e-5, metadata=_range(0.0, 1.0))
    tie_embeddings: bool = True
    grad_checkpoint_every: int = field(default=0, metadata=_range(0, help="recompute every k-th layer in backward (0: off)"))
    dtype: str = field(default="float32", metadata=_range(choices=("float32", "bfloat16", "float16")))
    path: str | None = field(default=None, metadata=_help("a pretrained model: Hugging Face dir or .gguf (`hf` extra)"))
    quantize: int | None = field(default=None, metadata=_range(choices=(4, 8), help="QLoRA: quantize the base to N bits"))


@_settings
class FinetuneConfig:
    """Full training or adapters (LoRA/DoRA) on model.path."""

    method: str = field(default="full", metadata=_range(choices=("full", "lora", "dora")))
    rank: int = field(default=8, metadata=_range(1))
    alpha: float = field(default=16.0, metadata=_range(0.0))
    dropout: float = field(default=0.0, metadata=_range(0.0, 1.0))
    targets: str = field(default="q_proj,v_proj", metadata=_help("comma-separated module names of the model"))
    layers: int = field(default=0, metadata=_range(0, help="adapt the last N layers (0: all)"))
    train_norms: bool = False


@_settings
class DataConfig:
    """The built-in LM's data (a task brings its own)."""

    source: str = field(default="builtin", metadata=_range(choices=("builtin", "shards", "synthetic", "jsonl", "hf")))
    path: str | None = field(default=None, metadata=_help("shards dir, .jsonl file/dir, or hf: datasets name/dir"))
    task: str = field(default="copy", metadata=_range(choices=("copy", "reverse", "sort", "count")))
    seq_len: int = field(default=128, metadata=_range(4))
    overlap: int = field(default=0, metadata=_range(0))
    prefetch: int = field(default=4, metadata=_range(0, 1024))
    eval_fraction: float = field(default=0.02, metadata=_range(0.0, 0.5))
    mask_prompt: bool = field(default=True, metadata=_help("jsonl prompt/chat data: loss on the answer only"))
    pack: bool = field(default=False, metadata=_help("jsonl: pack short examples into full windows"))


@_settings
class TrainConfig:
    """Optimisation and the run's cadence."""

    steps: int = field(default=250, metadata=_range(1))
    batch_size: int = field(default=16, metadata=_range(1, 1 << 24))
    accum: int = field(default=1, metadata=_range(1))
    global_batch: int | None = field(default=None, metadata=_range(1, 1 << 30))
    max_accum: int = field(default=64, metadata=_range(1))
    lr: float = field(default=3e-3, metadata=_range(0.0, 10.0))
    min_lr_ratio: float = field(default=0.1, metadata=_range(0.0, 1.0))
    warmup_steps: int = field(default=20, metadata=_range(0))
    schedule: str = field(default="cosine", metadata=_range(choices=("cosine", "linear", "constant")))
    optimizer: str = field(default="adamw", metadata=_range(choices=_optimizer_names, help=(
        "mlxdist.optim's OPTIMIZERS: adamw (m, v: 8 bytes a parameter) or lion (m: 4; wants a 3-10x lower "
        "lr), or one a plugin registered; beta1/beta2/eps are AdamW's")))
    weight_decay: float = field(default=0.1, metadata=_range(0.0, 1.0))
    beta1: float = field(default=0.9, metadata=_range(0.0, 1.0))
    beta2: float = field(default=0.95, metadata=_range(0.0, 1.0))
    eps: float = field(default=1e-8, metadata=_range(0.0, 1.0))
    grad_clip: float = field(default=1.0, metadata=_range(0.0))
    ema: float | None = field(default=None, metadata=_range(
        0.0, 1.0, help="decay of an EMA copy of the weights (e.g. 0.999): evaluated, saved beside them, exported"))
    sync_batchnorm: bool = field(default=False, metadata=_help(
        "torch tasks: BatchNorm batch statistics over every rank's samples (SyncBatchNorm, weighted by counts)"))
    eval_every: int = field(default=100, metadata=_range(0))
    eval_batches: int = field(default=4, metadata=_range(0, help="0: the whole eval set, each sample once"))
    log_every: int = field(default=10, metadata=_range(1))
    early_stop_patience: int = field(default=0, metadata=_range(0))
    early_stop_min_delta: float = field(default=0.0, metadata=_range(0.0))
    seed: int = field(default=0, metadata=_range(0))
    out_dir: str = "runs/default"
    progress: bool = True
    # A comma-separated string or a YAML list, so `Any`; validate() checks it, load_config normalises it.
    report_to: Any = field(default="none", metadata={"help": "rank 0 also logs to: tensorboard,wandb,mlflow"})


@_settings
class CheckpointConfig:
    """When and how checkpoints are written, kept and resumed."""

    every: int = field(default=100, metadata=_range(0))
    keep_last: int = field(default=3, metadata=_range(1))
    keep_best: bool = True
    # Checkpoints are plain safetensors now (docs/checkpoints.md); old configs still load.
    zstd_level: int = field(default=3, metadata=_range(1, 22, help="unused: checkpoints are not compressed"))
    resume: str = field(default="none", metadata=_help("auto: continue the newest checkpoint in train.out_dir; "
                                                        "or a checkpoint dir (--resume)"))
    # A fresh run into a train.out_dir that holds another run's checkpoints is refused without it.
    overwrite: bool = field(default=False, metadata=_help(
        "a fresh run deletes the checkpoints and logs another run left in train.out_dir (--overwrite)"))
    # The run survives losing any one host's disk (--elastic).
    on_every_host: bool = field(default=False, metadata=_help("every host also keeps a verified copy (replicas/HOST)"))


@_settings
class NodeConfig:
    """Per host (`nodes: {HOST|rankN|default: ...}`): that host's share of each step."""

    batch_size: int | None = field(default=None, metadata=_range(1, 1 << 24, help=(
        "this host's micro-batch in samples (unset: train.batch_size)")))
    memory_target: float | None = field(default=None, metadata=_range(0.05, 1.0))
    speed: float = field(default=1.0, metadata=_range(0.01, 100.0, help=(
        "this host's compute speed relative to the others (1 = all alike): dist.mode=pipeline gives a faster host "
        "more of the layer stack")))


@_settings
class DistConfig:
    """How ranks exchange gradients (ddp) or weights (diloco)."""

    mode: str = field(default="ddp", metadata=_range(choices=registry.mode_names, help=(
        "the sync strategy (STRATEGIES): ddp (data parallel), diloco, pipeline (the layer stack cut across the ranks; "
        "MLX engine), or one a plugin registered")))
    shard: str = field(default="none", metadata=_range(
        choices=registry.shard_names,
        help="data parallel, sharded: optimizer state (ZeRO-1), + gradients (ZeRO-2), + weights (ZeRO-3: a "
             "model with stages(), run a stage at a time); auto: the least that fits every rank's "
             "memory; shards sized to each rank's memory"))
    shard_split: str = field(default="memory", metadata=_range(
        choices=("memory", "equal"),
        help="shard sizes: in proportion to each rank's memory budget, or equal (the exchange's least wire time: "
             "unequal shards make it 2 x (1 - the smallest share) of the gradients, equal ones 2 (n-1)/n)"))
    backend: str = field(default="auto", metadata=_range(choices=("auto", "mlx-mpi", "mlx-ring", "mlx-jaccl", "mpi4py")))
    bucket_mb: float = field(default=25.0, metadata=_range(0.01))
    wire_dtype: str = field(default="float32", metadata=_range(
        choices=registry.codec_names, param=True,
        help="data parallel's gradients on the wire: bfloat16/float16 half the bytes; int8/int4 a quarter/eighth, "
             "blockwise with error feedback, all-gathered (for slow links, up to 7/15 ranks; docs/performance.md)"))
    sync_weights_every: int = field(default=50, metadata=_range(0))
    stall_timeout_s: float = field(default=120.0, metadata=_range(1.0))
    ring_connections: int = field(default=1, metadata=_range(1, 16))
    overlap: bool = field(default=True, metadata=_help("torch: send gradient buckets while backward runs"))
    inner_steps: int = field(default=50, metadata=_range(1, help="diloco: local steps per round, then an outer step"))
    outer_lr: float = field(default=0.7, metadata=_range(0.0, 10.0))
    outer_momentum: float = field(default=0.9, metadata=_range(0.0, 1.0))
    outer_wire: str = field(default="bfloat16", metadata=_range(choices=registry.codec_names, param=True, help=(
        "diloco: the pseudo-gradients on the wire (CODECS; NAME:PARAM for a codec that takes one)")))
    fragments: int = field(default=1, metadata=_range(1))
    sync_every_s: float | None = field(default=None, metadata=_range(
        0.1, help="diloco: time box of a round's inner phase; each rank trains on as many steps as it fits"))
    # Streaming DiLoCo: a fragment's outer step lands this many inner steps after it is
    # sent (0 = blocking), mixed with what was learnt meanwhile: alpha*local + (1-alpha)*anchor.
    overlap_steps: int = field(default=0, metadata=_range(0))
    overlap_alpha: float = field(default=0.5, metadata=_range(0.0, 1.0))
    pipeline_cut: str = field(default="", metadata=_help(
        "pipeline: how many of the model's stages (the built-in LM's embedding, each block, its head) each rank "
        "runs, in rank order, e.g. 2,4; empty: cut by each rank's memory budget and speed"))
    measure_speed: bool = field(default=True, metadata=_help(
        "pipeline: time a forward pass on every rank at start and cut by the speeds measured, unless nodes: give "
        "speeds; false: every rank alike but for nodes: speed"))
    measure_stages: bool = field(default=True, metadata=_help(
        "pipeline: time each model stage's forward pass at start and cut by those costs (an embedding's lookup is "
        "cheap, a vocabulary head dear); false: cut by parameter counts"))


@_settings
class ControlConfig:
    """Adaptive controllers: batch size by memory, balancing, health, plateau."""

    adapt_batch: bool = False
    memory_target: float = field(default=0.85, metadata=_range(0.05, 1.0))
    min_batch: int = field(default=1, metadata=_range(1))
    max_batch: int = field(default=256, metadata=_range(1))
    balance: bool = False
    balance_interval: int = field(default=5, metadata=_range(1))
    balance_hysteresis: float = field(default=0.05, metadata=_range(0.0, 1.0))
    clear_cache_every: int = field(default=100, metadata=_range(0))
    max_bad_steps: int = field(default=3, metadata=_range(1))
    max_nonfinite_steps: int = field(default=10, metadata=_range(1, help=(
        "stop the run (non-zero exit) after this many updates in a row skipped for a non-finite loss or "
        "gradient norm on any rank; rollbacks do not reset the count")))
    health_window: int = field(default=50, metadata=_range(2))
    loss_variance_warn: float | None = field(default=None, metadata=_range(0.0))
    plateau_patience: int = field(default=0, metadata=_range(0))
    plateau_factor: float = field(default=0.5, metadata=_range(0.0, 1.0))
    rollback_lr_scale: float = field(default=0.5, metadata=_range(0.0, 1.0))


@_settings
class TaskConfig:
    """Your own model, loss and data (unset: the built-in LM)."""

    factory: str | None = field(default=None, metadata=_help("package.module:callable returning an mlxdist.Task"))
    args: dict[str, Any] = field(default_factory=dict, metadata=_help("keyword arguments of the factory"))


@_settings
class MetricsConfig:
    """Prometheus endpoint on every rank (port + local rank; 0: off)."""

    port: int = field(default=9400, metadata=_range(0, 65535))
    bind: str = "0.0.0.0"


@_settings
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    nodes: dict[str, NodeConfig] = field(default_factory=dict)
    # A comma-separated string or a YAML list (load_config normalises it to the string). Code you
    # run, as task.factory (docs/trust.md): imported by load_config before the rest is checked, so
    # what the modules register (strategies, codecs, optimizers) is among the choices. A saved
    # config's list is never imported (`config_from_dict`).
    plugins: Any = field(default="", metadata={"help": "modules imported at start that register sync strategies, "
                                                       "codecs or optimizers (mlxdist/registry.py)"})
    # What loading noticed (logged once by the trainer) and the dotted keys the file and the
    # overrides set (a task's run refuses the built-in LM's keys it would ignore). Not keys of
    # the schema: a YAML file cannot set them, and `to_dict` leaves them out.
    warnings: tuple[str, ...] = field(default=(), compare=False, metadata={"loaded": True})
    explicit: frozenset[str] = field(default=frozenset(), compare=False, metadata={"loaded": True})

    def to_dict(self) -> dict[str, Any]:
        whole = dataclasses.asdict(self)
        return {f.name: whole[f.name] for f in schema_fields(Config)}

    def node_key(self, host: str, rank: int | None = None) -> str | None:
        """The `nodes:` key that applies to this rank, or None (then `train.batch_size`).

        In order: `rankN`; the host's name, or its short name (before the first dot, so
        `Studio.local` is `studio`), exactly, then as a glob; then the words of the short
        name (a Mac's default name is `Owners-Model`: `macbook` or `macbook*` matches
        `Johns-MacBook-Pro`, `mac-mini` matches `Johns-Mac-mini`), exactly, then as a glob;
        then `default`. Case never matters (macOS capitalises host names; people write keys
        in lower case). Within a step the first key in file order wins."""
        keys = {k.lower(): k for k in self.nodes}
        if rank is not None and f"rank{rank}" in keys:
            return keys[f"rank{rank}"]
        full = host.lower()
        short = full.split(".")[0]
        words = short.split("-")
        runs = ["-".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)]
        for names, glob in (((full, short), False), ((full, short), True), (runs, False), (runs, True)):
            for low, key in keys.items():
                if low == "default" or _RANK_KEY.fullmatch(low):
                    continue
                if any(fnmatch.fnmatchcase(n, low) if glob else n == low for n in names):
                    return key
        return keys.get("default")

    def node_for(self, host: str, rank: int | None = None) -> NodeConfig:
        """Settings of the `nodes:` entry for this rank (`node_key`), both filled in: with no
        entry or no batch_size, `train.batch_size` (an entry that sets only a speed keeps the
        run's micro-batch); with no memory_target, `control.memory_target`. The one reading of
        `nodes:` (the run plan, the planner and your loop's shares call it)."""
        key = self.node_key(host, rank)
        node = self.nodes[key] if key is not None else NodeConfig()
        if node.batch_size is None:
            node = dataclasses.replace(node, batch_size=self.train.batch_size)
        if node.memory_target is None:
            node = dataclasses.replace(node, memory_target=self.control.memory_target)
        return node

    def unmatched_nodes_warning(self, hosts: Sequence[str]) -> str | None:
        """With `nodes:` set, the warning to print at start when a host (of `hosts`, one per
        rank, in rank order) matches no entry and falls back to `train.batch_size`; None
        when every host matched (or `nodes:` is empty)."""
        if not self.nodes:
            return None
        missed = [h for r, h in enumerate(hosts) if self.node_key(h, r) is None]
        if not missed:
            return None
        names = ", ".join(f"'{h}'" for h in dict.fromkeys(missed))
        return (f"nodes: host {names} matched no entry ({', '.join(self.nodes)}); "
                f"{'it runs' if len(set(missed)) == 1 else 'they run'} with train.batch_size="
                f"{self.train.batch_size}. Add a key: its short name, a word of it, a glob such as "
                "'macbook*', or 'default'")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, where: str, warnings: list[str] | None = None, registered: bool = True) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where, warnings)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(tp, value, where, warnings, registered)
    if origin is dict:
        _, vtp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of name -> settings, got {value!r}")
        return {str(k): _coerce(v, vtp, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > _LARGEST_INT:  # past it, arithmetic in floats (shares, rates) is no longer exact
                raise ConfigError(f"{where}: {value} is larger than any count a run takes (at most 2**53); "
                                  "give a smaller number")
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _check_range(f: dataclasses.Field, value: Any, where: str, registered: bool = True) -> None:
    meta = f.metadata
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every `<` and `>` check
        raise ConfigError(f"{where}: {value!r} is not a finite number; give a number"
                          + (f" from {meta['lo']}" if meta.get("lo") is not None else "")
                          + (f" to {meta['hi']}" if meta.get("hi") is not None else ""))
    if value is None or not meta:
        return
    if callable(meta.get("choices")) and not registered:
        return  # a saved config: a plugin's name is data there, its module never imported
    choices = _choices(meta)
    name = value.partition(":")[0] if meta.get("param") and isinstance(value, str) else value
    if choices and name not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and value < lo:
        raise ConfigError(f"{where}: {value!r} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{where}: {value!r} is above the maximum {hi}")


# Old key -> new key. The old name still works and logs one warning.
DEPRECATED = {"model.checkpoint_every": "model.grad_checkpoint_every"}


def schema_fields(cls: type) -> list[dataclasses.Field]:
    """The fields a YAML file may set (not what loading adds: `Config.warnings`, `explicit`)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("loaded")]


def _build(cls: type, data: dict, where: str, warnings: list[str] | None = None, registered: bool = True) -> Any:
    fields = {f.name: f for f in schema_fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        old = f"{where}.{key}" if where else str(key)
        if old in DEPRECATED:
            key = DEPRECATED[old].rsplit(".", 1)[-1]
            if warnings is not None:
                warnings.append(f"'{old}' is deprecated (it reads like a save cadence); use '{DEPRECATED[old]}'")
        if key not in fields:
            prefix = f"{where}." if where else ""
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}")
        path = f"{where}.{key}" if where else key
        kwargs[key] = _coerce(value, hints[key], path, warnings, registered)
        _check_range(fields[key], kwargs[key], path, registered)
    return cls(**kwargs)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_override(text: str) -> dict:
    """`train.lr=3e-4` -> {"train": {"lr": 0.0003}}; the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- overrides, then validated; errors name the key and file."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{source}: config file not found")
        loaded = gate.read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level")
        data = loaded
    for text in overrides or []:
        data = _merge(data, parse_override(text))
    warnings: list[str] = []
    try:
        plugins = plugin_names(data.get("plugins"))
        try:
            registry.import_plugins(plugins)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        cfg = _build(Config, data, "", warnings)
        validate(cfg)
        cfg = dataclasses.replace(cfg, plugins=",".join(plugins), train=dataclasses.replace(
            cfg.train, report_to=",".join(report_to_names(cfg.train.report_to)) or "none"))
    except ConfigError as e:
        src = source if not overrides else f"{source} + overrides"
        raise ConfigError(f"{src}: {e}") from None
    if cfg.checkpoint.zstd_level != CheckpointConfig.zstd_level:
        warnings.append("checkpoint.zstd_level is no longer used: checkpoints are plain safetensors "
                        "(memory-mappable; zstd saved 7% at 3-7x the write time); remove the key")
    return dataclasses.replace(cfg, warnings=tuple(warnings), explicit=frozenset(set_keys(data)))


def set_keys(data: dict, prefix: str = "") -> set[str]:
    """The dotted keys a YAML file and overrides set (`nodes:` and `task.args` as one key each)."""
    keys: set[str] = set()
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in ("nodes", "task.args"):
            keys |= set_keys(v, key + ".")
        else:
            keys.add(key)
    return keys


def config_from_args(argv: list[str]) -> Config:
    """The Config that `python -m mlxdist.train ARGV` runs with, for tools that start the
    trainer (`launch/mlxrun --elastic`): `--config FILE`, `--resume X` (checkpoint.resume) and
    key=value overrides, on either side of the options. The trainer's other options
    (`--engine torch`, `--device cpu`) are passed over with their values; `--overwrite` is
    checkpoint.overwrite."""
    path = resume = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if arg == "--":
            overrides += argv[i:]
            break
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        flag, eq, value = arg.partition("=")
        if not eq and len(flag) > 3 and "--overwrite".startswith(flag):  # a switch: takes no value
            overrides.append("checkpoint.overwrite=true")
            continue
        ours = next((o for o in ("--config", "--resume") if len(flag) > 2 and o.startswith(flag)), None)
        if not eq and i < len(argv) and not argv[i].startswith("-") and (ours or "=" not in argv[i]):
            value, i = argv[i], i + 1  # the option's value
        elif ours and not eq:
            raise ConfigError(f"{ours}: expected a value")
        if ours == "--config":
            path = value
        elif ours == "--resume":
            resume = value
    return load_config(path, overrides + ([f"checkpoint.resume={resume}"] if resume else []))


def validate(cfg: Config) -> None:
    """Cross-field checks that a single field's range cannot express."""
    if cfg.data.overlap >= cfg.data.seq_len:
        raise ConfigError(f"data.overlap: {cfg.data.overlap} must be below data.seq_len ({cfg.data.seq_len})")
    if cfg.data.source == "shards" and not cfg.data.path:
        raise ConfigError("data.path: required when data.source is 'shards' (run `python -m mlxdist.prepare` first)")
    plugin_names(cfg.plugins)
    check_pieces(cfg)
    if cfg.control.min_batch > cfg.control.max_batch:
        raise ConfigError("control.min_batch: must not exceed control.max_batch")
    if cfg.checkpoint.resume not in ("none", "auto") and not Path(cfg.checkpoint.resume).exists():
        raise ConfigError(f"checkpoint.resume: '{cfg.checkpoint.resume}' does not exist (use 'auto', 'none' or a checkpoint dir)")
    report_to_names(cfg.train.report_to)  # load_config writes the normalised names into the config it builds
    if cfg.train.ema is not None and not 0.0 < cfg.train.ema < 1.0:
        raise ConfigError(f"train.ema: {cfg.train.ema} is the EMA's decay and must lie strictly between 0 and 1 "
                          "(e.g. 0.999), or null for none")


# Experiment trackers beside Prometheus (telemetry/trackers.py); each needs its optional extra.
REPORT_TO = ("tensorboard", "wandb", "mlflow")


def report_to_names(value: Any) -> list[str]:
    """`train.report_to` as tracker names: a YAML list, or the comma string an override gives."""
    items = [] if value is None else value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"train.report_to: expected a comma-separated string or a list, got {value!r}")
    names = [n for n in (str(x).strip().lower() for x in items) if n and n != "none"]
    for n in names:
        if n not in REPORT_TO:
            raise ConfigError(f"train.report_to: unknown tracker '{n}'; use one or more of "
                              f"{', '.join(REPORT_TO)} (comma-separated), or none")
    return list(dict.fromkeys(names))


def plugin_names(value: Any) -> list[str]:
    """`plugins` as module names: a YAML list, or the comma string an override gives."""
    items = [] if value is None else value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ConfigError(f"plugins: expected module names (a list, or comma-separated), got {value!r}")
    return list(dict.fromkeys(n for n in (x.strip() for x in items) if n))


def _strategy(name: str):
    return registry.load(registry.STRATEGIES, "sync strategy", registry.mode_strategy_name(name))


def _codec(value: str, key: str):
    try:
        return registry.make(registry.CODECS, "wire format", value, key, registry.CODEC_ALIASES)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _or(names: Sequence[str]) -> str:
    names = list(names)
    return names[0] if len(names) < 2 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_pieces(cfg: Config) -> None:
    """The one place where the pieces a config names are checked against each other, by what
    each declares of itself (never by comparing names): dist.mode's strategy (`Strategy`'s
    `ranks_differ`, `gradient_wire`, `time_box`, and its own `check_config`), the wire codecs
    (`summable`, their parameters). dist.shard with a strategy that is not `shardable` is refused
    where the strategy is chosen (`sync.strategy.strategy_name`), on every rank alike. The
    strategy classes are read through the registry (`mlxdist/registry.py`: imported by name, not
    by config's own imports; framework-free)."""
    d = cfg.dist
    cls = _strategy(d.mode)
    cls.check_config(cfg)
    title = cls.title or f"dist.mode={d.mode}"
    wire = _codec(d.wire_dtype, "dist.wire_dtype")
    _codec(d.outer_wire, "dist.outer_wire")
    if not wire.summable:
        w = d.wire_dtype
        if cls.gradient_wire == "none":
            hint = f"quantize its outer sync with {cls.wire_key}={w} and " if cls.wire_key else ""
            raise ConfigError(f"dist.wire_dtype={w}: {title} sends no gradients; {hint}leave dist.wire_dtype at float32")
        sharded = [registry.load(registry.STRATEGIES, "sync strategy", registry.SHARD_NAMES[s])
                   for s in (registry.SHARD_NAMES if d.shard == "auto" else [d.shard] if d.shard != "none" else [])]
        if any(c.gradient_wire == "summable" for c in sharded):
            raise ConfigError(f"dist.wire_dtype={w}: only plain data parallel sends quantized gradients; with "
                              f"dist.shard={d.shard} use {_or(registry.summable_codecs())}, or set dist.shard=none")
        if cls.gradient_wire == "summable":
            raise ConfigError(f"dist.wire_dtype={w}: {title} adds gradients on the wire; use "
                              f"{_or(registry.summable_codecs())}")
    if d.sync_every_s is not None and not cls.time_box:
        takers = [m for m in registry.mode_names() if _strategy(m).time_box]
        whose = _or([_strategy(m).title or f"dist.mode={m}" for m in takers]) or "no registered strategy"
        raise ConfigError(f"dist.sync_every_s: a time box for {whose}'s inner phase; set dist.mode="
                          f"{_or(takers) or '?'} (now {d.mode}) or remove it")
    if cfg.train.ema is not None and cls.ranks_differ:
        raise ConfigError(f"train.ema: with dist.mode={d.mode} the ranks hold different weights between rounds, so "
                          "there is no one model to average each step; remove train.ema or use dist.mode=ddp")
    if cfg.train.sync_batchnorm and cls.ranks_differ:
        raise ConfigError(f"train.sync_batchnorm: dist.mode={d.mode} trains each rank on its own samples between "
                          "rounds; use dist.mode=ddp, or set train.sync_batchnorm=false")


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config saved in a checkpoint (already validated when it was saved). Its
    `plugins` are never imported: a registry's name there (a plugin's strategy, codec or
    optimizer) is kept as data, not checked against what this process registered."""
    return _build(Config, data, "", registered=False)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("\n...")
    return yaml.safe_dump(f.default_factory(), default_flow_style=True).strip()  # type: ignore[misc]


def describe_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every key with its default, range and meaning, read from the dataclasses above, so
    `--help` cannot fall behind the schema."""
    lines: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in schema_fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            lines += [f"{key}:  {tp.__doc__}", *describe_keys(tp, key + ".")]
            continue
        if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            node = typing.get_args(tp)[1]
            lines += [f"{key}:  {node.__doc__}", *describe_keys(node, key + ".HOST.")]
            continue
        meta = f.metadata or {}
        bounds = "|".join(map(str, _choices(meta)))
        if meta.get("lo") is not None or meta.get("hi") is not None:
            lo, hi = meta.get("lo"), meta.get("hi")
            bounds = f">= {lo}" if hi is None else f"{lo}..{hi}"
        note = "; ".join(x for x in (bounds, meta.get("help", "")) if x)
        lines.append(f"  {key} = {_default_text(f)}" + (f"   ({note})" if note else ""))
    return lines
