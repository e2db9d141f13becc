"""A Lightning `Trainer` across Macs: one strategy, started with mpirun.

    from mlxdist.lightning import MLXDistStrategy
    trainer = L.Trainer(strategy=MLXDistStrategy("cluster.yaml"), accelerator="mps", devices=1)
    trainer.fit(model, DataLoader(data, batch_size=64))      # 64: the batch of the whole cluster

    mpirun -np 2 -hostfile hosts python train.py              # or: launch/mlxrun --hostfile hosts -- train.py

Every rank runs the whole script, and Lightning sees one process with one device per rank
(mps on a Mac; no torch.distributed, which has no MPS backend). The strategy adds the rest:

- `global_rank`, `world_size`, `is_global_zero` from mpirun, so only rank 0 logs, prints and
  writes checkpoints (a checkpoint only rank 0 has resumes every rank: `ckpt_path=`).
- Rank 0's weights and optimizer state on every rank before the first step (`md.broadcast`).
- The training DataLoader is the user's own, kept whole: its sampler (`shuffle`, its generator
  and seed, a custom sampler or batch sampler) and `drop_last` make the cluster's batches, and
  each rank takes its share of every batch (`nodes:` batch sizes of the config, equal shares
  without one), the last partial batch included: on one process the run is plain Lightning's.
  A batch with fewer samples than the ranks is skipped by every rank (one line at start says
  so). Validation, test and predict loaders run whole on every rank (the same numbers everywhere).
- A loss logged in `training_step` (`self.log`, a mean) is the cluster's, each rank's value
  weighed by its units, on the progress bar and in the loggers, with or without `sync_dist`.
- Gradients are summed over ranks and divided by the cluster's units after the step's last
  backward, before gradient clipping and `on_before_optimizer_step`, so 3 + 5 samples train as
  one process with 8. A unit is a sample: `training_step` returns the mean loss over its batch
  (torch's default), weighed by the batch's size. Other units: return
  `{"loss": loss, "count": n}` (a mean over n units, e.g. label tokens); a summed loss:
  `MLXDistStrategy(reduction="sum")` with the same "count". Gradient accumulation
  (`accumulate_grad_batches`) is exact too; buckets go out while the last backward runs.
- `self.log(..., sync_dist=True)`, `all_gather`, `broadcast`, `barrier` and
  `reduce_boolean_decision` (early stopping) over mlxdist's collectives.
- Ctrl-C or SIGTERM on any rank stops every rank after the same step.

Manual optimization (`self.manual_backward(loss)`, `opt.step()`): one backward per step of
each optimizer, weighed by the batch's size or by `self.trainer.strategy.count = n` set before
`opt.step()`. Works with `lightning` (`lightning.pytorch`) or `pytorch_lightning`: the one the
script imported, else whichever is installed.
"""

from __future__ import annotations

import builtins
import os
import sys
from typing import Any

import torch

from .. import torch as md
from ._batches import RankBatches, shard, torch_loader

_NAME = "mlxdist.lightning"
_CLASSES: dict[str, type] = {}


def _lightning_package() -> str:
    """`lightning.pytorch` or `pytorch_lightning`, whose Trainer the script uses: the one it
    imported (their classes differ: a strategy of one is no strategy to the other)."""
    if "lightning.pytorch" in sys.modules:
        return "lightning.pytorch"
    if "pytorch_lightning" in sys.modules:
        return "pytorch_lightning"
    try:
        import lightning.pytorch  # noqa: F401

        return "lightning.pytorch"
    except ImportError:
        pass
    try:
        import pytorch_lightning  # noqa: F401

        return "pytorch_lightning"
    except ImportError as e:
        raise ImportError(f"{_NAME} needs Lightning: pip install 'mlxdist[lightning]' (pytorch-lightning)") from e


def strategy_class(package: str | None = None) -> type:
    """The strategy class for `package` ('lightning.pytorch' or 'pytorch_lightning'; None: the
    one in use, as `MLXDistStrategy`)."""
    package = package or _lightning_package()
    if package not in _CLASSES:
        _CLASSES[package] = _build(package)
    return _CLASSES[package]


def __getattr__(name: str) -> Any:
    if name == "MLXDistStrategy":
        return strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _op(reduce_op: Any) -> str:
    """Lightning's reduce_op (None, a string, torch.distributed.ReduceOp) as md.all_reduce's."""
    if reduce_op is None:
        return "mean"
    name = str(getattr(reduce_op, "name", reduce_op)).lower().rsplit(".", 1)[-1]
    ops = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
    if name not in ops:
        raise ValueError(f"{_NAME}: reduce_op {reduce_op!r} is not one of mean, sum, max, min")
    return ops[name]


class _Params(torch.nn.Module):
    """One optimizer's parameters, in the module's order (several optimizers: each sums its own)."""

    def __init__(self, module: torch.nn.Module, params: set[int]):
        super().__init__()
        self.ps = torch.nn.ParameterList([p for p in module.parameters() if id(p) in params])


def _build(package: str) -> type:  # noqa: C901 - one class, built for the Lightning in use
    import importlib

    pl = importlib.import_module(package)
    fabric = "lightning.fabric" if package == "lightning.pytorch" else "lightning_fabric"
    SingleDeviceStrategy = importlib.import_module(f"{package}.strategies").SingleDeviceStrategy  # noqa: N806
    RunningStage = importlib.import_module(f"{package}.trainer.states").RunningStage  # noqa: N806
    pl_data = importlib.import_module(f"{package}.utilities.data")
    fabric_rank_zero = importlib.import_module(f"{fabric}.utilities.rank_zero")
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
    from torch.utils.data import DataLoader

    class _StopTogether(pl.Callback):
        """Ctrl-C / SIGTERM on any rank (mlxdist holds those signals): every rank stops after
        the same step."""

        def on_train_batch_end(self, trainer, *args: Any, **kwargs: Any) -> None:
            if md.should_stop():
                trainer.should_stop = True

    class MLXDistStrategy(SingleDeviceStrategy):
        """Lightning on mlxdist: one process and device per rank, started by mpirun.

        `config`: a YAML whose `nodes:` give each Mac's share of a global batch (else
        `$MLXDIST_CONFIG`, else equal shares). `reduction`: how `training_step`'s loss covers
        its units, 'mean' (weighed by its count) or 'sum'. The training order is the
        DataLoader's own (`seed` is refused: seed its sampler, or `seed_everything`). `device`:
        this rank's device (default: the Trainer's accelerator: mps, cuda:LOCAL_RANK, cpu)."""

        strategy_name = "mlxdist"

        def __init__(self, config: Any = None, reduction: str = "mean", seed: int | None = None,
                     device: str | torch.device | None = None, bucket_mb: float = 25.0,
                     wire_dtype: str = "float32", overlap: bool = True, **kwargs: Any):
            super().__init__(device=device or "cpu", **kwargs)
            if reduction not in ("mean", "sum"):
                raise ValueError(f"{_NAME}: reduction '{reduction}' is not 'mean' or 'sum'")
            if seed is not None:
                raise ValueError(f"{_NAME}: seed={seed} is not used: the training order is your DataLoader's own; "
                                 "seed its sampler (a torch.Generator) or call seed_everything")
            info = md.init(config if config is not None else os.environ.get("MLXDIST_CONFIG"), device="cpu")
            self._device_given = device is not None
            self.reduction = reduction
            self._deferring = False  # in training_step: a logged mean waits for _cluster_logs
            self._bucket_mb, self._wire_dtype, self._overlap = bucket_mb, wire_dtype, overlap
            self.global_rank, self.local_rank, self.world_size = info.rank, info.local_rank, info.size
            self.node_rank = 0
            # Lightning reads the rank from RANK/SLURM_PROCID, which mpirun does not set.
            fabric_rank_zero.rank_zero_only.rank = utils_rank_zero_only.rank = info.rank
            self.count: int | None = None  # this step's units: the batch's size unless set
            self._dists: dict[int, Any] = {}

        # -- where and who -------------------------------------------------------------------

        @property
        def root_device(self) -> torch.device:
            if self._device_given or self.accelerator is None:
                return self._root_device
            kind = type(self.accelerator).__name__
            if kind.startswith("MPS"):
                return torch.device("mps", 0)
            if kind.startswith("CUDA"):
                return torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
            return torch.device("cpu")

        @property
        def is_global_zero(self) -> bool:
            return self.global_rank == 0

        @property
        def is_distributed(self) -> bool:  # Lightning passes `sync_dist=True` on only then
            return self.world_size > 1

        def setup_environment(self) -> None:
            super().setup_environment()
            md.set_device(self.root_device)

        def setup(self, trainer: Any) -> None:
            # The training sampler is ours (process_dataloader); Lightning's would be torch's.
            trainer._accelerator_connector.use_distributed_sampler = False
            super().setup(trainer)
            module = self.lightning_module
            self._dists = {}
            for opt in self.optimizers:
                params = {id(p) for group in opt.param_groups for p in group["params"]}
                scope = module if len(self.optimizers) == 1 else _Params(module, params)
                self._dists[id(opt)] = md.DistributedOptimizer(opt, scope, self.reduction, self._bucket_mb,
                                                               self._wire_dtype, self._overlap)
            md.broadcast(module)
            if self.world_size > 1:  # rank 0's optimizer state (a resumed run's is loaded after setup)
                for opt in self.optimizers:
                    opt.load_state_dict(md.broadcast_object(md.to_cpu(opt.state_dict()) if self.is_global_zero else None))
            if not any(isinstance(c, _StopTogether) for c in trainer.callbacks):
                trainer.callbacks.append(_StopTogether())

        # -- data ------------------------------------------------------------------------------

        def process_dataloader(self, dataloader: object) -> object:
            """The training DataLoader as the user made it, each batch split between the ranks."""
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            if (trainer is None or trainer.state.stage != RunningStage.TRAINING
                    or not isinstance(dataloader, DataLoader) or isinstance(dataloader.sampler, md.DistributedSampler)
                    or isinstance(torch_loader(dataloader).batch_sampler, RankBatches)):
                return dataloader
            if pl_data.has_iterable_dataset(dataloader):
                raise ValueError(f"{_NAME}: the training DataLoader has an IterableDataset, which cannot be split "
                                 "between ranks by samples; use a map-style dataset (len and [i])")
            loop = trainer.fit_loop.epoch_loop  # a run resumed mid-epoch goes on where it stopped
            done = loop.batch_progress.current.processed if loop.restarting else 0
            return shard(dataloader, _NAME, skip=done)

        # -- gradients -------------------------------------------------------------------------

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_start(batch, batch_idx)
            self.count = None
            self._batch_size = pl_data.extract_batch_size(batch)

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            results = self.lightning_module.trainer._results
            before = {k: id(m._forward_cache) for k, m in results.items()} if results is not None else {}
            self._deferring = self.world_size > 1
            try:
                out = super().training_step(*args, **kwargs)
            finally:
                self._deferring = False
            if isinstance(out, dict) and "count" in out:
                self.count = int(out["count"])
            if self.world_size > 1 and results is not None:
                self._cluster_logs(results, before)
            return out

        def _cluster_logs(self, results: Any, before: dict[str, int]) -> None:
            """The means `training_step` just logged, as the cluster's: each rank's value weighed
            by its units (what the progress bar and loggers show), not rank 0's own."""
            mine = {k: (float(m._forward_cache), float(self._units())) for k, m in results.items()
                    if m.is_tensor and m.meta.on_step and m.meta.is_mean_reduction and m._forward_cache is not None
                    and id(m._forward_cache) != before.get(k)}
            every = md.all_gather(mine)
            for key in mine:
                pairs = [r[key] for r in every if key in r]
                units = sum(w for _, w in pairs)
                value = (sum(v * w for v, w in pairs) / units if units > 0
                         else sum(v for v, _ in pairs) / len(pairs))
                m = results[key]
                m._forward_cache = torch.tensor(value, dtype=m._forward_cache.dtype, device=m._forward_cache.device)
                if not m.meta.on_epoch:
                    m.value = m._forward_cache

        def _dist(self, optimizer: Any) -> Any:
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
            if optimizer is None:
                return None
            dist = self._dists.get(id(optimizer))
            if dist is None:
                raise RuntimeError(f"{_NAME}: an optimizer Lightning did not create in setup "
                                   "(configure_optimizers) cannot be summed over ranks")
            return dist

        def _units(self) -> int:
            return self.count if self.count is not None else self._batch_size

        def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            module = self.lightning_module
            dist = self._dist(optimizer)
            if dist is None or not module.automatic_optimization:  # manual: weighed at opt.step()
                return super().backward(closure_loss, optimizer, *args, **kwargs)
            # Automatic: Lightning divided the loss by accumulate_grad_batches; the gradient
            # wanted is the sum over units, so each micro-batch is weighed by its own count.
            trainer = module.trainer
            count = self._units()
            if (self.world_size == 1 and trainer.accumulate_grad_batches == 1 and self.reduction == "mean"
                    and count > 0):
                # One rank, one micro-batch a step: the loss is the step's mean already. Weighed
                # by its units and divided back, the gradient would be the same number rounded
                # twice more (x20 then /20 is not exact in fp32); plain Lightning's own ops keep
                # a run on one process bit for bit plain Lightning's, whatever the CPU's kernels.
                out = super().backward(closure_loss, optimizer, *args, **kwargs)
                dist.add_count(1)  # a weight of 1: the division after the sum is by 1, exact
                return out
            scale = trainer.accumulate_grad_batches * (count if self.reduction == "mean" else 1)
            last = not trainer.fit_loop._should_accumulate()
            if last:  # send buckets while this backward runs
                dist.send_during_backward()
            out = super().backward(closure_loss * scale, optimizer, *args, **kwargs)
            dist.add_count(count)
            return out

        def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
            dist = self._dist(optimizer)
            module = self.lightning_module
            result = closure()  # training_step and backward (automatic); nothing (manual)
            if module.automatic_optimization:
                if result is None:
                    raise RuntimeError(f"{_NAME}: training_step returned None on rank {self.global_rank} (a skipped "
                                       "batch); the other ranks would wait for its gradients: return the loss with "
                                       "{'loss': loss, 'count': 0} instead")
            # own_step: the step is the optimizer's own, after clipping below, not dist.step()'s.
            count = None if module.automatic_optimization else self._units()
            total = dist.synchronize(count, own_step=True)
            if total == 0:
                optimizer.zero_grad(set_to_none=True)  # no unit anywhere: the update is skipped
            return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

        # -- collectives -----------------------------------------------------------------------

        def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
            if not isinstance(tensor, torch.Tensor) or self.world_size == 1:
                return tensor
            if self._deferring and _op(reduce_op) == "mean":  # weighed by units after training_step
                return tensor
            return md.all_reduce(tensor, _op(reduce_op))

        def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
            if sync_grads:
                raise NotImplementedError(f"{_NAME}: all_gather(sync_grads=True) is not supported")
            if not isinstance(tensor, torch.Tensor):
                tensor = torch.as_tensor(tensor)
            parts = md.all_gather(tensor.detach().cpu())
            return torch.stack(parts).to(tensor.device)

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return md.broadcast_object(obj, src) if self.world_size > 1 else obj

        def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
            if self.world_size > 1:
                md.all_gather(None)

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
            decisions = md.all_gather(bool(decision)) if self.world_size > 1 else [bool(decision)]
            return builtins.all(decisions) if all else any(decisions)

        # -- checkpoints -----------------------------------------------------------------------

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            """Every rank loads its own copy where every rank has the file; else rank 0's is sent."""
            if self.world_size == 1 or builtins.all(md.all_gather(os.path.exists(str(checkpoint_path)))):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            ckpt = super().load_checkpoint(checkpoint_path, weights_only=weights_only) if self.is_global_zero else None
            return md.broadcast_object(md.to_cpu(ckpt))

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            pass  # built per Lightning package; not a string name

    MLXDistStrategy.__module__ = __name__
    return MLXDistStrategy


__all__ = ["MLXDistStrategy", "strategy_class"]  # noqa: F822 - MLXDistStrategy: built on first use (__getattr__)
