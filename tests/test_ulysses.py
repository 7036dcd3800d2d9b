"""Ulysses attention over a sequence group equals full-sequence attention (values and grads): gloo
on CPU at 2, 3, 4 ranks, NCCL on 2 GPUs (marked gpu). fp32 within 1e-5; bf16 no worse against the
fp32 truth than PyTorch's own bf16 attention over the full sequence (tests.utils rule)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mop_train.layout import plan_layout
from mop_train.models import zoo
from mop_train.parallel.parallelize import check_layout_fits
from mop_train.parallel.ulysses import UlyssesAttention
from tests.dist_utils import backend_params, run_distributed, worker_device
from tests.utils import assert_close, assert_no_worse_than_torch, fresh_seed


class CausalGQA(torch.nn.Module):
    def forward(self, q, k, v):
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return out.transpose(1, 2)


def _full(q, k, v, gout):
    """Full-sequence attention on one rank: output and grads of q, k, v."""
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = CausalGQA()(*full)
    out.backward(gout)
    return [out.detach()] + [t.grad for t in full]


def _ulysses_matches_full(rank, world_size, seed):
    device = worker_device()
    # CUDA's fused attention kernels may tile another head count differently: a few ulps of O(1) values.
    atol = 1e-6 if device.type == "cpu" else 1e-5
    for B, S_per_rank, h, h_kv, d, dv in ((2, 3, 4 * world_size, 2 * world_size, 8, 6),
                                          (1, 5, 2 * world_size, world_size, 4, 4)):
        S = S_per_rank * world_size
        g = torch.Generator().manual_seed(fresh_seed(seed + S))
        q = torch.randn(B, S, h, d, generator=g)
        k = torch.randn(B, S, h_kv, d, generator=g)
        v = torch.randn(B, S, h_kv, dv, generator=g)
        gout = torch.randn(B, S, h, dv, generator=g)
        q, k, v, gout = (t.to(device) for t in (q, k, v, gout))
        sl = slice(rank * S_per_rank, (rank + 1) * S_per_rank)
        truth = _full(q, k, v, gout)
        for dtype in (torch.float32, torch.bfloat16):
            inputs = [t.to(dtype) for t in (q, k, v, gout)]
            mine = [t[:, sl].clone().requires_grad_() for t in inputs[:3]]
            out = UlyssesAttention(CausalGQA(), dist.group.WORLD)(*mine)
            out.backward(inputs[3][:, sl])
            ours = [out] + [t.grad for t in mine]
            if dtype == torch.float32:
                for name, a, b in zip(("out", "grad q", "grad k", "grad v"), ours, truth):
                    assert_close(a, b[:, sl], atol=atol, name=name)
                continue
            # bf16: the same inputs rounded once; truth in fp32 from those rounded values.
            truth_bf = _full(*[t.float() for t in inputs])
            theirs = _full(*inputs)
            for name, a, b, t in zip(("out", "grad q", "grad k", "grad v"), ours, theirs, truth_bf):
                assert_no_worse_than_torch(a, b[:, sl], t[:, sl], name=f"{name} bf16 D={world_size}")


@pytest.mark.slow
@pytest.mark.parametrize("backend,world_size", backend_params([2, 3, 4]))
def test_ulysses_equals_full_attention(backend, world_size):
    run_distributed(_ulysses_matches_full, world_size, torch.seed() % 10_000, backend=backend)


def test_head_count_not_divisible_is_a_config_error():
    gqa = zoo.get_model_args("gpt-oss-20b-shape")                    # 64 query heads, 8 key/value heads
    training = SimpleNamespace(seq_len=128)
    with pytest.raises(ValueError, match=r"key/value heads \(8\) must be divisible by mop.layout.seq_degree \(16\)"):
        check_layout_fits(plan_layout(16, 16, 1, 1), training, gqa)
    with pytest.raises(ValueError, match=r"valid seq_degree values: \[1, 2, 4, 8\]"):
        check_layout_fits(plan_layout(16, 16, 1, 1), training, gqa)
    check_layout_fits(plan_layout(16, 8, 1, 1), training, gqa)
