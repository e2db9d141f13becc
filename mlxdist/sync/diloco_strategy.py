"""`dist.mode=diloco` as a sync strategy: local inner steps, DiLoCo's outer step.

Each rank steps on its own gradients (no per-step collective); after each step
`after_step` syncs the fragments DiLoCo says are due, blocking or on a worker thread
(`dist.overlap_steps`), and writes the new weights back into the engine. Ranks meet for
control numbers every `control.balance_interval` steps and at the end: between meetings
no rank waits for a slower one, and a stop request takes at most that many steps. The
drift check does not apply: ranks differ between outer syncs by design.

The outer state is split the way it lives: what every rank shares (outer momentum,
fragment cursor; the anchors are the checkpoint's model weights) goes into the run's
checkpoint, what is each rank's own (local weights, AdamW moments, wire residuals, round
position) into a per-rank file (`state/rank_state.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import Config, DistConfig
from ..control.plan import Decision
from ..dist.world import World
from ..engine.base import Engine, StepStats, local_step
from ..state import rank_state
from .comm import allgather_from_comm, allreduce_from_comm
from .diloco import DiLoCo, OuterStats
from .overlap import OverlappedSync


class DiLoCoStrategy:
    drift_check = False

    def __init__(self, cfg: Config, world: World, engine: Engine, hosts: list[str]):
        self.world, self.hosts, self.dist = world, hosts, cfg.dist
        self.meet_every, self.steps = cfg.control.balance_interval, cfg.train.steps
        self.outer = OuterSync(cfg.dist, engine.get_weights(), world.comm)
        self._rollback_wanted = False

    def describe(self) -> str:
        return describe(self.dist)

    def step(self, engine: Engine, lr: float) -> StepStats:
        return local_step(engine, lr)

    def before_last_backward(self, engine: Engine) -> None:
        pass  # inner steps exchange nothing

    def meets(self, step: int) -> bool:
        return step % self.meet_every == 0 or step >= self.steps

    def agree_on_rollback(self, wanted: bool, step: int) -> bool:
        """A rank's wish (its own loss blew up) waits for the next meeting, where any rank's
        wish rolls all of them back."""
        self._rollback_wanted = self._rollback_wanted or wanted
        if not self.meets(step):
            return False
        agreed = any(self.world.allgather(self._rollback_wanted))
        self._rollback_wanted = False
        return agreed

    def after_step(self, engine: Engine, step: int, samples: int, last: bool) -> list[Decision]:
        return [self._event(step, s) for s in self.outer.after_step(engine, samples, last)]

    def before_save(self, engine: Engine, step: int) -> list[Decision]:
        return [self._event(step, s) for s in self.outer.drain(engine)]

    def model_weights(self, engine: Engine) -> dict[str, np.ndarray]:
        return self.outer.anchors()

    def state_dict(self, engine: Engine) -> dict[str, np.ndarray]:
        return self.outer.shared_state()

    def save_rank_state(self, root: Path, step: int, engine: Engine, keep: int) -> None:
        opt_step = engine.get_optimizer_state()[1]
        w = self.world
        self.outer.save_rank_state(root, rank_state.RankStateInfo(step, w.rank, w.size, self.hosts, opt_step),
                                   engine, keep)

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        """Exact when every rank finds its own file of that step from this same cluster;
        otherwise (fewer hosts, a file lost with its host) from the shared state alone."""
        if shared is None:  # a fresh run: the round starts from the weights every rank now holds
            self.outer.restore({}, None, engine, optimizer_step)
            return []
        w = self.world
        try:
            own, own_step = rank_state.load(root, step, w.rank, w.size, self.hosts)
            why = ""
        except rank_state.RankStateMissing as e:
            own, own_step, why = None, optimizer_step, str(e)
        reasons = [r for r in w.allgather(why) if r]
        events = []
        if reasons:
            own = None
            events.append(Decision("diloco_resume", f"diloco: resuming from the shared outer state only "
                                   f"({reasons[0]}); each rank restarts its round from the last synced weights"))
        self.outer.restore(shared, own, engine, own_step if own is not None else optimizer_step)
        return events

    def close(self) -> None:
        self.outer.close()

    def _event(self, step: int, s: OuterStats) -> Decision:
        d = self.dist
        return Decision(
            "outer_sync", f"diloco: step {step}: fragment {s.fragment + 1}/{d.fragments} synced, "
            f"{s.bytes / 1e6:.2f} MB in {s.seconds:.2f}s; pseudo-gradient norm {s.pseudo_grad_norm:.4g}; "
            f"{s.inner_steps} inner steps, {s.samples} of {s.total_samples} samples here",
            dict(step=step, fragment=s.fragment, seconds=s.seconds, bytes=s.bytes,
                 pseudo_grad_norm=s.pseudo_grad_norm, inner_steps=s.inner_steps, samples=s.samples,
                 total_samples=s.total_samples))


class OuterSync:
    """Between the engine's weights (by name) and DiLoCo's flat parameter list."""

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
        """Outer momentum and cursor, for the run's checkpoint (anchors travel as its weights)."""
        return {k: v for k, v in self.dl.state_dict().items()
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
        state = dict(shared)
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
