"""local.route_counts against torch.bincount (bitwise, random ids of every shape, empty included), and
the local MoE layer on CUDA without a host sync, forward and backward (marked gpu): the counts were
the one sync a step's local dispatch made (RESULTS.md 2026-12-03's 1 x 32K profile)."""

from __future__ import annotations

import random

import pytest
import torch

from mop_train.models.router import TopKRouter
from mop_train.ops.moe_dispatch.local import local_experts_forward, route_counts
from tests.utils import bf16_moe_layer, fresh_seed, no_host_syncs


def test_route_counts_are_bincounts():
    rng = random.Random(fresh_seed(7340))
    for _ in range(20):
        E = rng.randint(1, 70)
        shape = rng.choice([(rng.randint(0, 50), rng.randint(1, 8)), (rng.randint(0, 300),)])
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        # skewed ids: some experts get nothing, some many
        ids = (torch.rand(shape, generator=gen) ** rng.choice([1, 3]) * E).long().clamp_max(E - 1)
        ids = ids.to(rng.choice([torch.int32, torch.int64]))      # both id dtypes bincount takes
        got = route_counts(ids, E)
        want = torch.bincount(ids.reshape(-1), minlength=E)
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)


def test_router_load_and_aux_loss_count_routes_as_before():
    """The router's load record and auxiliary loss take their counts from route_counts: the same
    figures as bincount's, checked through the router itself."""
    gen = torch.Generator().manual_seed(fresh_seed(7341))
    router = TopKRouter(16, 12, 3, score_func="sigmoid", route_norm=True, route_scale=1.0)
    x = torch.randn(40, 16, generator=gen)
    indices, _, scores = router(x)
    router.tokens_per_expert.zero_()
    router.record_load(indices)
    counts = torch.bincount(indices.reshape(-1), minlength=12)
    assert torch.equal(router.tokens_per_expert, counts.to(router.tokens_per_expert.dtype))
    probs = scores / scores.sum(-1, keepdim=True)
    want = 0.01 * 12 * (counts.float() / indices.numel() * probs.mean(0)).sum()
    torch.testing.assert_close(router.aux_loss(scores, indices, 0.01), want, rtol=1e-6, atol=0)


@pytest.mark.gpu
def test_local_layer_on_cuda_makes_no_host_sync():
    """Routes counted, sorted, computed by grouped GEMMs and combined on the GPU: forward and backward
    of the local schedule in bf16 under set_sync_debug_mode("error")."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+ (elsewhere the per-expert loop reads the counts)")
    gen = torch.Generator().manual_seed(fresh_seed(7342))
    leaves = [t.detach().cuda().requires_grad_(t.requires_grad) for t in bf16_moe_layer(gen, 96, 64, 32, 8, 2)]
    x, w1, w2, w3, weights, indices = leaves
    grad = torch.randn(96, 64, generator=gen).cuda().bfloat16()
    torch.cuda.synchronize()
    with no_host_syncs():
        y = local_experts_forward(x, indices, weights, w1, w2, w3)
        y.backward(grad)
    torch.cuda.synchronize()
    assert all(t.grad is not None for t in (x, w1, w2, w3, weights))


@pytest.mark.gpu
def test_route_counts_on_cuda_equal_bincount_with_and_without_deterministic_algorithms():
    """On CUDA the counts are bincount's, also under torch.use_deterministic_algorithms (where torch
    runs index_add_ by its sort-based index_put_; --debug.deterministic sets it)."""
    gen = torch.Generator().manual_seed(fresh_seed(7343))
    ids = (torch.rand(4096, 6, generator=gen) ** 2 * 64).long().cuda()
    want = torch.bincount(ids.reshape(-1), minlength=64)
    assert torch.equal(route_counts(ids, 64), want)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(route_counts(ids, 64), want)
    finally:
        torch.use_deterministic_algorithms(before)
