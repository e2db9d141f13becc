"""A LightningModule trained by a plain Lightning Trainer, on mlxdist (the lines marked md).

    python lightning_script.py OUT [--config C] [--modes samples,tokens,plain] [--steps N] [--root DIR]

Per mode, rank 0 writes OUT-MODE.npz (the final weights and the mean loss over all data) and
ROOT/I-MODE/rank0/ (the CSV log and the checkpoint); every rank prints its view of the job and
the seconds `fit` took ("VIEW {json}").
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
p.add_argument("out", help="OUT-MODE.npz per mode")
p.add_argument("--config")
p.add_argument("--modes", default="samples",
               help="comma-separated: samples (a mean loss), resume (samples stopped after 2 steps and resumed "
                    "from rank 0's checkpoint), tokens (a mean over weighted units, 'count' "
                    "returned, 2 accumulated micro-batches, clipping), unseeded (samples, shuffled without a common "
                    "seed, a last batch of 1), plain (no strategy; timing only)")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--root", default=".")
args = p.parse_args()


class Net(pl.LightningModule):
    def __init__(self, tokens: bool):
        super().__init__()
        self.tokens = tokens
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y, w = batch
        if self.tokens:  # a mean over units of its own (as label tokens): say how many
            loss = (F.cross_entropy(self.net(x), y, reduction="none") * w).sum() / w.sum()
            self.log("train_loss", loss, sync_dist=True)
            return {"loss": loss, "count": int(w.sum())}                             # md
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

for i, mode in enumerate(args.modes.split(",")):
    strategy, rank = "auto", 0
    if mode != "plain":
        from mlxdist.lightning import MLXDistStrategy  # md

        strategy = MLXDistStrategy(config=args.config)                               # md
        rank = strategy.global_rank
    torch.manual_seed(1000 + rank)  # a different init per rank: the strategy starts all on rank 0's
    model = Net(tokens=mode == "tokens")
    loader = DataLoader(TensorDataset(x, y, w), batch_size=args.global_batch)   # the cluster's batch
    if mode == "unseeded":  # shuffled from each rank's own torch seed; 249 = 31 batches of 8 and one of 1
        loader = DataLoader(TensorDataset(x[:249], y[:249], w[:249]), batch_size=args.global_batch, shuffle=True)
    root = f"{args.root}/{i}-{mode}/rank{rank}"
    if mode == "resume":  # 2 steps and a checkpoint, then a fresh model resumes from it for 2 more
        ckpts = pl.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=2, save_top_k=-1)
        first = pl.Trainer(strategy=MLXDistStrategy(config=args.config), accelerator="cpu", devices=1,   # md
                           max_steps=2, callbacks=[ckpts], logger=False, enable_progress_bar=False,
                           enable_model_summary=False)
        first.fit(model, loader)
        torch.manual_seed(5 + rank)
        model = Net(tokens=False)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps,
                         accumulate_grad_batches=2 if mode == "tokens" else 1,
                         gradient_clip_val=0.5 if mode == "tokens" else None,
                         default_root_dir=root, logger=pl.loggers.CSVLogger(root), enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    t0 = time.perf_counter()
    # resume: a checkpoint only rank 0 has (another Mac's disk): the other ranks get rank 0's
    trainer.fit(model, loader, ckpt_path=None if mode != "resume" else
                f"{root.rsplit('/', 1)[0]}/rank0/ckpt/epoch=0-step=2.ckpt" if rank == 0 else f"{root}/absent.ckpt")
    seconds = time.perf_counter() - t0

    with torch.no_grad():
        loss = float(F.cross_entropy(model.net(x), y))
    loss = trainer.strategy.reduce(torch.tensor(loss), reduce_op="mean").item()
    if trainer.is_global_zero:
        np.savez(f"{args.out}-{mode}.npz", loss=loss, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    view = {"mode": mode, "rank": rank, "global_rank": trainer.global_rank, "world_size": trainer.world_size,
            "is_global_zero": trainer.is_global_zero, "steps": trainer.global_step,
            "batch": len(next(iter(trainer.train_dataloader))[0]) if mode != "resume" else None, "seconds": round(seconds, 4),
            "gathered": trainer.strategy.all_gather(torch.tensor(float(rank))).tolist(),
            "any": trainer.strategy.reduce_boolean_decision(rank == 1, all=False),
            "all": trainer.strategy.reduce_boolean_decision(rank == 1, all=True)}
    print("VIEW " + json.dumps(view), file=sys.stderr)
