"""Tasks written the way a user would, imported by `task.factory: user_tasks:...` from the
tests directory (the working directory of those runs)."""

from __future__ import annotations

import os

import numpy as np

import mlxdist


class Regression:
    """x -> y with a fixed random linear map plus noise: 8 features, 3 targets."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, 8)).astype(np.float32)
        w = rng.normal(size=(8, 3)).astype(np.float32)
        self.y = (self.x @ w + 0.1 * rng.normal(size=(n, 3))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i]}


def mlx_mlp(n: int = 256, mean: bool = False, batchnorm: bool = False, vector: bool = False,
            rank_init: bool = False) -> mlxdist.Task:
    """An MLX MLP that seeds nothing itself. With `rank_init` each rank draws its own initial
    weights (as with a seed from the clock): only rank 0's broadcast makes them agree."""

    def build(ctx):
        import mlx.core as mx
        import mlx.nn as nn

        if rank_init:
            mx.random.seed(int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) + 1000)
        layers = [nn.Linear(8, 16)] + ([nn.BatchNorm(16)] if batchnorm else []) + [nn.ReLU(), nn.Linear(16, 3)]
        return nn.Sequential(*layers)

    def loss(model, batch):
        err = ((model(batch["x"]) - batch["y"]) ** 2).sum(axis=-1)
        return err if vector else (err.mean() if mean else err.sum())

    return mlxdist.Task(build=build, loss=loss, dataset=Regression(n), eval_dataset=Regression(64, seed=1))


class Padded:
    """Variable-length sequences padded to 12: the loss counts only real positions."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(1, 13, size=n)
        self.x = rng.normal(size=(n, 12, 4)).astype(np.float32)
        self.y = rng.normal(size=(n, 12, 2)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        mask = (np.arange(12) < self.lengths[i]).astype(np.float32)
        return {"x": self.x[i], "y": self.y[i], "mask": mask}


def mlx_masked(n: int = 128) -> mlxdist.Task:
    def build(ctx):
        import mlx.nn as nn

        return nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2))

    def loss(model, batch):
        err = ((model(batch["x"]) - batch["y"]) ** 2).sum(axis=-1)
        return (err * batch["mask"]).sum()

    return mlxdist.Task(build=build, loss=loss, dataset=Padded(n), count=lambda b: int(b["mask"].sum()),
                        unit="frames")


def torch_mlp(n: int = 256) -> mlxdist.Task:
    def build(ctx):
        import torch

        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    return mlxdist.Task(build=build, loss=loss, dataset=Regression(n))


def torch_adapted(n: int = 256) -> mlxdist.Task:
    """torch_mlp with a LoRA-style pair of factors beside its first layer, named as PEFT's are
    in mlxdist (`*.lora_a`, `*.lora_b`): the torch engine keeps those transposed to checkpoints."""

    def build(ctx):
        import torch

        class Adapted(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Linear(8, 16)
                self.lora_a = torch.nn.Parameter(0.3 * torch.randn(4, 8))  # (rank, in), as PEFT's lora_A
                self.lora_b = torch.nn.Parameter(0.3 * torch.randn(16, 4))

            def forward(self, x):
                return self.inner(x) + (x @ self.lora_a.T) @ self.lora_b.T

        return torch.nn.Sequential(Adapted(), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    task = torch_mlp(n)
    task.build = build
    return task


def zero_count() -> mlxdist.Task:
    task = mlx_mlp()
    task.count = lambda b: 0
    return task


def rank_dependent_length() -> mlxdist.Task:
    """A dataset that differs by host, as when one Mac has a stale copy of the data."""
    task = mlx_mlp()
    task.dataset = Regression(256 + int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    return task


def not_a_task():
    return {"build": None}


class Repeats:
    """Token sequences that repeat a random 4-token motif: learnable next-token prediction."""

    def __init__(self, n: int, vocab: int = 32, length: int = 17, seed: int = 0):
        rng = np.random.default_rng(seed)
        motifs = rng.integers(0, vocab, size=(n, 4))
        self.tokens = np.tile(motifs, (1, length // 4 + 1))[:, :length].astype(np.int32)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i]


def mlx_lm_llama(n: int = 512) -> mlxdist.Task:
    """mlx-lm's own Llama, at a tiny size, used as it is."""

    def build(ctx):
        from mlx_lm.models import llama

        return llama.Model(llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                                           vocab_size=32, num_key_value_heads=2))

    def loss(model, tokens):
        import mlx.nn as nn

        return nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], reduction="sum")

    return mlxdist.Task(build=build, loss=loss, dataset=Repeats(n), eval_dataset=Repeats(64, seed=1),
                        count=lambda b: b[:, 1:].size, unit="tokens")


def mlx_frozen_base(by_rank: bool = False) -> mlxdist.Task:
    """A frozen first layer (a 'pretrained base' the task loads; BASE_SEED stands for another
    copy of its files) and a trained head: every rank must hold the same base."""
    task = mlx_mlp()
    build = task.build

    def frozen_build(ctx):
        import mlx.core as mx

        model = build(ctx)
        seed = int(os.environ.get("BASE_SEED", "0")) + (int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) if by_rank else 0)
        model.layers[0].update({"weight": mx.random.normal(model.layers[0].weight.shape, key=mx.random.key(seed))})
        model.layers[0].freeze()
        return model

    task.build = frozen_build
    return task


# ---------------------------------------------------------------- randomness that keeps exactness
def flip_and_jitter(sample, rng):
    """`Task.augment`: flip the sign of x and y together and jitter x, drawn from `rng` only."""
    sign = np.float32(rng.choice([-1.0, 1.0]))
    return {"x": sign * sample["x"] + rng.normal(0, 0.05, 8).astype(np.float32), "y": sign * sample["y"]}


def keep_mask(width: int, p: float = 0.25) -> np.ndarray:
    """Per-sample dropout: row i is drawn from sample i's seed, whatever batch it sits in."""
    rows = [np.random.default_rng(s).random(width) >= p for s in mlxdist.tasks.sample_seeds()]
    return np.stack(rows).astype(np.float32) / (1 - p)


class RandomReads(Regression):
    """The wrong way to augment: noise drawn from the global generator when read."""

    def __getitem__(self, i: int):
        s = super().__getitem__(i)
        return {"x": s["x"] + np.random.normal(0, 0.05, 8).astype(np.float32), "y": s["y"]}


def mlx_random(n: int = 256, augment: bool = False, dropout: bool = False, random_reads: bool = False,
               unseeded_augment: bool = False, random_forward: bool = False, stateful: bool = False) -> mlxdist.Task:
    """An MLX MLP with randomness: seeded the right way (`augment`: Task.augment; `dropout`:
    per-sample dropout from sample_seeds()) or one of the wrong ways check_task names."""

    def build(ctx):
        import mlx.core as mx
        import mlx.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)
                self.drop = nn.Dropout(0.25) if random_forward else None
                self.seen = 0  # stateful: a warm-up factor by batches seen

            def __call__(self, x):
                h = nn.relu(self.l1(x))
                if dropout and self.training:
                    h = h * mx.array(keep_mask(16))
                if self.drop is not None:
                    h = self.drop(h)
                out = self.l2(h)
                if stateful:
                    self.seen += 1
                    out = out * (1.0 + 1.0 / self.seen)
                return out

        return Net()

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    aug = flip_and_jitter
    if unseeded_augment:
        def aug(sample, rng):
            return flip_and_jitter(sample, np.random.default_rng())

    return mlxdist.Task(build=build, loss=loss, dataset=RandomReads(n) if random_reads else Regression(n),
                        eval_dataset=Regression(64, seed=1), augment=aug if augment or unseeded_augment else None)


def torch_random(n: int = 256, dropout: bool = True, random_forward: bool = False) -> mlxdist.Task:
    """The torch twin of mlx_random: per-sample dropout from sample_seeds(), or torch's own."""

    def build(ctx):
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
                self.drop = torch.nn.Dropout(0.25) if random_forward else torch.nn.Identity()

            def forward(self, x):
                h = torch.relu(self.l1(x))
                if dropout and self.training:
                    h = h * torch.as_tensor(keep_mask(16), device=h.device)
                return self.l2(self.drop(h))

        return Net()

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    return mlxdist.Task(build=build, loss=loss, dataset=Regression(n), augment=flip_and_jitter)


def torch_batchnorm(n: int = 256) -> mlxdist.Task:
    """A torch MLP with BatchNorm1d: running statistics and a batch counter are buffers."""

    def build(ctx):
        import torch

        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 3))

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    return mlxdist.Task(build=build, loss=loss, dataset=Regression(n))


def torch_own_optimizer(n: int = 256, raises: bool = False, not_one: bool = False) -> mlxdist.Task:
    """The task's own optimizer: SGD with momentum, two parameter groups with their own
    learning rate and weight decay (decay on everything, biases too)."""
    task = torch_mlp(n)

    def optimizer(model):
        import torch

        if raises:
            raise KeyError("lr_head")
        if not_one:
            return {"sgd": 1}
        return torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.05},
                                {"params": model[2].parameters(), "lr": 0.02,
                                 "weight_decay": 0.1}], momentum=0.9)

    task.optimizer = optimizer
    return task


def mlx_own_optimizer(n: int = 256) -> mlxdist.Task:
    task = mlx_mlp(n)

    def optimizer(model):
        import mlx.optimizers as optim

        return optim.SGD(learning_rate=0.05, momentum=0.9, weight_decay=0.01)

    task.optimizer = optimizer
    return task


def mlx_with_metrics(n: int = 256, vector_metric: bool = False) -> mlxdist.Task:
    """Loss plus metrics: `close` summed per sample (divided by the units), and `hit` over
    its own count (targets above 0)."""
    task = mlx_mlp(n)

    def loss(model, batch):
        import mlx.core as mx

        err = ((model(batch["x"]) - batch["y"]) ** 2).sum(axis=-1)
        close = (err < 1.0).astype(mx.float32)
        positive = (batch["y"][:, 0] > 0).astype(mx.float32)
        if vector_metric:
            return err.sum(), {"close": close}
        return err.sum(), {"close": close.sum(), "hit": ((close * positive).sum(), positive.sum())}

    task.loss = loss
    task.eval_dataset = Regression(64, seed=1)
    return task


def torch_with_metrics(n: int = 256) -> mlxdist.Task:
    task = torch_mlp(n)

    def loss(model, batch):
        err = ((model(batch["x"]) - batch["y"]) ** 2).sum(dim=-1)
        return err.sum(), {"close": (err < 1.0).float().sum()}

    task.loss = loss
    task.eval_dataset = Regression(64, seed=1)
    return task


def raises_in_loss(n: int = 64) -> mlxdist.Task:
    task = mlx_mlp(n)

    def loss(model, batch):
        raise RuntimeError("shapes do not line up")

    task.loss = loss
    return task


def with_hooks(out: str, fail: str = "", engine: str = "mlx") -> mlxdist.Task:
    """Rank 0's hooks as a recipe uses them: eval results and a "sample" per checkpoint written
    to files; `fail` names a hook that raises."""
    import json
    from pathlib import Path

    task = mlx_mlp() if engine == "mlx" else torch_batchnorm()
    task.eval_dataset = Regression(64, seed=1)

    def on_eval(model, step, metrics):
        if fail == "on_eval":
            raise ValueError("no plotting backend")
        with open(Path(out) / "evals.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "metrics": metrics, "training": bool(model.training),
                                "rank": os.environ.get("OMPI_COMM_WORLD_RANK", "0")}) + "\n")

    def on_checkpoint(model, directory, step):
        if fail == "on_checkpoint":
            raise ValueError("disk quota")
        (Path(directory) / "sample.txt").write_text(f"step {step}\n")

    task.on_eval, task.on_checkpoint = on_eval, on_checkpoint
    return task


def torch_carry(n: int = 256, stateful: bool = True) -> mlxdist.Task:
    """A task that carries state between steps, as a recursive model carries its latent: a
    running mean of the inputs it has seen, added to every input, and a count of the batches."""
    import torch

    task = torch_mlp(n)
    carry = {"mean": torch.zeros(8), "batches": 0}

    def loss(model, batch):
        x = batch["x"] + carry["mean"]
        carry["mean"] = 0.8 * carry["mean"] + 0.2 * batch["x"].mean(dim=0).detach()
        carry["batches"] += 1
        return ((model(x) - batch["y"]) ** 2).sum()

    def load_state_dict(state):
        carry["mean"] = torch.as_tensor(state["carry"]["mean"])
        carry["batches"] = int(state["carry"]["batches"])

    task.loss = loss
    if stateful:
        task.state_dict = lambda: {"carry": dict(carry)}
        task.load_state_dict = load_state_dict
    return task


def reads_seq_len() -> mlxdist.Task:
    """A task that reads a key of the built-in LM's sections from ctx.config, and says so."""
    task = mlx_mlp()
    task.config_keys = ("data.seq_len",)
    return task


def mlx_staged_mlp(n: int = 256) -> mlxdist.Task:
    """A user's MLX model that offers `stages()` (what `dist.shard=weights` runs it by): three
    layers, each a stage with its weight and bias."""

    def build(ctx):
        import mlx.nn as nn

        class Staged(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

            def __call__(self, x):
                for _, run in self.stages():
                    x = run(x)
                return x

            def stages(self):
                return [(["inp.weight", "inp.bias"], lambda x: nn.relu(self.inp(x))),
                        (["mid.weight", "mid.bias"], lambda h: nn.relu(self.mid(h))),
                        (["out.weight", "out.bias"], self.out)]

        return Staged()

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    return mlxdist.Task(build=build, loss=loss, dataset=Regression(n), eval_dataset=Regression(64, seed=1))
