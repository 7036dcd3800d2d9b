"""The plain AdamW update that OffloadStreamAdamW reproduces: the spec and the test oracle.

Per parameter p with gradient g at its own step t (counted from 1, only on steps where g exists):
    p     <- p * (1 - lr * wd)                       decoupled weight decay
    m     <- beta1 * m + (1 - beta1) * g
    v     <- beta2 * v + (1 - beta2) * g^2
    p     <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
This is torch.optim.AdamW (Loshchilov & Hutter); `reference_adamw` builds torch's own single-tensor
implementation with the same hyperparameters, `adamw_reference_step` writes the math out in fp32.
Paper: section 3.4 ("same math as torch's AdamW").
"""

from __future__ import annotations

import torch


def reference_adamw(params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.01) -> torch.optim.AdamW:
    """torch.optim.AdamW (plain for-loop implementation) over fp32 params / param groups."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             foreach=False, fused=False)


@torch.no_grad()
def adamw_reference_step(params: list[torch.Tensor], grads: list[torch.Tensor],
                         exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                         steps: list[int], *, lr: float, betas: tuple[float, float], eps: float,
                         weight_decay: float) -> None:
    """One AdamW update in place on fp32 tensors; `steps[i]` is parameter i's step after this update."""
    beta1, beta2 = betas
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        g = g.float()
        p.mul_(1.0 - lr * weight_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / (1.0 - beta2 ** t) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** t))
