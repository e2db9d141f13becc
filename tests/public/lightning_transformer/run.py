"""Test harness (ours, not Lightning's) around the vendored `transformer.py` scripts.

    python run.py [--no-dropout] SCRIPT:OUT [SCRIPT:OUT ...]    # in a folder holding data/wikitext-2.txt

Several scripts run one after the other in this one process (each starts with its own
`seed_everything(42)`), which saves a start of torch and Lightning per script.

- Names `lightning` / `lightning.pytorch` / `lightning.fabric` as the installed
  `pytorch_lightning` / `lightning_fabric` (the `lightning` meta-package is the same code under
  those names; only pytorch-lightning is installed here), so the script runs as published.
- Adds one callback to every Trainer: per training step, the `train_loss` the progress bar
  shows and this rank's batch size; at the end of `fit`, rank 0 writes OUT.npz (the weights) and
  every rank OUT-rankR.json (those numbers).
- `--no-dropout`: the demo Transformer's dropout 0 (a dropout mask drawn on each rank is not
  the one process's mask), for the ranks-against-one-process comparison.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import types

import lightning_fabric
import numpy as np
import pytorch_lightning as pl
import pytorch_lightning.demos  # noqa: F401 - named below
import pytorch_lightning.demos.transformer as demo

no_dropout = "--no-dropout" in sys.argv[1:]
runs = [arg.split(":", 1) for arg in sys.argv[1:] if arg != "--no-dropout"]
out = ""

meta = types.ModuleType("lightning")
meta.__path__ = []
for name in ("LightningModule", "Trainer", "seed_everything", "Callback", "LightningDataModule"):
    setattr(meta, name, getattr(pl, name))
meta.pytorch, meta.fabric = pl, lightning_fabric
sys.modules["lightning"] = meta
for real, alias in (("pytorch_lightning", "lightning.pytorch"), ("lightning_fabric", "lightning.fabric")):
    for key, module in list(sys.modules.items()):
        if key == real or key.startswith(real + "."):
            sys.modules[alias + key[len(real):]] = module

if no_dropout:
    _init = demo.Transformer.__init__
    demo.Transformer.__init__ = lambda self, *a, **k: _init(self, *a, **{**k, "dropout": 0.0})


class Record(pl.Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = trainer.progress_bar_metrics.get("train_loss")
        self.steps.append({"step": trainer.global_step, "epoch": trainer.current_epoch, "batch": len(batch[0]),
                           "progress_bar_loss": None if loss is None else float(loss)})

    def on_train_end(self, trainer, module):
        rank = trainer.global_rank
        with open(f"{out}-rank{rank}.json", "w") as f:
            json.dump({"steps": self.steps, "world_size": trainer.world_size,
                       "batches_per_epoch": trainer.num_training_batches}, f)
        if trainer.is_global_zero:
            np.savez(f"{out}.npz", **{k: v.detach().cpu().numpy() for k, v in module.state_dict().items()})


_trainer_init = pl.Trainer.__init__


@functools.wraps(_trainer_init)
def _with_record(self, *args, **kwargs):
    kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), Record()]
    _trainer_init(self, *args, **kwargs)


pl.Trainer.__init__ = _with_record
os.environ.setdefault("PL_TRAINER_MAX_STEPS", "5")
for script, out in runs:  # noqa: B007 - `out`: where Record (above) writes
    runpy.run_path(script, run_name="__main__")
