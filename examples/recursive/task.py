"""A tiny recursive reasoning model (TRM-style) that learns Sudoku, trained by mlxdist on PyTorch.

One small network is applied again and again: a latent z is refined n times from the puzzle x,
the current answer y and z itself, then y is refined from y and z; that cycle repeats, and the
answer is scored after each of several "supervision steps" (deep supervision). The puzzles are
made here, deterministically from a seed, each with exactly one solution.

    python -m mlxdist.train --engine torch --device auto --config configs/mac.yaml
    python task.py eval runs/sudoku-mac          # exact-cell accuracy on held-out puzzles
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import mlxdist

# ---------------------------------------------------------------- puzzles

ROW = [i // 9 for i in range(81)]
COL = [i % 9 for i in range(81)]
BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
ALL_DIGITS = 0b1111111110  # bit d stands for digit d, 1..9


def solutions(grid, limit: int = 2) -> list[list[int]]:
    """Up to `limit` solutions (0 = blank). Stopping at 2 is all a uniqueness test needs, and
    filling the most constrained cell first keeps that to a few milliseconds."""
    cells = [int(v) for v in grid]
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, v in enumerate(cells):
        if v:
            rows[ROW[i]] |= 1 << v
            cols[COL[i]] |= 1 << v
            boxes[BOX[i]] |= 1 << v
    blanks = [i for i, v in enumerate(cells) if v == 0]
    found: list[list[int]] = []

    def search() -> None:
        best, best_free, best_n = -1, 0, 10
        for i in blanks:
            if cells[i]:
                continue
            free = ALL_DIGITS & ~(rows[ROW[i]] | cols[COL[i]] | boxes[BOX[i]])
            n = free.bit_count()
            if n < best_n:
                best, best_free, best_n = i, free, n
                if n <= 1:
                    break
        if best < 0:
            found.append(cells.copy())
            return
        r, c, b = ROW[best], COL[best], BOX[best]
        for d in range(1, 10):
            if best_free >> d & 1:
                bit = 1 << d
                cells[best] = d
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                search()
                cells[best] = 0
                rows[r] ^= bit
                cols[c] ^= bit
                boxes[b] ^= bit
                if len(found) >= limit:
                    return

    search()
    return found


def full_grid(rng: np.random.Generator) -> np.ndarray:
    """A random solved grid: a valid base pattern with its digits, bands, stacks, rows within a
    band and columns within a stack shuffled (each keeps every Sudoku rule), maybe transposed."""
    base = np.array([[(3 * (r % 3) + r // 3 + c) % 9 for c in range(9)] for r in range(9)])
    rows = np.concatenate([3 * band + rng.permutation(3) for band in rng.permutation(3)])
    cols = np.concatenate([3 * stack + rng.permutation(3) for stack in rng.permutation(3)])
    grid = (rng.permutation(9) + 1)[base[np.ix_(rows, cols)]]
    return (grid.T if rng.integers(2) else grid).reshape(81)


def make_puzzle(rng: np.random.Generator, blanks: int) -> tuple[np.ndarray, np.ndarray]:
    """Blank `blanks` random cells; while a second solution exists, give back one cell where it
    differs from ours. So the puzzle has one solution and about `blanks` blanks."""
    solution = full_grid(rng)
    puzzle = solution.copy()
    puzzle[rng.permutation(81)[:blanks]] = 0
    while len(found := solutions(puzzle)) > 1:
        other = next(s for s in found if s != solution.tolist())
        cell = next(i for i in range(81) if other[i] != solution[i])
        puzzle[cell] = solution[cell]
    return puzzle, solution


class Sudoku:
    """`n` puzzles with unique solutions from `seed`; cached in `data_dir` since a large set
    takes a while in pure Python. Samples: the puzzle's digits (0 = blank) and the solution
    as classes 0..8."""

    def __init__(self, n: int, seed: int, blanks: int, data_dir: str | None = None):
        path = Path(data_dir) / f"sudoku_n{n}_seed{seed}_blanks{blanks}.npz" if data_dir else None
        if path is not None and path.exists():
            with np.load(path) as saved:
                self.puzzles, self.solutions = saved["puzzles"], saved["solutions"]
            return
        rng = np.random.default_rng(seed)
        pairs = [make_puzzle(rng, blanks) for _ in range(n)]
        self.puzzles = np.stack([p for p, _ in pairs]).astype(np.int64)
        self.solutions = np.stack([s for _, s in pairs]).astype(np.int64) - 1
        if path is not None:  # written once, atomically: ranks on one Mac may race to write it
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.npz")
            np.savez(tmp, puzzles=self.puzzles, solutions=self.solutions)
            os.replace(tmp, path)

    def __len__(self) -> int:
        return len(self.puzzles)

    def __getitem__(self, i: int) -> dict:
        return {"puzzle": self.puzzles[i], "solution": self.solutions[i]}


# ---------------------------------------------------------------- model


def rms_norm(h: torch.Tensor) -> torch.Tensor:
    """Post-norm without weights, as in TRM: it keeps y and z at one scale however often the
    network is reapplied."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class MixerBlock(nn.Module):
    """Mixes across the 81 cells (where Sudoku's constraints live), then across channels. All
    within one puzzle, with no BatchNorm: the puzzles of a batch stay independent, as the
    sum/count rule for unequal Macs needs."""

    def __init__(self, dim: int):
        super().__init__()
        self.cells = nn.Sequential(nn.Linear(81, 2 * 81), nn.GELU(), nn.Linear(2 * 81, 81))
        self.channels = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h + self.cells(h.transpose(1, 2)).transpose(1, 2))
        return rms_norm(h + self.channels(h))


class TinyRecursiveModel(nn.Module):
    """x, y, z -> z refined `n` times, then y; `cycles` such cycles per supervision step, all but
    the last without gradients (TRM's trick: deep thinking at the memory of one cycle). y and z
    are carried, detached, into the next supervision step, so each step learns to improve
    whatever answer the previous one left."""

    def __init__(self, dim: int = 64, layers: int = 2, n: int = 3, cycles: int = 2, supervision: int = 4):
        super().__init__()
        self.n, self.cycles, self.supervision = n, cycles, supervision
        self.digit = nn.Embedding(10, dim)
        # A cell's place as its row, column and box: the three groups Sudoku constrains.
        self.row, self.col, self.box = nn.Embedding(9, dim), nn.Embedding(9, dim), nn.Embedding(9, dim)
        self.register_buffer("groups", torch.tensor([ROW, COL, BOX]), persistent=False)
        self.net = nn.Sequential(*[MixerBlock(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 9)

    def cycle(self, x, y, z):
        for _ in range(self.n):
            z = self.net(x + y + z)
        return self.net(y + z), z

    def forward(self, puzzle: torch.Tensor) -> torch.Tensor:
        """Logits of every supervision step, shape (supervision, batch, 81, 9)."""
        x = self.digit(puzzle) + self.row(self.groups[0]) + self.col(self.groups[1]) + self.box(self.groups[2])
        y = z = torch.zeros_like(x)
        logits = []
        for _ in range(self.supervision):
            with torch.no_grad():
                for _ in range(self.cycles - 1):
                    y, z = self.cycle(x, y, z)
            y, z = self.cycle(x, y, z)
            logits.append(self.head(y))
            y, z = y.detach(), z.detach()
        return torch.stack(logits)


# ---------------------------------------------------------------- the task


def loss(model, batch):
    """The SUM over blank cells of the cross-entropy, averaged over the supervision steps (a
    constant factor, so still a sum over cells: the unit is a blank cell, `count` below)."""
    logits = model(batch["puzzle"])
    steps = logits.shape[0]
    target = batch["solution"].expand(steps, -1, -1)
    ce = F.cross_entropy(logits.reshape(-1, 9), target.reshape(-1), reduction="none").view(target.shape)
    blank = (batch["puzzle"] == 0).float()
    return (ce.mean(0) * blank).sum()


def count(batch) -> int:  # the units `loss` sums over, from the numpy batch
    return int((batch["puzzle"] == 0).sum())


def make_task(train: int = 4000, eval: int = 256, blanks: int = 45, seed: int = 0, data_dir: str | None = None,
              dim: int = 64, layers: int = 2, n: int = 3, cycles: int = 2, supervision: int = 4) -> mlxdist.Task:
    """`task.args` in the config are these keywords. Held-out puzzles come from another seed."""
    shape = {"dim": dim, "layers": layers, "n": n, "cycles": cycles, "supervision": supervision}
    return mlxdist.Task(build=lambda ctx: TinyRecursiveModel(**shape), loss=loss, count=count,
                        dataset=Sudoku(train, seed, blanks, data_dir),
                        eval_dataset=Sudoku(eval, seed + 1_000_003, blanks, data_dir), unit="cells")


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(run_dir: str, batch_size: int = 256) -> tuple[float, float]:
    """Exact-cell accuracy (blank cells whose digit is right after the last supervision step)
    and the share of puzzles solved whole, on the run's held-out puzzles, from its latest
    checkpoint's weights."""
    from mlxdist.state.checkpoint import load_latest

    loaded = load_latest(Path(run_dir) / "checkpoints")
    if loaded is None:
        sys.exit(f"no checkpoint in {run_dir}/checkpoints")
    task = make_task(**loaded.meta.config["task"]["args"])  # the run's puzzles and model shape
    model = task.build(None)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in loaded.weights.items()})
    model.eval()
    right = blank = solved = 0
    data = task.eval_dataset
    for start in range(0, len(data), batch_size):
        puzzle = torch.from_numpy(data.puzzles[start:start + batch_size])
        solution = torch.from_numpy(data.solutions[start:start + batch_size])
        guess = model(puzzle)[-1].argmax(-1)
        is_blank = puzzle == 0
        right += int(((guess == solution) & is_blank).sum())
        blank += int(is_blank.sum())
        solved += int(((guess == solution) | ~is_blank).all(-1).sum())
    step = loaded.meta.run.step
    print(f"step {step}: exact-cell accuracy {right / blank:.4f} on {blank} blank cells of {len(data)} held-out "
          f"puzzles; {solved}/{len(data)} puzzles solved whole")
    return right / blank, solved / len(data)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "eval":
        sys.exit("usage: python task.py eval RUN_DIR")
    evaluate(sys.argv[2])
