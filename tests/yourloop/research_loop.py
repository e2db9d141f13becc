"""The pieces a research script brings, each on mlxdist (`tests/test_research_loop.py` runs this
once on 2 ranks with 3+5 and reads OUT-RANK.json):

- an IterableDataset that makes whole global batches: `md.DistributedIterable` gives each rank
  its rows, resumed with `start_step`;
- per-sample rows on buffers (a sparse embedding's looked-up rows and ids) stepped by an
  optimizer whose `step(self)` takes no closure: it sees every rank's rows in rank order, their
  gradients divided by the cluster's samples;
- two optimizers broadcast from rank 0;
- checkpoint state: tensors saved as rank 0 holds them, `md.rows(...)` as each rank's rows;
  a rank whose weights drifted from rank 0's is named when saving.

    python research_loop.py OUT RUN_DIR
"""

import json
import sys
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset

import mlxdist.torch as md

out, run_dir = sys.argv[1], sys.argv[2]
info = md.init(device="cpu")
report = {"rank": info.rank}


class GlobalBatches(IterableDataset):
    """Global batches of 8 rows, the same on every rank (as TRM's PuzzleDataset makes them)."""

    def __iter__(self):
        for step in range(4):
            ids = torch.arange(step * 8, step * 8 + 8)
            yield "all", {"ids": ids, "x": ids.float()[:, None].repeat(1, 2)}, 8


rows = md.DistributedIterable(DataLoader(GlobalBatches(), batch_size=None), 8, start_step=1)
report["iterable_ids"] = [batch["ids"].tolist() for _, batch, _ in rows]
report["iterable_second_pass"] = [batch["ids"].tolist() for _, batch, _ in rows][:1]


class Recording(torch.optim.Optimizer):
    """Sign-SGD on the rows' ids of a table, as TRM's sparse embedding; step(self), no closure."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self):
        table, local, ids = self.param_groups[0]["params"]
        self.seen = (local.grad.clone(), ids.clone())
        table[ids] -= 0.1 * torch.sign(local.grad)


class Sparse(torch.nn.Module):
    def __init__(self, batch):
        super().__init__()
        self.table = torch.nn.Buffer(torch.zeros(32, 2))
        self.local = torch.nn.Buffer(torch.zeros(batch, 2, requires_grad=True), persistent=False)
        self.ids = torch.nn.Buffer(torch.zeros(batch, dtype=torch.long), persistent=False)
        self.w = torch.nn.Parameter(torch.ones(2))


torch.manual_seed(info.rank)  # every rank's own start: broadcast makes them rank 0's
model = Sparse(len(report["iterable_ids"][0]))
sparse = md.DistributedOptimizer(Recording(model.buffers()), model, reduction="sum", rows=[model.local, model.ids])
adam = md.DistributedOptimizer(torch.optim.AdamW([model.w], lr=0.1), model, reduction="sum")
adam.state[model.w].update(step=torch.tensor(1.0), exp_avg=torch.randn(2), exp_avg_sq=torch.ones(2))  # per rank
md.broadcast(model, [sparse, adam])
report["adam_exp_avg"] = adam.state[model.w]["exp_avg"].tolist()

_, batch, _ = next(iter(md.DistributedIterable(DataLoader(GlobalBatches(), batch_size=None), 8)))
with torch.no_grad():
    model.local.copy_(batch["x"])
    model.ids.copy_(batch["ids"])
loss = (model.local * model.w * (batch["ids"][:, None] + 1)).sum()  # row i's gradient: (i + 1) * w
loss.backward()
for opt in (sparse, adam):
    opt.step(count=len(batch["ids"]))
report["gathered_grad"] = sparse.seen[0].tolist()
report["gathered_ids"] = sparse.seen[1].tolist()
report["local_after"] = list(model.local.shape)
report["w_grad"] = model.w.grad.tolist()


@dataclass
class Carry:
    z: torch.Tensor
    halted: torch.Tensor


carry = Carry(z=torch.full((len(batch["ids"]), 3), float(info.rank)), halted=batch["ids"] % 2 == 0)
rng = torch.get_rng_state()
md.save_checkpoint(run_dir, 1, model, [sparse, adam], carry=md.rows(carry), rng=rng,
                   ema={"w": model.w.detach() + info.rank}, epoch=3)
resumed = md.load_checkpoint(run_dir, model, [sparse, adam], classes=[Carry])
report["resumed_epoch"] = resumed["epoch"]
report["resumed_carry_z"] = resumed["carry"].z[:, 0].tolist()
report["resumed_carry_halted"] = resumed["carry"].halted.tolist()
report["resumed_ema_w"] = resumed["ema"]["w"].tolist()
report["rng_equal_to_rank0"] = bool(torch.equal(resumed["rng"], md.broadcast_object(rng)))
with torch.no_grad():
    model.w += info.rank  # rank 1 drifts: its checkpoint says so
md.save_checkpoint(run_dir, 2, model)
with open(f"{out}-{info.rank}.json", "w") as f:
    json.dump(report, f)
