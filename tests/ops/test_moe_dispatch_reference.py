"""The dispatch oracle itself (moe_dispatch/reference.py) against a dense restatement of its formula:
every expert on every token, masked by the routing; random sizes, an empty batch, bf16 tokens with fp32
routing weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mop_train.ops.moe_dispatch.reference import reference_experts_forward
from tests.utils import assert_close, fresh_seed


def _dense(x, indices, weights, w1, w2, w3):
    """y = sum_e gate[n, e] * expert_e(x) over all E experts at once, gate[n, e] = sum of n's weights on e."""
    E = w1.shape[0]
    gate = torch.zeros(x.shape[0], E, dtype=torch.float64).scatter_add_(1, indices, weights.double())  # [N, E]
    h = F.silu(torch.einsum("nh,eih->nei", x, w1)) * torch.einsum("nh,eih->nei", x, w3)                 # [N, E, I]
    return torch.einsum("nei,ehi,ne->nh", h, w2, gate.to(x.dtype))


def test_reference_matches_the_dense_formula():
    gen = torch.Generator().manual_seed(fresh_seed(53))
    for N in (0, 1, 7):
        E, k, H, I = 5, 3, 6, 4
        x = torch.randn(N, H, generator=gen, dtype=torch.float64, requires_grad=True)
        w1, w3 = (torch.randn(E, I, H, generator=gen, dtype=torch.float64) for _ in range(2))
        w2 = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
        indices = torch.randint(0, E, (N, k), generator=gen)          # repeats allowed: weights add up
        weights = torch.rand(N, k, generator=gen, dtype=torch.float64)
        y = reference_experts_forward(x, indices, weights, w1, w2, w3)
        assert y.shape == (N, H) and y.dtype == x.dtype
        assert_close(y, _dense(x, indices, weights, w1, w2, w3), rtol=1e-12, atol=1e-12, name=f"N={N}")
        y.sum().backward()                                           # an empty batch still has a graph
        assert x.grad.shape == (N, H)


def test_reference_keeps_the_token_dtype():
    gen = torch.Generator().manual_seed(fresh_seed(54))
    x = torch.randn(3, 8, generator=gen).bfloat16()
    w1, w3 = (torch.randn(2, 4, 8, generator=gen).bfloat16() for _ in range(2))
    w2 = torch.randn(2, 8, 4, generator=gen).bfloat16()
    weights = torch.rand(3, 2, generator=gen)                            # fp32 routing weights
    y = reference_experts_forward(x, torch.tensor([[0, 1], [1, 1], [0, 0]]), weights, w1, w2, w3)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 8)
