"""The registries' shared rules, and the strategies' and codecs' names, below everything else.

Three registries name the pieces a run is built from: `STRATEGIES` and `CODECS` here (how ranks
agree: `sync/strategy.py` re-exports the one with the `Strategy` base; what goes on the wire:
`cluster/codec.py` re-exports the other with the `Codec` base) and `OPTIMIZERS` (`optim/`: the
update, itself below the config). An entry is the piece itself, or a "module:attr" string
imported on first use (`load`), so a run imports only what it trains with and this module
imports nothing of mlxdist: the config reads the names here for its choices (`dist.mode`,
`dist.shard`, `dist.wire_dtype`, `dist.outer_wire`), `--help` shows them, and a piece's
declarations (what it cannot be combined with: class attributes) are read from what `load` or
`make` returns, never by comparing names.

A piece from outside the package is a module the user names in the config's `plugins:` list
(code they run, as `task.factory`: docs/trust.md); `import_plugins` imports it before the config
is checked, and its `register(...)` calls add it. A name is registered once: a second
registration, of a built-in or not, is refused (replace an entry deliberately by assigning it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

# name -> the Strategy subclass, or "module:Class" for a built-in imported on first use.
STRATEGIES: dict[str, Any] = {
    "data_parallel": "mlxdist.sync.data_parallel:DataParallel",
    "zero1": "mlxdist.sync.sharded:ShardedDataParallel",
    "zero2": "mlxdist.sync.sharded:ShardedDataParallel",
    "zero3": "mlxdist.sync.fully_sharded:FullyShardedDataParallel",
    "diloco": "mlxdist.sync.diloco_strategy:DiLoCoStrategy",
    "pipeline": "mlxdist.sync.pipeline:Pipeline",
}
# name -> a Codec class or factory (called with no argument, or with the parameter of `name:param`),
# or "module:attr" for a built-in.
CODECS: dict[str, Any] = {
    "float32": "mlxdist.cluster.codec:Codec",
    "bfloat16": "mlxdist.cluster.codec:BF16Codec",
    "float16": "mlxdist.cluster.codec:FP16Codec",
    "int8": "mlxdist.cluster.codec:int8",
    "int4": "mlxdist.cluster.codec:int4",
}
CODEC_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# dist.shard's values -> the strategy that runs data parallel sharded so (`auto`: one of them,
# chosen by the memory plan); dist.mode's own spellings of a registered name.
SHARD_NAMES = {"optimizer": "zero1", "gradients": "zero2", "weights": "zero3"}
MODE_NAMES = {"ddp": "data_parallel"}


def register_in(registry: MutableMapping[str, Any], kind: str, name: str, entry: T) -> T:
    """Put `entry` under `name`; a name already there (a built-in or not) is refused."""
    if not isinstance(name, str) or not name or ":" in name or "," in name:
        raise ValueError(f"{kind} name {name!r}: give a non-empty name without ':' or ','")
    if name in registry:
        raise ValueError(f"{kind} {name!r} is registered already ({registry[name]}); choose another name")
    registry[name] = entry
    return entry


def load(registry: MutableMapping[str, Any], kind: str, name: str) -> Any:
    """The entry under `name`, a "module:attr" string imported now (and kept); one line naming
    the registered ones if there is none."""
    entry = registry.get(name)
    if entry is None:
        raise KeyError(f"no {kind} named {name!r}; registered: {', '.join(sorted(registry))}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        entry = registry[name] = obj
    return entry


def make(registry: MutableMapping[str, Any], kind: str, spec: str, key: str,
         aliases: dict[str, str] | None = None) -> Any:
    """The piece `spec` names, built: `name` calls its factory with no argument, `name:param`
    with the parameter string. ValueError (one line naming `key`) for an unknown name, a
    parameter the piece does not take, or one it refuses."""
    name, colon, param = str(spec).partition(":")
    name = (aliases or {}).get(name, name)
    if name not in registry:
        raise ValueError(f"{key}: unknown {kind} '{name}' ({', '.join(registry)})")
    factory = load(registry, kind, name)
    try:
        return factory(param) if colon else factory()
    except TypeError:
        raise ValueError(f"{key}={spec}: {name} takes no parameter; use {key}={name}") from None
    except ValueError as e:
        raise ValueError(f"{key}={spec}: {e}") from None


def mode_names() -> tuple[str, ...]:
    """dist.mode's choices: every registered strategy but the sharded ones (dist.shard's), data
    parallel under its config name `ddp`."""
    spelled = {v: k for k, v in MODE_NAMES.items()}
    sharded = set(SHARD_NAMES.values())
    return tuple(spelled.get(n, n) for n in STRATEGIES if n not in sharded)


def mode_strategy_name(mode: str) -> str:
    """The registered strategy dist.mode names."""
    return MODE_NAMES.get(mode, mode)


def codec_names() -> tuple[str, ...]:
    """The wire keys' choices: every registered codec."""
    return tuple(CODECS)


def summable_codecs() -> list[str]:
    """The registered codecs a transport may add hop by hop (`Codec.summable`; of those that
    are built without a parameter)."""
    out = []
    for n in CODECS:
        try:
            if make(CODECS, "wire format", n, n).summable:
                out.append(n)
        except ValueError:  # it needs a parameter
            continue
    return out


def shard_names() -> tuple[str, ...]:
    return ("none", *SHARD_NAMES, "auto")


def import_plugins(modules: Iterable[str], key: str = "plugins") -> None:
    """Import the user's modules that register pieces (each once; Python keeps them). Errors
    come back as ValueError naming the module and the key."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - one line naming the module
            raise ValueError(f"{key}: cannot import '{name}' ({type(e).__name__}: {e}); the module must be "
                             "importable from here (PYTHONPATH) on every host") from None


def registrar(registry: MutableMapping[str, Any], kind: str, name: str) -> Callable[[T], T]:
    """A class decorator putting the class under `name` (`register_in`)."""

    def put(obj: T) -> T:
        return register_in(registry, kind, name, obj)

    return put
