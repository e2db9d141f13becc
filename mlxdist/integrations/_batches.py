"""This rank's part of each batch the user's own DataLoader makes: the one mechanism under the
Lightning strategy and the Hugging Face Trainer.

The user's DataLoader keeps its sampler (shuffle or not, its generator and seed, a custom
sampler or batch sampler) and its `drop_last`; each of its batches is the cluster's batch, and
each rank takes its `nodes:` share of it. So one process iterating the same DataLoader sees
the very samples the ranks see together, batch for batch, and 3 + 5 train as 8 with the last
partial batch included. Every rank draws the order itself (its random state moves as one
process's would); where the ranks' orders differ (a shuffle seeded per process) rank 0's is used.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from ..control.split import proportional_split
from ..markers import write_line
from ..yourloop import session as _session


def split_batch(size: int, weights: list[float], rank: int) -> tuple[int, int]:
    """[begin, end) of rank `rank` in a batch of `size` samples, by the ranks' `weights`; a
    batch smaller than the ranks gives some ranks nothing."""
    shares = proportional_split(size, weights, minimum=1 if size >= len(weights) else 0)
    begin = sum(shares[:rank])
    return begin, begin + shares[rank]


class RankBatches(torch.utils.data.Sampler):
    """A batch sampler: this rank's part of each batch of `batches` (the user's batch sampler).

    `skip`: global batches of the first epoch iterated to skip (a run resumed mid-epoch).
    `name`: the integration, for the lines it prints."""

    def __init__(self, batches: Any, name: str, skip: int = 0):
        self.batches, self.name, self.skip = batches, name, int(skip)
        s = _session.current(name)
        self.rank, self.size, self.weights, self._world = s.rank, s.size, list(s.weights), s.world
        self._said: set[str] = set()

    # what DataLoader, Lightning and accelerate read of a batch sampler
    @property
    def sampler(self) -> Any:
        return getattr(self.batches, "sampler", None)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batches, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return bool(getattr(self.batches, "drop_last", False))

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.batches, "set_epoch", None)):
            self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._same_on_every_rank([list(b) for b in self.batches])
        skip, self.skip = self.skip, 0
        for batch in order[skip:]:
            if len(batch) < self.size:
                self._say_once("small", f"{self.name}: a batch of {len(batch)} sample(s) has fewer samples than the "
                                        f"{self.size} ranks: every rank skips it (drop_last=True would drop it too)")
                continue
            begin, end = split_batch(len(batch), self.weights, self.rank)
            yield batch[begin:end]

    def _same_on_every_rank(self, order: list[list[int]]) -> list[list[int]]:
        if self.size == 1:
            return order
        digest = hashlib.sha256(pickle.dumps(order)).hexdigest()
        if len(set(self._world.allgather(digest))) == 1:
            return order
        self._say_once("order", f"{self.name}: the training DataLoader's order differs between ranks (a shuffle "
                                "seeded per process); every rank uses rank 0's")
        return self._world.bcast(order if self.rank == 0 else None, 0)

    def _say_once(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            if self.rank == 0:
                write_line(text)


def torch_loader(loader: Any) -> torch.utils.data.DataLoader:
    """The torch DataLoader inside `loader` (accelerate's DataLoaderShard wraps one)."""
    return getattr(loader, "base_dataloader", loader)


def shard(loader: Any, name: str, skip: int = 0) -> Any:
    """A shallow copy of `loader` (any DataLoader, a subclass, accelerate's) that yields this
    rank's part of each of its batches; `loader` itself is left as it was. One line at start
    says what cannot be kept (a last batch smaller than the ranks)."""
    inner = torch_loader(loader)
    if inner.batch_sampler is None:
        raise ValueError(f"{name}: the training DataLoader has batch_size=None (it makes no batches to split "
                         "between ranks); give it a batch_size (the cluster's batch) or a batch_sampler")
    batches = RankBatches(inner.batch_sampler, name, skip)
    if _say_small_last_batch(inner, name):
        batches._said.add("small")
    base = copy.copy(inner)
    # DataLoader refuses a new batch_sampler once built; this copy is ours to set.
    object.__setattr__(base, "batch_sampler", batches)
    if inner is loader:
        return base
    out = copy.copy(loader)
    object.__setattr__(out, "base_dataloader", base)
    return out


def _say_small_last_batch(inner: torch.utils.data.DataLoader, name: str) -> bool:
    """One line (rank 0) when the epoch's last batch, known from the start, has fewer samples
    than the ranks; returns whether it has."""
    s = _session.current(name)
    bs = inner.batch_sampler
    size, drop = getattr(bs, "batch_size", None), getattr(bs, "drop_last", True)
    try:
        last = len(bs.sampler) % size if size and not drop else 0
    except TypeError:  # a sampler without a length
        return False
    if not 0 < last < s.size:
        return False
    if s.rank == 0:
        write_line(f"{name}: the epoch's last batch has {last} sample(s), fewer than the {s.size} ranks: every rank "
                   "skips it (one process would train on it)")
    return True


__all__ = ["RankBatches", "shard", "split_batch", "torch_loader"]
