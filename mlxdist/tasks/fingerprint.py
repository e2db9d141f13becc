"""All ranks must train the same thing (DESIGN promise 6): the task's code and arguments,
and the dataset (its length and a hash of a few samples), compared at start. The samples are
read as `dataset[i]` is, before `Task.augment`: augmentation (seeded by position) never trips
it; a dataset that is random when read does, and the message says so.

The built-in corpus is read from the local Python standard library, which differs between
Python versions on different Macs; the dataset hash catches that too.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import Task, TaskError, tree_map


@dataclass(frozen=True)
class Fingerprint:
    code: str  # the factory's module source and args (built-in LM: its data settings)
    length: int
    samples: str  # hash of a few samples' bytes
    random_reads: bool = False  # a probe read twice gave different bytes


def _hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()[:16]


def code_fingerprint(task: Task, args: Any = None) -> str:
    module = inspect.getmodule(task.build)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = getattr(module, "__name__", "")
    return _hash(source.encode(), json.dumps(args, sort_keys=True, default=str).encode())


def sample_bytes(sample: Any) -> bytes:
    """A sample's leaves and type as bytes (what the fingerprint hashes)."""
    parts: list[bytes] = []
    tree_map(lambda a: parts.append(np.ascontiguousarray(a).tobytes()), sample)
    return b"".join(parts) + repr(type(sample)).encode()


def dataset_fingerprint(dataset: Any, probes: int = 4) -> tuple[int, str, bool]:
    """Length, hash of a few samples, and whether a sample read twice differed."""
    n = len(dataset)
    picks = sorted({(n - 1) * k // max(probes - 1, 1) for k in range(probes)})
    parts = [sample_bytes(dataset[i]) for i in picks]
    random_reads = any(sample_bytes(dataset[i]) != b for i, b in zip(picks, parts, strict=True))
    return n, _hash(*parts), random_reads


def fingerprint(task: Task, args: Any = None) -> Fingerprint:
    return Fingerprint(code_fingerprint(task, args), *dataset_fingerprint(task.dataset))


def check_same(prints: Sequence[Fingerprint], hosts: Sequence[str], task: str) -> None:
    """One line naming the first rank whose task differs from rank 0's, raised on every rank."""
    ref = prints[0]
    for r, p in enumerate(prints):
        where = f"rank {r} ({hosts[r]})"
        if p.code != ref.code:
            why = f"task {task}: the code or task.args on {where} differ from rank 0's ({hosts[0]}); " \
                  "copy the same code to every host"
        elif p.length != ref.length:
            why = f"task {task}: the dataset on {where} has {p.length} samples, rank 0's ({hosts[0]}) has " \
                  f"{ref.length}; every host must see the same dataset"
        elif p.samples != ref.samples and (p.random_reads or ref.random_reads):
            where = where if p.random_reads else f"rank 0 ({hosts[0]})"
            why = f"task {task}: the dataset on {where} returns different samples for the same index (random " \
                  "when read, e.g. a random transpose or crop in __getitem__); draw that randomness in " \
                  "Task.augment(sample, rng) from the rng it is given, seeded by the sample's position, so every " \
                  "rank and a resume see the same sample"
        elif p.samples != ref.samples:
            why = f"task {task}: the dataset's samples on {where} differ from rank 0's ({hosts[0]}); every host " \
                  "must see the same data (for the built-in corpus: the same Python version)"
        else:
            continue
        err = TaskError(why)
        err.all_ranks = True  # every rank raises it together: no abort needed
        raise err
