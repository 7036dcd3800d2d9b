"""Expert-parallel dispatch schedules against the local schedule (options None) on the full expert weights.

Every rank builds the whole problem (all ranks' tokens and the full weights) from one seed, runs the
local schedule for each rank as the oracle, then runs the schedule under test on its own tokens and
its own expert shard. Checked: outputs, grads of x and routing weights, and this rank's expert-shard
grads against its slice of the summed full-weight grads — plain and under an outer non-reentrant
checkpoint (the decoder's) — in fp32; in bf16 the output and every gradient against local's own bf16
error. All cases run inside one spawn per world size: gloo on CPU at 2, 3, 4 ranks, and NCCL on 2 GPUs
(marked gpu).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from mop_train.ops.moe_dispatch import (DispatchStats, EPOptions, ExpertDispatch, LLEPOptions, PipelinedLLEPOptions,
                                        dispatch_options, max_received_bound, moe_experts_forward)
from mop_train.ops.moe_dispatch.llep_plan import llep_plan
from mop_train.ops.moe_dispatch.local import local_experts_forward
from mop_train.ops.moe_dispatch.reference import reference_experts_forward
from mop_train.ops.routing_profiles import PROFILES, routing_profile
from tests.dist_utils import backend_params, run_distributed, worker_device
from tests.utils import assert_close, assert_close_to_scale, assert_no_worse_than_torch, fresh_seed

H, I, E, K_TOP = 8, 12, 24, 4


def make_routing(kind: str, n: int, rank: int, world: int, gen: torch.Generator):
    """[n, k] expert ids for one source rank; ids are distinct per token except in 'one_expert'."""
    M = E // world
    if kind in PROFILES:
        return routing_profile(kind, n, E, K_TOP)[0]
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(n)]) \
            if n else torch.zeros(0, K_TOP, dtype=torch.long)
    if kind == "one_expert":        # everything to expert 0 (rank 0)
        return torch.zeros(n, K_TOP, dtype=torch.long)
    if kind == "skip_last_rank":    # no route reaches the last rank's experts
        pool = E - M
        return torch.stack([torch.randperm(pool, generator=gen)[:K_TOP] for _ in range(n)]) \
            if n else torch.zeros(0, K_TOP, dtype=torch.long)
    raise ValueError(kind)


def build_case(seed: int, tokens: list[int], kind: str, world: int, device="cpu"):
    """Full expert weights and every rank's (x, idx, wts, g), drawn on the CPU then moved to `device`."""
    gen = torch.Generator().manual_seed(fresh_seed(seed))
    w1 = torch.randn(E, I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    w3 = torch.randn(E, I, H, generator=gen) / H ** 0.5
    per_rank = []
    for r, n in enumerate(tokens):
        x = torch.randn(n, H, generator=gen)
        idx = make_routing(kind, n, r, world, gen)
        wts = torch.rand(n, K_TOP, generator=gen) + 0.1
        g = torch.randn(n, H, generator=gen)
        per_rank.append(tuple(t.to(device) for t in (x, idx, wts, g)))
    return tuple(w.to(device) for w in (w1, w2, w3)), per_rank


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def grad_of(t):
    """The gradient of a leaf; None (no path from the loss, e.g. zero tokens) reads as zeros."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def oracle(weights_full, per_rank):
    """Local schedule per rank on the full weights: outputs, x/weight grads, summed expert grads."""
    ws = [leaf(w) for w in weights_full]
    results = []
    for x, idx, wts, g in per_rank:
        xl, wl = leaf(x), leaf(wts)
        y = local_experts_forward(xl, idx, wl, *ws)
        (y * g).sum().backward()
        results.append((y.detach(), grad_of(xl), grad_of(wl)))
    return results, [grad_of(w) for w in ws]


def run_schedule(options, x, idx, wts, g, shards, group, outer_checkpoint, stats=None):
    """`options`: None (local) or a schedule's options; `stats`: a DispatchStats it fills."""
    xl, wl = leaf(x), leaf(wts)
    ws = [leaf(w) for w in shards]

    def layer(x_, w_, a, b, c):
        return moe_experts_forward(x_, idx, w_, a, b, c, options, group=group, stats=stats)

    if outer_checkpoint:
        y = checkpoint(layer, xl, wl, *ws, use_reentrant=False)
    else:
        y = layer(xl, wl, *ws)
    (y * g).sum().backward()
    return y.detach(), grad_of(xl), grad_of(wl), [grad_of(w) for w in ws]


def check_case(rank, world, options, seed, tokens, kind, outer_checkpoint, group=None):
    """`rank`, `world`: this rank's index in and the size of the expert group (WORLD by default)."""
    weights_full, per_rank = build_case(seed, tokens, kind, world, worker_device())
    expected, full_grads = oracle(weights_full, per_rank)
    M = E // world
    shards = [w[rank * M:(rank + 1) * M] for w in weights_full]
    x, idx, wts, g = per_rank[rank]
    y, gx, gw, gshards = run_schedule(options, x, idx, wts, g, shards, group or dist.group.WORLD,
                                      outer_checkpoint)
    tag = f"[{options} {kind} tokens={tokens} ckpt={outer_checkpoint} rank={rank}]"
    ey, egx, egw = expected[rank]
    assert_close_to_scale(y, ey, name=f"y {tag}")
    assert_close_to_scale(gx, egx, name=f"grad x {tag}")
    assert_close_to_scale(gw, egw, name=f"grad routing weights {tag}")
    for name, got, full in zip(("w1", "w2", "w3"), gshards, full_grads):
        want = full[rank * M:(rank + 1) * M]
        # An expert grad sums over every route to it, in a schedule-dependent order.
        assert_close_to_scale(got, want, name=f"grad {name} {tag}")


def ep_cases(world):
    n = [7 + 3 * r for r in range(world)]
    cases = [("random", n), ("one_expert", n), ("skip_last_rank", n),
             ("random", [0] + n[1:])]                     # rank 0 has no tokens: it only receives
    return cases


def _ep_worker(rank, world):
    for i, (kind, tokens) in enumerate(ep_cases(world)):
        for ckpt in (False, True):
            check_case(rank, world, EPOptions(), 100 + i, tokens, kind, ckpt)


def test_single_rank_schedules_are_local():
    """Group None (size 1): ep/llep are local; pipelined_llep still chunks its expert compute."""
    weights_full, per_rank = build_case(7, [9], "50/4", 1)
    x, idx, wts, g = per_rank[0]
    want = run_schedule(None, x, idx, wts, g, weights_full, None, False)
    for opts in [EPOptions(), LLEPOptions(), PipelinedLLEPOptions(token_budget=2),
                 PipelinedLLEPOptions(token_budget=4, membership="contiguous")]:
        for ckpt in (False, True):
            stats = DispatchStats()
            got = run_schedule(opts, x, idx, wts, g, weights_full, None, ckpt, stats)
            for a, b, name in zip(got[:3], want[:3], ("y", "grad x", "grad weights")):
                assert_close_to_scale(a, b, name=f"{opts} {name}")
            for a, b in zip(got[3], want[3]):
                assert_close_to_scale(a, b, name=f"{opts} expert grads")
            chunked = isinstance(opts, PipelinedLLEPOptions)
            assert stats.num_chunks == (-(-9 // opts.token_budget) if chunked else 1)
    assert_close_to_scale(want[0], reference_experts_forward(x, idx, wts, *weights_full), name="local vs reference")


def test_fp64_takes_the_per_expert_path_and_matches_the_reference():
    """ATen's CPU grouped GEMM refuses fp64; every schedule at group size 1 then runs the per-expert
    loop and equals the reference to fp64 rounding (it raised "Expected mat_a to be Float32, BFloat16 or
    Float16" before)."""
    gen = torch.Generator().manual_seed(fresh_seed(71))
    N, H, I, E, k = 13, 8, 16, 4, 2
    x = torch.randn(N, H, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    wts = torch.rand(N, k, generator=gen, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
          for shape in ((E, I, H), (E, H, I), (E, I, H))]
    g = torch.randn(N, H, generator=gen, dtype=torch.float64)
    want = reference_experts_forward(x, idx, wts, *ws)
    want_grads = torch.autograd.grad(want, (x, wts, *ws), g)
    for opts in (None, EPOptions(), LLEPOptions(), PipelinedLLEPOptions(token_budget=3)):
        y = moe_experts_forward(x, idx, wts, *ws, opts)
        assert y.dtype == torch.float64
        assert_close(y, want, rtol=1e-12, atol=1e-12, name=f"{opts} y")
        for name, a, b in zip(("x", "weights", "w1", "w2", "w3"), torch.autograd.grad(y, (x, wts, *ws), g),
                              want_grads):
            assert_close(a, b, rtol=1e-12, atol=1e-12, name=f"{opts} grad {name}")


def test_no_tokens_still_give_every_expert_weight_a_gradient():
    """A rank with no tokens still gives each expert weight a (zero) gradient, as data-parallel
    reductions of the expert weights expect one from every rank."""
    weights_full, per_rank = build_case(14, [0], "random", 1)
    x, idx, wts, _ = per_rank[0]
    ws = [leaf(w) for w in weights_full]
    moe_experts_forward(leaf(x), idx, leaf(wts), *ws, None).sum().backward()
    assert all(w.grad is not None and not w.grad.any() for w in ws)


def test_membership_shapes_the_chunks():
    """'strided' deals tokens round-robin (chunk sizes differ by at most one); 'contiguous' cuts runs of
    ceil(N/K) tokens (every chunk but the last is full). Read from the routes each chunk computed."""
    n = 10
    weights_full, per_rank = build_case(13, [n], "random", 1)
    x, idx, wts, _ = per_rank[0]
    for budget, membership in ((4, "strided"), (4, "contiguous"), (1, "contiguous")):
        stats = DispatchStats()
        opts = PipelinedLLEPOptions(token_budget=budget, membership=membership)
        moe_experts_forward(x, idx, wts, *weights_full, opts, stats=stats)
        sizes = [routes // K_TOP for routes in stats.chunk_received]
        K = len(sizes)
        assert K == stats.num_chunks > 1 and sum(sizes) == n, (membership, sizes)
        if membership == "strided":
            assert max(sizes) - min(sizes) <= 1, sizes
        else:
            assert sizes[:-1] == [-(-n // K)] * (K - 1), (budget, sizes)


@pytest.mark.parametrize("cls,settings,needles", [
    (PipelinedLLEPOptions, dict(token_budget=0), ["token_budget = 0", ">= 1"]),
    (PipelinedLLEPOptions, dict(token_budget=2.5), ["token_budget = 2.5", "integer"]),
    (PipelinedLLEPOptions, dict(max_chunks=0), ["max_chunks = 0", ">= 1"]),
    (PipelinedLLEPOptions, dict(membership="blocks"), ["membership = 'blocks'", "'strided'", "'contiguous'"]),
    (PipelinedLLEPOptions, dict(alpha=0.0), ["alpha = 0.0", "> 0"]),       # LLEP's checks run too
    (LLEPOptions, dict(alpha=-1.0), ["alpha = -1.0", "> 0"]),
    (LLEPOptions, dict(min_tokens_per_gemm=0), ["min_tokens_per_gemm = 0", ">= 1"]),
    (LLEPOptions, dict(imbalance_threshold=0.5), ["imbalance_threshold = 0.5", ">= 1.0"]),
    (LLEPOptions, dict(imbalance_threshold=True), ["imbalance_threshold = True"])])
def test_bad_options_are_refused_when_built(cls, settings, needles):
    """Each value is checked once, when the options are built, with the value and what it must be."""
    with pytest.raises(ValueError) as info:
        cls(**settings)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} missing from: {info.value}"


def test_options_pick_the_schedule_and_reject_anything_else():
    weights_full, per_rank = build_case(7, [4], "random", 1)
    x, idx, wts, _ = per_rank[0]
    PipelinedLLEPOptions(token_budget=1, max_chunks=1, min_tokens_per_gemm=1)   # the smallest legal values
    with pytest.raises(TypeError):
        LLEPOptions(token_budget=4)                     # a setting of another schedule
    with pytest.raises(TypeError):
        EPOptions(alpha=1.0)
    with pytest.raises(ValueError, match="'nccl'.*LLEPOptions"):
        moe_experts_forward(x, idx, wts, *weights_full, "nccl")
    with pytest.raises(ValueError, match="records no DispatchStats"):
        moe_experts_forward(x, idx, wts, *weights_full, None, stats=DispatchStats())
    with pytest.raises(ValueError, match="unknown dispatch 'nccl'"):
        dispatch_options("nccl", object())
    settings = SimpleNamespace(alpha=2.0, min_tokens_per_gemm=5, imbalance_threshold=1.5, token_budget=7,
                               max_chunks=3, membership="contiguous", bias_update_rate=0.1)
    assert dispatch_options("local", settings) is None
    assert dispatch_options("ep", settings) == EPOptions()
    assert dispatch_options("llep", settings) == LLEPOptions(alpha=2.0, min_tokens_per_gemm=5,
                                                             imbalance_threshold=1.5)
    assert dispatch_options("pipelined_llep", settings) == PipelinedLLEPOptions(
        alpha=2.0, min_tokens_per_gemm=5, imbalance_threshold=1.5, token_budget=7, max_chunks=3,
        membership="contiguous")


LLEP_SETTINGS = [dict(min_tokens_per_gemm=2, imbalance_threshold=1.0),   # relocates eagerly
                 dict(min_tokens_per_gemm=1000),                         # helpers only by forced remainder
                 dict(alpha=1.5, min_tokens_per_gemm=3)]
EAGER = LLEP_SETTINGS[0]


def _llep_worker(rank, world):
    n = [13 + 3 * r for r in range(world)]
    seed = fresh_seed(200)
    for p, kind in enumerate(PROFILES):
        seed += 1
        check_case(rank, world, LLEPOptions(**LLEP_SETTINGS[p % 3]), seed, n, kind, p == 3)
    for kind, tokens, opts in [("one_expert", n, LLEPOptions(**EAGER)),
                               ("skip_last_rank", n, LLEPOptions(imbalance_threshold=100.0)),  # last rank only sends
                               ("random", [0] + n[1:], LLEPOptions(**EAGER))]:              # rank 0 only receives
        seed += 1
        for ckpt in (False, True):
            check_case(rank, world, opts, seed, tokens, kind, ckpt)


def _check_pipelined_extras(rank, world, seed, tokens, kind, budget):
    """The receiver counter stays under E_p*k*c, and strided == contiguous membership."""
    device = worker_device()
    weights_full, per_rank = build_case(seed, tokens, kind, world, device)
    M = E // world
    shards = [w[rank * M:(rank + 1) * M] for w in weights_full]
    x, idx, wts, g = per_rank[rank]
    results, received = {}, {}
    for membership in ("strided", "contiguous"):
        stats = DispatchStats()
        opts = PipelinedLLEPOptions(**EAGER, token_budget=budget, membership=membership)
        results[membership] = run_schedule(opts, x, idx, wts, g, shards, dist.group.WORLD, False, stats)
        K = -(-max(tokens) // budget)
        assert stats.num_chunks == K > 1, (stats.num_chunks, K)
        assert len(stats.chunk_received) == K
        assert stats.received_bound == max_received_bound(world, K_TOP, budget)
        assert 0 < stats.last_chunk_max_received <= stats.received_bound, stats
        assert all(mine <= top for mine, top in zip(stats.chunk_received, stats.chunk_max_received))
        assert max(stats.chunk_max_received) == stats.last_chunk_max_received
        received[membership] = sum(stats.chunk_received)
    llep_stats = DispatchStats()
    run_schedule(LLEPOptions(**EAGER), x, idx, wts, g, shards, dist.group.WORLD, False, llep_stats)
    # Chunking moves no route to another destination: each rank receives what LLEP sends it.
    assert received["strided"] == received["contiguous"] == llep_stats.chunk_received[0]
    s, c = results["strided"], results["contiguous"]
    # Each expert's rows meet in other GEMM batches (the BLAS blocks by row count; cuBLAS picks other
    # kernels) and on CUDA index_add sums a token's routes by atomics: a few fp32 ulps of the tensor's
    # scale, not of each element (a seed gave 2.4e-6 on routing-weight grads of magnitude 8.9 on CPU).
    rtol = 1e-6 if device.type == "cpu" else 1e-5
    for name, a, b in zip(("y", "grad x", "grad weights"), s[:3], c[:3]):
        assert_close_to_scale(a, b, rtol=rtol, name=f"strided vs contiguous {name} [{kind}]")
    for a, b in zip(s[3], c[3]):      # chunk order changes the order of the expert-grad sums
        assert_close(a, b, atol=1e-5 * float(b.abs().max()),
                     name=f"strided vs contiguous expert grads [{kind}]")


def _pipelined_worker(rank, world):
    n = [13 + 3 * r for r in range(world)]               # K = ceil(max N / 3) does not divide N
    seed = fresh_seed(300)
    for p, kind in enumerate(PROFILES):
        seed += 1
        membership = ("strided", "contiguous")[p % 2]
        opts = PipelinedLLEPOptions(**LLEP_SETTINGS[p % 3], token_budget=3, membership=membership)
        check_case(rank, world, opts, seed, n, kind, p % 3 == 0)
    for kind, tokens in [("one_expert", n), ("random", [0] + n[1:])]:
        seed += 1
        for ckpt in (False, True):
            check_case(rank, world, PipelinedLLEPOptions(**EAGER, token_budget=4), seed, tokens, kind, ckpt)
    # The last rank only sends (no relocation, no routes to its experts); K_max binds (c_eff > c).
    check_case(rank, world, PipelinedLLEPOptions(imbalance_threshold=100.0, token_budget=2, max_chunks=3),
               seed + 1, n, "skip_last_rank", True)
    for kind in ("80/16", "50/4", "one_expert"):
        _check_pipelined_extras(rank, world, seed + 2, n, kind, budget=4)


def _subgroup_worker(rank, world):
    """Expert groups {0, 1} and {2, 3} of a 4-rank world: ranks map through the group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, sub_rank = groups[rank // 2], rank % 2
    n = [11, 14]
    for opts in [EPOptions(), LLEPOptions(**EAGER), PipelinedLLEPOptions(**EAGER, token_budget=4)]:
        check_case(sub_rank, 2, opts, 400 + rank // 2, n, "80/16", False, group=group)
    # The stats' max over destinations is the group's, not the world's: the two groups carry different
    # loads, so a max taken over the default group would give the light group the heavy one's figure.
    tokens = [[23, 19], [3, 2]][rank // 2]
    for opts in [EPOptions(), LLEPOptions(**EAGER), PipelinedLLEPOptions(**EAGER, token_budget=4)]:
        weights_full, per_rank = build_case(410 + rank // 2, tokens, "one_expert", 2)
        x, idx, wts, _ = per_rank[sub_rank]
        M = E // 2
        stats = DispatchStats()
        moe_experts_forward(x, idx, wts, *[w[sub_rank * M:(sub_rank + 1) * M] for w in weights_full], opts,
                            group=group, stats=stats)
        received = [None, None]
        dist.all_gather_object(received, stats.chunk_received, group=group)
        expected = [max(per_chunk) for per_chunk in zip(*received)]
        assert stats.chunk_max_received == expected, (opts.name, rank, stats.chunk_max_received, received)


def _ep_stats_case(rank, world):
    weights_full, per_rank = build_case(5, [9 + r for r in range(world)], "one_expert", world, worker_device())
    M = E // world
    x, idx, wts, g = per_rank[rank]
    # Through the layer's binding (options, group, stats), as the model calls it.
    dispatch = ExpertDispatch(EPOptions(), group=dist.group.WORLD)
    dispatch(x, idx, wts, *[w[rank * M:(rank + 1) * M] for w in weights_full])
    stats = dispatch.stats
    everything = sum(9 + r for r in range(world)) * K_TOP          # all routes land on rank 0
    assert stats.num_chunks == 1 and stats.last_chunk_max_received == everything
    assert stats.chunk_received == [everything if rank == 0 else 0]
    # EP computes every route on its owner: nothing relocated, no expert weights moved.
    assert (stats.relocated_routes, stats.migrated_experts, stats.weight_transfer_bytes) == (0, 0, 0), stats


def _no_tokens_anywhere(rank, world):
    for i, opts in enumerate([EPOptions(), LLEPOptions(**EAGER), PipelinedLLEPOptions(token_budget=2)]):
        check_case(rank, world, opts, 500 + i, [0] * world, "random", i == 2)


def _bf16_case(rank, world):
    """In bf16 each schedule's output is no worse against the fp32 truth than local's own (x1.5), and
    every gradient (x, routing weights, this rank's expert shards) passes the low-precision rule
    against local's bf16 run over all ranks' tokens (tests.utils.assert_no_worse_than_torch).

    The rule's max bound is 4x here, not 2x: pipelined_llep's backward recomputes the expert output
    and associates (g @ w2) * r where autograd forms (g * r) @ w2. It is as accurate on average (median
    rms ratio 1.0 over 600 draws of ~100 tokens) but its max error reached 3.75x PyTorch's in one."""
    weights_full, per_rank = build_case(600, [96 + 5 * r for r in range(world)], "80/16", world, worker_device())
    M = E // world
    mine = slice(rank * M, (rank + 1) * M)
    bf = lambda ts: [t.bfloat16() for t in ts]  # noqa: E731
    per_rank_bf = [(x.bfloat16(), idx, wts, g.bfloat16()) for x, idx, wts, g in per_rank]
    truth, truth_w = oracle(weights_full, per_rank)
    theirs, theirs_w = oracle(bf(weights_full), per_rank_bf)
    local_err = (theirs[rank][0].float() - truth[rank][0]).abs().max()
    x, idx, wts, g = per_rank_bf[rank]
    for opts in [EPOptions(), LLEPOptions(**EAGER), PipelinedLLEPOptions(**EAGER, token_budget=32)]:
        stats = DispatchStats()
        shards = [w[mine] for w in bf(weights_full)]
        y, gx, gw, gshards = run_schedule(opts, x, idx, wts, g, shards, dist.group.WORLD, False, stats)
        assert y.dtype == gx.dtype == torch.bfloat16 and gw.dtype == wts.dtype
        assert all(gs.dtype == torch.bfloat16 for gs in gshards)
        err = (y.float() - truth[rank][0]).abs().max()
        assert err <= 1.5 * local_err + 1e-6, (opts, float(err), float(local_err))
        tag = f"[{opts.name} bf16 K={stats.num_chunks} rank={rank}]"
        for name, ours, true, other in zip(("grad x", "grad routing weights"), (gx, gw), truth[rank][1:],
                                           theirs[rank][1:]):
            assert_no_worse_than_torch(ours, other, true, name=f"{name} {tag}", max_factor=4.0)
        for name, ours, true, other in zip(("w1", "w2", "w3"), gshards, truth_w, theirs_w):
            # K chunks add their expert grads into one bf16 buffer (as autograd sums K uses of a
            # weight): K - 1 more roundings of a partial sum, each within an ulp of the scale.
            slack = (stats.num_chunks - 1) * 2.0 ** -8 * float(true[mine].abs().max())
            assert_no_worse_than_torch(ours, other[mine], true[mine], name=f"grad {name} {tag}", slack=slack,
                                       max_factor=4.0)


def _llep_plan_and_bad_ids_case(rank, world):
    """LLEP's stats report the plan that llep_plan makes from the group's count matrix with the
    options given (each setting below changes the plan of the defaults), and expert ids outside the
    group's experts are refused by every rank with a ValueError."""
    M = E // world
    tokens = [13 + 3 * r for r in range(world)]
    for i, settings in enumerate(LLEP_SETTINGS + [dict(min_tokens_per_gemm=2, imbalance_threshold=100.0)]):
        weights_full, per_rank = build_case(700 + i, tokens, "80/16", world, worker_device())
        shards = [w[rank * M:(rank + 1) * M] for w in weights_full]
        x, idx, wts, _ = per_rank[rank]
        counts = torch.stack([torch.bincount(p[1].reshape(-1).cpu(), minlength=E) for p in per_rank])
        plan = llep_plan(counts, **settings)
        stats = DispatchStats()
        moe_experts_forward(x, idx, wts, *shards, LLEPOptions(**settings), group=dist.group.WORLD, stats=stats)
        copy_bytes = sum(w[0].numel() * w.element_size() for w in shards)
        got = (stats.num_chunks, stats.relocated_routes, stats.migrated_experts, stats.weight_transfer_bytes)
        assert got == (1, plan.relocated_routes, len(plan.transfers), len(plan.transfers) * copy_bytes), \
            (settings, got, plan)
    # A bad id on every rank, or on the last rank only: every rank raises, naming the ranks that hold one
    # (EP once raised on that rank alone, before its count exchange, and left the others waiting there).
    for opts in (EPOptions(), LLEPOptions(**EAGER), PipelinedLLEPOptions(**EAGER, token_budget=4)):
        for bad in (E, -1):
            for holders in (list(range(world)), [world - 1]):
                wrong = idx.clone()
                if rank in holders:
                    wrong[0, 0] = bad
                with pytest.raises(ValueError, match=rf"indices hold expert ids outside \[0, {E}\) on rank\(s\) "
                                                     rf"{re.escape(str(holders))}"):
                    moe_experts_forward(x, wrong, wts, *shards, opts, group=dist.group.WORLD)


def _int32_ids_case(rank, world):
    """Expert ids in int32 (what torch.bincount and route_counts take) give every schedule the int64
    ids' output and gradients; LLEP and PipelinedLLEP once failed in their count all-gather and route
    keys (index_add_/index_put_ of int64 into int32) at group size > 1."""
    weights_full, per_rank = build_case(800, [9 + 2 * r for r in range(world)], "80/16", world, worker_device())
    M = E // world
    shards = [w[rank * M:(rank + 1) * M] for w in weights_full]
    x, idx, wts, g = per_rank[rank]
    for opts in [EPOptions(), LLEPOptions(**EAGER), PipelinedLLEPOptions(**EAGER, token_budget=3)]:
        want = run_schedule(opts, x, idx, wts, g, shards, dist.group.WORLD, False)
        got = run_schedule(opts, x, idx.int(), wts, g, shards, dist.group.WORLD, opts.name == "pipelined_llep")
        tag = f"[{opts.name} int32 ids rank={rank}]"
        for name, a, b in zip(("y", "grad x", "grad routing weights"), got[:3], want[:3]):
            assert_close_to_scale(a, b, name=f"{name} {tag}")
        for name, a, b in zip(("w1", "w2", "w3"), got[3], want[3]):
            assert_close_to_scale(a, b, name=f"grad {name} {tag}")


def _all_schedules_worker(rank, world):
    _int32_ids_case(rank, world)
    _bf16_case(rank, world)
    _no_tokens_anywhere(rank, world)
    _ep_worker(rank, world)
    _ep_stats_case(rank, world)
    _llep_plan_and_bad_ids_case(rank, world)
    _llep_worker(rank, world)
    _pipelined_worker(rank, world)
    if world == 4:
        _subgroup_worker(rank, world)


@pytest.mark.slow
@pytest.mark.parametrize("backend,world", backend_params([2, 3, 4]))
def test_schedules_match_local(backend, world):
    """ep, llep and pipelined_llep against local: profiles, empty ranks, send-only ranks, K > 1."""
    run_distributed(_all_schedules_worker, world, backend=backend)


def test_pipelined_saves_no_expert_intermediates():
    """ChunkExperts keeps [rows, I] expert intermediates out of the saved set, and its saved
    inputs pass through an outer saved-tensor hook (what the decoder's checkpoint packs)."""
    weights_full, per_rank = build_case(11, [16], "30/4", 1)
    x, idx, wts, _ = per_rank[0]

    def saved_shapes(opts):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            moe_experts_forward(leaf(x), idx, leaf(wts), *[leaf(w) for w in weights_full], opts)
        return shapes

    intermediates = lambda shapes: [s for s in shapes if len(s) == 2 and s[1] == I]  # noqa: E731
    assert intermediates(saved_shapes(LLEPOptions()))              # the unchunked path saves them
    chunked = saved_shapes(PipelinedLLEPOptions(token_budget=4))
    assert not intermediates(chunked), chunked
    rows_saved = [s for s in chunked if len(s) == 2 and s[1] == H]  # each chunk's received rows
    assert len(rows_saved) >= 4, chunked                           # K = 16 / 4 chunks


class _LargeAllocations(TorchDispatchMode):
    """Counts op outputs of at least `numel` elements that own new memory (not views, not in place)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and t.numel()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and not t._is_view() \
                    and t.untyped_storage().data_ptr() not in given:
                self.count += 1
        return out


def test_pipelined_expert_grads_accumulate_once_per_layer():
    """A K-chunk backward allocates one gradient buffer per expert weight, as K = 1 does: each
    chunk adds its dW in place instead of making [E, I, H]-sized gradients that autograd sums."""
    h, i, e, n = 16, 32, 24, 48                            # n*k routes x max(h, i) < e*i*h
    gen = torch.Generator().manual_seed(fresh_seed(21))
    weights = [torch.randn(e, *s, generator=gen) / s[1] ** 0.5 for s in ((i, h), (h, i), (i, h))]
    x, g = torch.randn(n, h, generator=gen), torch.randn(n, h, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:K_TOP] for _ in range(n)])
    wts = torch.rand(n, K_TOP, generator=gen) + 0.1
    want = run_schedule(None, x, idx, wts, g, weights, None, False)
    counts = {}
    for budget in (n, n // 8):
        stats = DispatchStats()
        xl, wl, ws = leaf(x), leaf(wts), [leaf(w) for w in weights]
        y = moe_experts_forward(xl, idx, wl, *ws, PipelinedLLEPOptions(token_budget=budget), stats=stats)
        with _LargeAllocations(e * i * h) as big:
            (y * g).sum().backward()
        counts[stats.num_chunks] = big.count
        for got, ref in zip([xl.grad, wl.grad] + [w.grad for w in ws], want[1:3] + tuple(want[3])):
            assert_close(got, ref, atol=1e-5 * float(ref.abs().max()), name=f"grads K={stats.num_chunks}")
    assert counts == {1: 3, 8: 3}, counts
