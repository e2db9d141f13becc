"""A CPU stand-in for `adam_atan2.AdamATan2` (PyPI `adam-atan2`, github.com/sapientinc/adam-atan2),
which TRM's pretrain.py imports: that package is a fused CUDA kernel with no CPU build. Written
for mlxdist's tests, not copied: the same update (Adam with atan2 in place of the division by
sqrt(v)+eps, decoupled weight decay, a=1.27, b=1) and the same `step(self)` signature, which takes
no closure (what made mlxdist's DistributedOptimizer fail before)."""

import math

import torch
from torch.optim.optimizer import Optimizer


class AdamATan2(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2, a=1.27, b=1.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, a=a, b=b))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = float(state["step"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].lerp_(p.grad.square(), 1 - beta2)
                m = state["exp_avg"] / (1 - beta1 ** step)
                v = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)
                p.sub_(group["lr"] * group["a"] * torch.atan2(m, group["b"] * v))
