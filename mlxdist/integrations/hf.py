"""A Hugging Face `Trainer` across Macs: change one import, start the script with mpirun.

    from mlxdist.hf import Trainer                     # was: from transformers import Trainer
    args = TrainingArguments("out", per_device_train_batch_size=8, ...)   # the cluster's batch
    Trainer(model=model, args=args, train_dataset=data).train()

    MLXDIST_CONFIG=cluster.yaml mpirun -np 2 -x MLXDIST_CONFIG python train.py

Every rank runs the whole script; transformers and accelerate each see one process (no
torch.distributed), on the device they pick (mps on a Mac). mlxdist does the rest:

- `per_device_train_batch_size` is the batch of the whole cluster, what the same script
  trains with as one process; the Trainer's own DataLoader makes those batches (its sampler:
  the seeded shuffle or `group_by_length`, `dataloader_drop_last`, the last partial batch), and
  each rank takes its share of every one (`nodes:` batch sizes of the config in
  `MLXDIST_CONFIG` or `mlxdist_config=`, equal shares without one), so 3 + 5 samples are the
  one process's 8 and one rank is plain `transformers.Trainer`. After the Trainer is built,
  `args.per_device_train_batch_size` is this rank's share (the Trainer's log says so) and every
  rank prints one line with its rank, the ranks and its share.
- Gradients are summed over ranks weighed by what the Trainer's loss averages over: the
  label tokens of the step when the loss is normalised by `num_items_in_batch` (causal LMs),
  else the samples. This happens after the step's last backward, so gradient clipping
  (`max_grad_norm`) and the logged grad norm see the cluster's gradients; the logged loss is
  the cluster's too.
- The optimizer the Trainer creates is wrapped (`mlxdist.torch.DistributedOptimizer`); the
  tensors some rank has otherwise than rank 0 (a LoRA's random init; not the pretrained base
  every rank loaded) are sent from rank 0 before the first step.
- Only rank 0 logs, reports (`report_to`) and writes checkpoints; `save_total_limit` and
  `resume_from_checkpoint` work as usual (a checkpoint folder that another rank lacks, or holds
  from another run, is sent there from rank 0).
- Ctrl-C or SIGTERM on any rank stops every rank after the same step, with a checkpoint when
  `save_strategy` is not "no".

Not here: the gradient sum starts after the step's last backward rather than during it;
`args.world_size`, `process_index` and `parallel_mode` stay transformers' one-process values
(1, 0, not_parallel: where they say more, transformers calls torch.distributed; the line each
rank prints says the truth); evaluation runs whole on every rank (the same numbers; rank 0 logs
them); at the end rank 0 holds the model to keep (`load_best_model_at_end` loads it there only). `use_cpu=True` under
mpirun makes accelerate start torch.distributed before mlxdist is asked: leave the device to
the Trainer.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from .. import torch as md
from ..config import ConfigError
from ..markers import write_line
from ..yourloop import session as _session
from ._batches import shard

_NAME = "mlxdist.hf"
_CHUNK = 1 << 28  # bytes of a checkpoint file per broadcast


class _NotRankZero:
    """Mixed into a rank's TrainingArguments on every rank but 0: it neither writes nor logs."""

    @property
    def should_save(self) -> bool:
        return False

    @property
    def should_log(self) -> bool:
        return False


def _quiet_args(args: Any) -> None:
    if args is not None and not isinstance(args, _NotRankZero):
        args.__class__ = type(type(args).__name__, (_NotRankZero, type(args)), {})


class _StopTogether(transformers.TrainerCallback):
    """Ctrl-C / SIGTERM on any rank (mlxdist holds those signals): every rank stops after the
    same step, saving a checkpoint to resume from."""

    def on_step_end(self, args, state, control, **kwargs):
        if md.should_stop():
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no"
        return control


class DistributedTrainer:
    """Mix into a `transformers.Trainer` subclass (`class T(DistributedTrainer, SFTTrainer)`),
    or use `mlxdist.hf.Trainer`. Takes `mlxdist_config=` (else `$MLXDIST_CONFIG`)."""

    def __init__(self, model=None, args=None, *rest, mlxdist_config: str | os.PathLike | None = None, **kwargs):
        md.init(mlxdist_config or os.environ.get("MLXDIST_CONFIG") or None)
        rank = _session.current(_NAME).rank
        if rank != 0:
            _quiet_args(args)
        super().__init__(model, args, *rest, **kwargs)
        if rank != 0:
            _quiet_args(self.args)  # the default arguments the Trainer made itself
        if self.args.world_size > 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ConfigError(f"{_NAME}: accelerate started torch.distributed ({self.args.world_size} processes; "
                              "`use_cpu=True` or ACCELERATE_USE_CPU under mpirun does that): mlxdist syncs the "
                              "ranks itself, so leave the device to the Trainer")
        if self.args.auto_find_batch_size:
            raise ConfigError(f"{_NAME}: auto_find_batch_size would change the cluster's batch on one rank only; "
                              "set per_device_train_batch_size (the cluster's batch, split by `nodes:`)")
        self._md_share_batch()
        self.add_callback(_StopTogether())
        self._md_opt = None
        self._md_samples, self._md_loss = 0, 0.0

    # ---- who writes ----

    def is_world_process_zero(self) -> bool:
        return _session.current(_NAME).rank == 0 and super().is_world_process_zero()

    def is_local_process_zero(self) -> bool:  # one Mac a rank: "local" printing would repeat on each
        return self.is_world_process_zero()

    def _save_checkpoint(self, model, trial) -> None:
        if _session.current(_NAME).rank == 0:
            super()._save_checkpoint(model, trial)

    # ---- data: this rank's share of every global batch ----

    def _md_share_batch(self) -> None:
        """The cluster's batch stays the Trainer's (its DataLoader makes it); the arguments say
        this rank's share of it, and one line on each rank says who it is."""
        s = _session.current(_NAME)
        cluster = getattr(self.args, "_md_cluster_batch", None) or self._train_batch_size
        share = s.shares(cluster)[s.rank]
        self._train_batch_size = self.args._md_cluster_batch = cluster
        self.args.per_device_train_batch_size = share
        write_line(f"{_NAME}: rank {s.rank} of {s.size} ({s.world.host}): {share} of each batch of {cluster} "
                   f"(per_device_train_batch_size={share}); transformers sees one process (world_size 1, "
                   "process_index 0): mlxdist joins the ranks, not torch.distributed")

    def get_train_dataloader(self):
        data = self.train_dataset
        if isinstance(data, torch.utils.data.IterableDataset) or (data is not None and not hasattr(data, "__len__")):
            raise ConfigError(f"{_NAME}: the train_dataset has no length; the ranks split a sized dataset "
                              "(e.g. a datasets.Dataset, not streaming=True)")
        return shard(super().get_train_dataloader(), _NAME)

    # ---- gradients: summed over ranks after the step's last backward ----

    def create_optimizer(self, model=None):
        opt = super().create_optimizer() if model is None else super().create_optimizer(model)
        if not isinstance(opt, md.DistributedOptimizer):
            self.optimizer = md.DistributedOptimizer(opt, self.model)
            _start_from_rank_0(self.model, self.optimizer)
        self._md_opt = self.optimizer
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        samples = _batch_size(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._md_samples += samples
        self._md_loss += float(loss)
        if not self.accelerator.gradient_state.sync_gradients:
            return loss
        scaled = (self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None
                  else (self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                  or self.compute_loss_func is not None)
        count = int(num_items_in_batch) if scaled and num_items_in_batch is not None else self._md_samples
        weighted, units = md.all_reduce(np.array([self._md_loss * count, count], dtype=np.float64))
        self._md_opt.synchronize(count)  # before the Trainer clips: the clip sees the cluster's gradients
        cluster_loss = weighted / units if units > 0 else 0.0
        # The Trainer adds up the returned losses of a step: make that sum the cluster's loss.
        out = cluster_loss - (self._md_loss - float(loss))
        self._md_samples, self._md_loss = 0, 0.0
        return torch.tensor(out, dtype=loss.dtype, device=loss.device)

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps

    # ---- resume: every rank reads rank 0's checkpoint ----

    def train(self, resume_from_checkpoint=None, *rest, **kwargs):
        s = _session.current(_NAME)
        if resume_from_checkpoint is True:
            last = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir) if s.rank == 0 else None
            resume_from_checkpoint = md.broadcast_object(last)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            _share_folder(s, str(resume_from_checkpoint))
        return super().train(resume_from_checkpoint or None, *rest, **kwargs)


class Trainer(DistributedTrainer, transformers.Trainer):
    """`transformers.Trainer` across the ranks mpirun started (see the module's docstring)."""


def _batch_size(inputs: Any) -> int:
    for value in (inputs.values() if isinstance(inputs, dict) else [inputs]):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ConfigError(f"{_NAME}: a batch without a tensor to count its samples in ({type(inputs).__name__})")


def _fingerprint(t: torch.Tensor) -> list[float]:
    f = t.detach().float().flatten()
    return torch.stack([f.sum(), f.abs().sum(), f[::7].sum()]).tolist()


def _start_from_rank_0(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """`mlxdist.torch.broadcast(model, optimizer)` that sends only the tensors some rank has
    otherwise (by a fingerprint of each): a LoRA's pretrained base, the same on every rank, stays
    put rather than going over the network, and through rank 0's memory, at every start."""
    s = _session.current(_NAME)
    state = model.state_dict()
    _session.check_same_shapes(s, {n: tuple(t.shape) for n, t in state.items()}, f"{_NAME}.Trainer")
    if s.size == 1:
        return
    theirs = s.world.allgather({n: _fingerprint(t) for n, t in state.items()})
    differ = [n for n in state if any(p[n] != theirs[0][n] for p in theirs[1:])]
    with torch.no_grad():
        for name in differ:
            t = state[name]
            arrays = s.world.broadcast_arrays({name: md.to_numpy(t)} if s.rank == 0 else {}, 0)
            t.copy_(torch.from_numpy(np.array(arrays[name])).to(t.dtype))
    if optimizer.state:  # a fresh optimizer has none
        optimizer.load_state_dict(s.world.bcast(md.to_cpu(optimizer.state_dict()) if s.rank == 0 else None, 0))
    if differ and s.rank == 0:
        write_line(f"{_NAME}: {len(differ)} of {len(state)} tensors differed between ranks; every rank has "
                   "rank 0's now")


def _folder_signature(root: Path) -> tuple | None:
    """A checkpoint folder's files, their sizes and its trainer state (whose log history tells
    one run's checkpoint from another's); None where there is no folder."""
    if not root.is_dir():
        return None
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    state = root / "trainer_state.json"
    digest = hashlib.sha256(state.read_bytes()).hexdigest() if state.is_file() else ""
    return tuple(files), tuple((root / f).stat().st_size for f in files), digest


def _share_folder(s: _session.Session, path: str) -> None:
    """`path` (a checkpoint folder) the same on every rank: rank 0's is sent to the ranks that
    lack it, or hold another (a Mac without the disk rank 0 wrote to)."""
    root = Path(path)
    sigs = s.world.allgather(_folder_signature(root))
    if sigs[0] is None:
        raise ConfigError(f"{_NAME}: resume_from_checkpoint {path} is not a folder on rank 0")
    receivers = [r for r, sig in enumerate(sigs) if sig != sigs[0]]
    if not receivers:
        return
    if s.rank == 0:
        write_line(f"{_NAME}: sending checkpoint {path} to rank(s) {', '.join(map(str, receivers))}")
    receive = s.rank in receivers
    files = sigs[0][0]
    if receive and sigs[s.rank] is not None:  # another run's checkpoint here: rank 0's replaces it
        for rel in set(sigs[s.rank][0]) - set(files):
            (root / rel).unlink()
    for rel, size in zip(files, sigs[0][1], strict=True):
        out = src = None
        try:
            if receive:
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                out = open(root / rel, "wb")  # noqa: SIM115 - written chunk by chunk below
            if s.rank == 0:
                src = open(root / rel, "rb")  # noqa: SIM115
            for _ in range(max(1, -(-size // _CHUNK))):
                chunk = s.world.bcast(src.read(_CHUNK) if src is not None else None, 0)
                if out is not None:
                    out.write(chunk)
        finally:
            for f in (out, src):
                if f is not None:
                    f.close()


__all__ = ["DistributedTrainer", "Trainer"]
