"""Ulysses attention over a sequence group equals full-sequence attention (values and grads): gloo
on CPU at 3 and 4 ranks (D = 2 inside the world of 4: two sequence groups of 2), NCCL on 2 GPUs
(marked gpu). fp32 within 1e-5; bf16 no worse against the
fp32 truth than PyTorch's own bf16 attention over the full sequence (tests.utils rule)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mop_train.parallel.ulysses import UlyssesAttention
from tests.dist_utils import backend_params, run_distributed, worker_device
from tests.utils import assert_close, assert_no_worse_than_torch, fresh_seed


class CausalGQA(torch.nn.Module):
    """Causal GQA attention, [B, S, h, d] layout; with doc_ids [B, S] also masked to each document."""

    def forward(self, q, k, v, doc_ids=None):
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        mask = None
        if doc_ids is not None:
            S = q.shape[1]
            causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            mask = (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]   # [B, 1, S, S]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=doc_ids is None)
        return out.transpose(1, 2)


def _doc_ids(B, S, g):
    """Sorted document ids [B, S]: a new document starts at about a third of the positions."""
    return torch.cumsum((torch.rand(B, S, generator=g) < 0.3).long(), dim=1)


def _full(q, k, v, gout, doc_ids=None):
    """Full-sequence attention on one rank: output and grads of q, k, v."""
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = CausalGQA()(*full, doc_ids)
    out.backward(gout)
    return [out.detach()] + [t.grad for t in full]


def _check_group(group, group_rank, D, B, S_per_rank, h, h_kv, d, dv, seed, device, atol, doc=False):
    """fp32: Ulysses over `group` (D ranks, this one at `group_rank`) equals full attention."""
    S = S_per_rank * D
    g = torch.Generator().manual_seed(fresh_seed(seed))
    q, k, v = (torch.randn(B, S, n, e, generator=g) for n, e in ((h, d), (h_kv, d), (h_kv, dv)))
    gout = torch.randn(B, S, h, dv, generator=g)
    doc_ids = _doc_ids(B, S, g).to(device) if doc else None
    q, k, v, gout = (t.to(device) for t in (q, k, v, gout))
    sl = slice(group_rank * S_per_rank, (group_rank + 1) * S_per_rank)
    truth = _full(q, k, v, gout, doc_ids)
    mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
    out = UlyssesAttention(CausalGQA(), group)(*mine, doc_ids)
    out.backward(gout[:, sl])
    for name, a, b in zip(("out", "grad q", "grad k", "grad v"), [out] + [t.grad for t in mine], truth):
        assert_close(a, b[:, sl], atol=atol, name=f"{name} D={D} doc={doc}")


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
    # A document mask covers the full sequence and reaches the core unchanged.
    _check_group(dist.group.WORLD, rank, world_size, 2, 3, 2 * world_size, world_size, 4, 4, seed + 1, device,
                 atol, doc=True)
    if world_size == 4:
        # Two sequence groups of 2 that are not the world, with interleaved ranks: every exchange must
        # stay inside the given group, and a rank's position is its rank in that group.
        # These groups are also the D = 2 case (the all-to-alls are one code path for every D; a world
        # of 2 would only add a spawn): with and without a document mask.
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[rank % 2]
        for doc in (False, True):
            _check_group(mine, dist.get_rank(mine), 2, 2, 3, 4, 2, 4, 6, seed + 2 + rank % 2 + 10 * doc, device,
                         atol, doc=doc)
    # Head counts that do not split over the group are refused, each on its own.
    D = world_size
    for h, h_kv in ((D + 1, D), (2 * D, 1)):
        q, k, v = torch.randn(1, 2, h, 4), torch.randn(1, 2, h_kv, 4), torch.randn(1, 2, h_kv, 4)
        with pytest.raises(ValueError, match=f"UlyssesAttention: q's {h} and k's {h_kv} heads must split over "
                                             f"the {D} ranks"):
            UlyssesAttention(CausalGQA(), dist.group.WORLD)(*(t.to(device) for t in (q, k, v)))


@pytest.mark.slow
# gloo at 3 (an odd D) and 4 (D = 4, and D = 2 in subgroups that are not the world); no world of 2 (see
# above). Each spawned rank pays torch's lazy imports, so the worlds are the fewest that reach every path.
@pytest.mark.parametrize("backend,world_size", backend_params([3, 4]))
def test_ulysses_equals_full_attention(backend, world_size):
    run_distributed(_ulysses_matches_full, world_size, torch.seed() % 10_000, backend=backend)


def test_without_a_group_calls_the_core_directly():
    g = torch.Generator().manual_seed(fresh_seed(21))
    B, S, h, h_kv, d = 2, 7, 4, 2, 8
    q, k, v = torch.randn(B, S, h, d, generator=g), torch.randn(B, S, h_kv, d, generator=g), \
        torch.randn(B, S, h_kv, d, generator=g)
    for doc_ids in (None, _doc_ids(B, S, g)):
        assert_close(UlyssesAttention(CausalGQA(), None)(q, k, v, doc_ids), CausalGQA()(q, k, v, doc_ids),
                     rtol=0, atol=0, name=f"no group, doc_ids={doc_ids is not None}")


def test_head_count_not_divisible_is_a_config_error():
    # imported here, not at the top: the models pull in torch._dynamo, which every spawned rank of the
    # test above would import for nothing (seconds per rank on CI's 2 cores)
    from mop_train.layout import plan_layout
    from mop_train.models import zoo
    from mop_train.parallel.parallelize import check_layout_fits
    gqa = zoo.get_model_args("gpt-oss-20b-shape")                    # 64 query heads, 8 key/value heads
    training = SimpleNamespace(seq_len=128)
    with pytest.raises(ValueError, match=r"key/value heads \(8\) must be divisible by mop.layout.seq_degree \(16\)"):
        check_layout_fits(plan_layout(16, 16, 1, 1), training, gqa)
    with pytest.raises(ValueError, match=r"valid seq_degree values: \[1, 2, 4, 8\]"):
        check_layout_fits(plan_layout(16, 16, 1, 1), training, gqa)
    check_layout_fits(plan_layout(16, 8, 1, 1), training, gqa)
