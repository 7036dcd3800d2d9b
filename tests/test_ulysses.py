"""Ulysses attention over gloo sequence groups equals full-sequence attention (values and grads)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mop_train.parallel.ulysses import UlyssesAttention, check_heads_divisible
from tests.dist_utils import run_distributed
from tests.utils import assert_close, fresh_seed


class CausalGQA(torch.nn.Module):
    def forward(self, q, k, v):
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return out.transpose(1, 2)


def _ulysses_matches_full(rank, world_size, seed):
    for B, S_per_rank, h, h_kv, d, dv in ((2, 3, 4 * world_size, 2 * world_size, 8, 6),
                                          (1, 5, 2 * world_size, world_size, 4, 4)):
        S = S_per_rank * world_size
        g = torch.Generator().manual_seed(fresh_seed(seed + S))
        q = torch.randn(B, S, h, d, generator=g)
        k = torch.randn(B, S, h_kv, d, generator=g)
        v = torch.randn(B, S, h_kv, dv, generator=g)
        gout = torch.randn(B, S, h, dv, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = CausalGQA()(*full)
        ref.backward(gout)
        sl = slice(rank * S_per_rank, (rank + 1) * S_per_rank)
        mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
        out = UlyssesAttention(CausalGQA(), dist.group.WORLD)(*mine)
        out.backward(gout[:, sl])
        assert_close(out, ref[:, sl], name="out")
        for name, a, b in zip("qkv", mine, full):
            assert_close(a.grad, b.grad[:, sl], name=f"grad {name}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ulysses_equals_full_attention(world_size):
    run_distributed(_ulysses_matches_full, world_size, torch.seed() % 10_000)


def test_head_count_not_divisible_is_a_config_error():
    with pytest.raises(ValueError, match=r"key/value heads \(2\) must be divisible by mop.layout.seq_degree \(4\)"):
        check_heads_divisible(8, 2, 4)
