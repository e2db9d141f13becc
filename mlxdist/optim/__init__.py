"""Optimizer math, written once over a few tensor primitives, for every engine and shard mode.

An optimizer here is a small frozen dataclass: its hyper-parameters (read from the config's
`train` section), the names of the state it keeps per trained parameter (checkpoints hold
`<state name>.<param>`), and `update`, one formula over the primitives of an `xp` namespace
(`numpy_ops` defines them: `scale_`, `ema_`, `ema_square_`, `mix`, `decay_`, `descend_`, `div`,
`add_`, `sqrt_`, `sign_`). The same `update` is what the MLX engine compiles per parameter
(`mlx_ops`: numpy_ops's definitions over mlx.core, so its arithmetic is the formula as
written), what the torch engine runs over all its parameters at once (`torch_ops.Many`: each
primitive one `torch._foreach_*` call, in place), and what ZeRO-1/2/3 run on a rank's flat
shard (`decay` a mask there): so a sharded run equals data parallel by construction, and the
two engines agree to rounding.

Nothing here imports a framework at module level (the torch engine runs where MLX is not
installed): each namespace is imported by the engine that uses it. Adding an optimizer is one
module with an `Optimizer` dataclass and `@register_optimizer` (its `name`; the built-ins are
entries of `OPTIMIZERS`); the config's choices (`train.optimizer`), checkpoints (its
`state_names`), DiLoCo's rank files and the memory plan (`state_bytes`) follow from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from ..registry import register_in
from .adamw import AdamW
from .lion import Lion
from .optimizer import Optimizer

OPTIMIZERS: dict[str, type[Optimizer]] = {o.name: o for o in (AdamW, Lion)}

Opt = TypeVar("Opt", bound=type[Optimizer])


def register_optimizer(cls: Opt) -> Opt:
    """A class decorator: the optimizer under its `name` (train.optimizer=NAME). A name is
    registered once (a built-in's too)."""
    return register_in(OPTIMIZERS, "optimizer", cls.name, cls)


def make_optimizer(name: str, train) -> Optimizer:
    """The optimizer `train.optimizer` names, its hyper-parameters from `train` (the config's
    section, or anything with the same attributes)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"train.optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name].from_config(train)


def state_owner(keys) -> str | None:
    """The optimizer whose state names are exactly the prefixes of `keys` (`m.w`, `v.w`, ...);
    None when no registered one keeps that state."""
    prefixes = {k.split(".", 1)[0] for k in keys}
    found = [n for n, o in OPTIMIZERS.items() if set(o.state_names) == prefixes]
    return found[0] if len(found) == 1 else None


def check_state(opt: Optimizer, names: list[str], state: Mapping) -> None:
    """One line before anything is overwritten when `state` (a checkpoint's optimizer state) is
    not exactly `opt`'s for `names`: another optimizer's (named), incomplete, or with more."""
    missing = [k for k in (f"{s}.{n}" for s in opt.state_names for n in names) if k not in state]
    extra = sorted({k.split(".", 1)[0] for k in state} - set(opt.state_names))
    if not missing and not extra:
        return
    other = state_owner(state)
    if other is not None and other != opt.name:
        raise ValueError(f"the checkpoint holds {other}'s optimizer state ({', '.join(OPTIMIZERS[other].state_names)}"
                         f" per parameter) but this run trains with {opt.name} (train.optimizer): resume with "
                         f"train.optimizer={other}, or start a fresh run")
    if missing:
        raise ValueError(f"the checkpoint's optimizer state lacks {len(missing)} of {opt.name}'s entries "
                         f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")
    raise ValueError(f"the checkpoint's optimizer state holds {', '.join(e + '.*' for e in extra)}, which "
                     f"{opt.name} (train.optimizer) does not keep")


__all__ = ["OPTIMIZERS", "AdamW", "Lion", "Optimizer", "check_state", "make_optimizer", "register_optimizer",
           "state_owner"]
