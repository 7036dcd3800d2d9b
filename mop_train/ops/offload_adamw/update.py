"""The AdamW update itself, shared by the streamed buckets (on the device) and the host share (on the
CPU): torch's fused AdamW over many tensor pieces, one call per param group (its hyperparameters).
Steps are fp32 0-dim tensors already advanced for this update, as torch.optim.AdamW keeps them.
"""

from __future__ import annotations

import torch


def fused_adamw_by_group(pieces, hparams) -> None:
    """pieces: (group, master, grad, exp_avg, exp_avg_sq, step) per tensor piece, all fp32 on one
    device; hparams[group] = (lr, beta1, beta2, weight_decay, eps). Updates in place."""
    per_group: dict[int, tuple[list, list, list, list, list]] = {}
    for group, *tensors in pieces:
        lists = per_group.setdefault(group, ([], [], [], [], []))
        for lst, t in zip(lists, tensors):
            lst.append(t)
    for group, (masters, grads, exp_avgs, exp_avg_sqs, steps) in per_group.items():
        lr, beta1, beta2, weight_decay, eps = hparams[group]
        torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
