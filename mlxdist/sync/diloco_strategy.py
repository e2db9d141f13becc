"""`dist.mode=diloco` in the training loop: the component between the engine's local
steps and DiLoCo's outer step.

The engine steps on its own gradients (no all-reduce); after each step the loop calls
`after_step`, which syncs the fragments DiLoCo says are due, blocking or on a worker
thread (`dist.overlap_steps`), and writes the new weights back into the engine. The
outer state is split the way it lives: what every rank shares (outer momentum, fragment
cursor; the anchors are the checkpoint's model weights) goes into rank 0's checkpoint,
what is each rank's own (local weights, AdamW moments, wire residuals, round position)
into a per-rank file (`rank_state.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import DistConfig
from ..state import rank_state
from .comm import allgather_from_comm, allreduce_from_comm
from .diloco import DiLoCo, OuterStats
from .overlap import OverlappedSync

_OUTER = "outer."  # prefix of the shared outer state inside the checkpoint's optimizer file


class OuterSync:
    def __init__(self, cfg: DistConfig, weights: dict[str, np.ndarray], comm):
        self.names = sorted(weights)
        self.dl = DiLoCo([weights[n] for n in self.names], inner_steps=cfg.inner_steps, outer_lr=cfg.outer_lr,
                         outer_momentum=cfg.outer_momentum, wire=cfg.outer_wire, fragments=cfg.fragments)
        self.overlap: OverlappedSync | None = None
        if cfg.overlap_steps:
            # The worker thread gets a communicator of its own: its messages never meet the loop's.
            comm = comm.Dup() if comm is not None else None
            self.overlap = OverlappedSync(self.dl, allreduce_from_comm(comm), allgather_from_comm(comm),
                                          delay=cfg.overlap_steps, alpha=cfg.overlap_alpha)
        self.allreduce, self.allgather = allreduce_from_comm(comm), allgather_from_comm(comm)

    # -- per step ---------------------------------------------------------------------
    def after_step(self, engine, samples: int, last: bool) -> list[OuterStats]:
        """Count one inner step of `samples` samples and sync what is due. On the last step
        of the run every fragment not yet synced this round syncs too, in-flight ones land,
        and every rank takes the anchors: the run ends on the one model all ranks agree on."""
        due = self.dl.advance(samples)
        if last and self.dl.round_steps:
            due = list(range(self.dl.cursor, self.dl.fragments))
        if self.overlap is None:
            stats = self._blocking(engine, due)
        else:
            self.overlap.step()
            weights = engine.get_weights() if due else None
            for k in due:
                self.overlap.submit(k, self._fragment(weights, k))
            stats = self._land(engine, drain=last)
        if last:  # what is evaluated, saved and exported is the model the ranks agree on
            engine.set_weights(self.anchors())
        return stats

    def drain(self, engine) -> list[OuterStats]:
        """Land every sync in flight (before a checkpoint: its state must be whole)."""
        return self._land(engine, drain=True) if self.overlap is not None else []

    def _blocking(self, engine, due: list[int]) -> list[OuterStats]:
        if not due:
            return []
        weights, stats = engine.get_weights(), []
        for k in due:
            new = self.dl.outer_step(k, self._fragment(weights, k), self.allreduce, self.allgather)
            self._put(weights, k, new)
            stats.append(self.dl.last)
        engine.set_weights(weights)
        return stats

    def _land(self, engine, drain: bool) -> list[OuterStats]:
        current: dict[str, np.ndarray] = {}

        def fetch(idx: list[int]) -> list[np.ndarray]:
            if not current:
                current.update(engine.get_weights())
            return [current[self.names[i]] for i in idx]

        landed = self.overlap.ready(fetch, drain=drain)
        if not landed:
            return []
        weights = current or engine.get_weights()
        for k, new, _ in landed:
            self._put(weights, k, new)
        engine.set_weights(weights)
        return [s for _, _, s in landed]

    def _fragment(self, weights: dict[str, np.ndarray], k: int) -> list[np.ndarray]:
        return [weights[self.names[i]] for i in self.dl.fragment_params(k)]

    def _put(self, weights: dict[str, np.ndarray], k: int, new: list[np.ndarray]) -> None:
        for i, w in zip(self.dl.fragment_params(k), new, strict=True):
            weights[self.names[i]] = np.asarray(w, np.float32).reshape(weights[self.names[i]].shape)

    # -- checkpoints ------------------------------------------------------------------
    def anchors(self) -> dict[str, np.ndarray]:
        """The model every rank agrees on (at the last sync of each fragment): what a
        checkpoint calls the model's weights."""
        return dict(zip(self.names, self.dl.anchor_weights(), strict=True))

    def shared_state(self) -> dict[str, np.ndarray]:
        """Outer momentum and cursor, for rank 0's checkpoint (anchors travel as its weights)."""
        return {_OUTER + k: v for k, v in self.dl.state_dict().items()
                if k.startswith("global.") and not k.startswith("global.anchor.")}

    def save_rank_state(self, root: Path, info: rank_state.RankStateInfo, engine, keep: int) -> Path:
        opt, _ = engine.get_optimizer_state()
        own = {k: v for k, v in self.dl.state_dict().items() if k.startswith("rank.")}
        arrays = {**{f"weights.{k}": v for k, v in engine.get_weights().items()}, **opt, **own}
        return rank_state.save(root, info, arrays, keep)

    def restore(self, shared: dict[str, np.ndarray], own: dict[str, np.ndarray] | None, engine,
                optimizer_step: int) -> None:
        """After the loop made the engine hold the checkpoint's weights (the anchors) on every
        rank: take the shared state, and with `own` (this rank's file; every rank must have
        one) its local weights, moments and round position. Without it the round restarts
        from the anchors: local progress since the last sync is dropped."""
        state = {k[len(_OUTER):]: v for k, v in shared.items() if k.startswith(_OUTER)}
        weights = engine.get_weights()
        state.update({f"global.anchor.{i}": weights[n] for i, n in enumerate(self.names)})
        if not state.keys() & {"global.cursor"}:  # a DDP checkpoint: start the outer loop from its weights
            state["global.cursor"] = np.array([0, self.dl.fragments], np.int64)
        if own is not None:
            state.update({k: v for k, v in own.items() if k.startswith("rank.")})
        self.dl.load_state_dict(state, rank_state=own is not None)
        if own is not None:
            engine.set_weights({k[len("weights."):]: v for k, v in own.items() if k.startswith("weights.")})
            engine.set_optimizer_state({k: v for k, v in own.items() if k[:2] in ("m.", "v.")}, optimizer_step)

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()


def describe(cfg: DistConfig) -> str:
    lag = f", overlapped {cfg.overlap_steps} steps" if cfg.overlap_steps else ""
    return (f"DiLoCo: {cfg.inner_steps} inner steps, outer lr {cfg.outer_lr} Nesterov {cfg.outer_momentum}, "
            f"wire {cfg.outer_wire}, {cfg.fragments} fragment(s){lag}")
