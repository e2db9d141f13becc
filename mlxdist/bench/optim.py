"""`python -m mlxdist.bench optim`: one optimizer step of the torch engine's AdamW (mlxdist.optim's,
over all parameters at once) against `torch.optim.AdamW` on the same parameters and gradients
(foreach on a CPU or MPS, fused on CUDA), and Lion beside them, interleaved in one process.

The claim it checks: writing AdamW once (`mlxdist/optim/adamw.py`) costs the torch engine no more
than a few percent against torch's own multi-tensor AdamW. Times are medians; compare the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxdist.bench optim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda, mps)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.preset=small (default tiny)")
    args = ap.parse_args(argv)

    import torch

    from ..config import load_config
    from ..engine.common import decays
    from ..engine.torch_engine import TorchEngine
    from ..optim import make_optimizer, torch_ops

    cfg = load_config(None, ["model.preset=tiny", *args.overrides])
    eng = TorchEngine(cfg, args.device)
    base = [q.detach() for q in eng.model.parameters() if q.requires_grad]
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = [(torch.randn(q.shape, generator=gen) * 1e-3).to(q.device) for q in base]
    fused = eng.device_type == "cuda"
    t = cfg.train
    theirs = [q.clone().requires_grad_() for q in base]
    for q, g in zip(theirs, grads, strict=True):
        q.grad = g.clone()
    torch_adamw = torch.optim.AdamW(
        [{"params": [q for q in theirs if decays(tuple(q.shape))], "weight_decay": t.weight_decay},
         {"params": [q for q in theirs if not decays(tuple(q.shape))], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=None if fused else True, fused=fused or None)
    decay = [decays(tuple(q.shape)) for q in base]
    ours = {name: (make_optimizer(name, t), [q.clone() for q in base]) for name in ("adamw", "lion")}
    states = {name: tuple(torch_ops.Many([torch.zeros_like(q) for q in base]) for _ in opt.state_names)
              for name, (opt, _) in ours.items()}

    def sync() -> None:
        if fused:
            torch.cuda.synchronize()

    held = [g.clone() for g in grads]

    @torch.no_grad()
    def mlxdist_step(name: str, step: int) -> None:
        opt, params = ours[name]
        torch._foreach_copy_(held, grads)  # as the engine's gradients arrive fresh (the update consumes them)
        opt.update(torch_ops, torch_ops.Many(params), torch_ops.Many(held), states[name],
                   opt.scalars(t.lr, step, 1.0), decay)

    def torch_step(step: int) -> None:
        torch._foreach_copy_([q.grad for q in theirs], grads)  # as the engine's gradients arrive fresh
        torch_adamw.step()

    runs = {"torch.optim.AdamW": lambda s: torch_step(s), "mlxdist AdamW": lambda s: mlxdist_step("adamw", s),
            "mlxdist Lion": lambda s: mlxdist_step("lion", s)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(1, args.warmup + args.steps + 1):
        for name, run in runs.items():
            sync()
            t0 = time.perf_counter()
            run(step)
            sync()
            if step > args.warmup:
                times[name].append(time.perf_counter() - t0)
    n = sum(q.numel() for q in base)
    print(f"{cfg.model.preset}: {n:,} parameters in {len(base)} tensors on {eng.device}; torch.optim.AdamW "
          f"{'fused' if fused else 'foreach'}; median of {args.steps} steps")
    ref = statistics.median(times["torch.optim.AdamW"])
    for name, ts in times.items():
        print(f"  {name:<20} {1e3 * statistics.median(ts):9.2f} ms   {statistics.median(ts) / ref:5.2f}x")
    return 0
