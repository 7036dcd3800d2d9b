"""Plain per-token reference for routed SwiGLU experts: the spec and test oracle of every dispatch.

Legend: N tokens, H hidden, I expert hidden width, E experts, k top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert. x [T, H]; w1, w3 [I, H]; w2 [H, I] -> [T, H]."""
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def reference_experts_forward(x, indices, weights, w1, w2, w3):
    """y[n] = sum_j weights[n, j] * expert_{indices[n, j]}(x[n]), one token and one slot at a time.

    x [N, H]; indices, weights [N, k]; w1, w3 [E, I, H]; w2 [E, H, I] -> y [N, H]. Slow on purpose.
    """
    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros_like(x[n])
        for j in range(indices.shape[1]):
            e = int(indices[n, j])
            acc = acc + weights[n, j].to(x.dtype) * expert_mlp(x[n : n + 1], w1[e], w2[e], w3[e])[0]
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1]) + 0 * x.sum()
