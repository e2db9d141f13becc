"""A LightningModule trained by a plain Lightning Trainer, on mlxdist (the lines marked md).

    python lightning_script.py OUT [--config C] [--steps N] [--accumulate K] [--count tokens]
                                   [--no-strategy] [--root DIR]

Writes OUT (rank 0: the final weights and the mean loss over all data), prints each rank's view
of the job and the seconds `fit` took.
"""

import argparse
import json
import sys
import time

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--config")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--clip", type=float, default=0.0)
p.add_argument("--count", default="samples", choices=["samples", "weights"])
p.add_argument("--no-strategy", action="store_true")
p.add_argument("--root", default=".")
args = p.parse_args()

strategy = "auto"
if not args.no_strategy:
    from mlxdist.lightning import MLXDistStrategy                                    # md

    strategy = MLXDistStrategy(config=args.config)                                   # md
rank = 0 if args.no_strategy else strategy.global_rank
torch.manual_seed(1000 + rank)  # a different init per rank: the strategy starts all on rank 0's


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y, w = batch
        if args.count == "weights":  # a mean over units of its own (e.g. label tokens): say how many
            per = F.cross_entropy(self.net(x), y, reduction="none") * w
            loss = per.sum() / w.sum()
            self.log("train_loss", loss, sync_dist=True)
            return {"loss": loss, "count": int(w.sum())}
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


rng = np.random.default_rng(0)
x = torch.tensor(rng.normal(size=(256, 8)), dtype=torch.float32)
y = torch.tensor(rng.integers(0, 3, size=256))
w = torch.tensor(rng.integers(1, 4, size=256))
loader = DataLoader(TensorDataset(x, y, w), batch_size=args.global_batch)   # the cluster's batch

model = Net()
trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps,
                     accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
                     default_root_dir=f"{args.root}/rank{rank}", logger=pl.loggers.CSVLogger(f"{args.root}/rank{rank}"),
                     enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
t0 = time.perf_counter()
trainer.fit(model, loader)
seconds = time.perf_counter() - t0

with torch.no_grad():
    loss = float(F.cross_entropy(model.net(x), y))
loss = trainer.strategy.reduce(torch.tensor(loss), reduce_op="mean").item()
if trainer.is_global_zero:
    np.savez(args.out, loss=loss, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
view = {"rank": rank, "global_rank": trainer.global_rank, "world_size": trainer.world_size,
        "is_global_zero": trainer.is_global_zero, "steps": trainer.global_step,
        "batch": len(next(iter(trainer.train_dataloader))[0]), "seconds": round(seconds, 3),
        "gathered": trainer.strategy.all_gather(torch.tensor(float(rank))).tolist(),
        "stop": trainer.strategy.reduce_boolean_decision(rank == 1, all=False)}
print("VIEW " + json.dumps(view), file=sys.stderr)
