"""PipelinedLLEP's chunked expert compute: GEMM passes per phase, bare and inside a checkpointed block,
the grouped weight-gradient sum, and exactness against the per-token reference (one process and
gloo ranks).

A "pass" is one GEMM over every route this rank computes: 2 * R' * H * I flops. The unchunked layer
costs 3 passes forward and 6 backward; a chunk that keeps no [R', I] activations costs 3 forward and
8 backward (h1 and h3 again). Inside a checkpointed block the block's recompute must add nothing.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from mop_train.ops.moe_dispatch import DispatchStats, ExpertDispatch, PipelinedLLEPOptions, moe_experts_forward
from mop_train.ops.moe_dispatch import llep
from mop_train.ops.moe_dispatch import local as local_dispatch
from mop_train.ops.moe_dispatch.chunked_experts import ExpertGradSum
from mop_train.ops.moe_dispatch.comm import host_to_device
from mop_train.ops.moe_dispatch.local import group_offsets
from mop_train.ops.moe_dispatch.reference import reference_experts_forward
from tests.dist_utils import run_distributed
from tests.utils import assert_close_to_scale, fresh_seed, no_host_syncs

K_TOP = 3


class GemmFlops(TorchDispatchMode):
    """Sums 2*m*n*k over mm / addmm(_) / bmm / _grouped_mm calls (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_", "bmm"):
            a, b = (args[1], args[2]) if name.startswith("addmm") else (args[0], args[1])
            self.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        elif name == "_grouped_mm":
            a, b = args[0], args[1]
            if a.dim() == 2 and b.dim() == 3:                      # rows grouped: [R, K] x [E, K, N]
                self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[-1]
            elif a.dim() == 2 and b.dim() == 2:                    # contraction grouped: [M, R] x [R, N]
                self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            else:
                raise NotImplementedError(f"_grouped_mm {tuple(a.shape)} x {tuple(b.shape)}")
        return out


class OpNames(TorchDispatchMode):
    """The names of the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def make_inputs(seed, n, h, i, e, world=1):
    gen = torch.Generator().manual_seed(fresh_seed(seed))
    ws = [torch.randn(e, *s, generator=gen) / s[1] ** 0.5 for s in ((i, h), (h, i), (i, h))]
    per_rank = []
    for _ in range(world):
        x = torch.randn(n, h, generator=gen)
        hot = torch.rand(n, K_TOP, generator=gen) < 0.5          # half the routes to experts 0..2
        idx = torch.stack([torch.randperm(e, generator=gen)[:K_TOP] for _ in range(n)])
        idx = torch.where(hot & (idx >= 3), idx % 3, idx)
        idx = torch.stack([torch.unique(r, sorted=False) if len(torch.unique(r)) == K_TOP
                           else torch.randperm(e, generator=gen)[:K_TOP] for r in idx])
        wts = torch.rand(n, K_TOP, generator=gen) + 0.1
        g = torch.randn(n, h, generator=gen)
        per_rank.append((x, idx, wts, g))
    return ws, per_rank


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def block_fn(options, idx, group, stats=None):
    """A pre-norm residual block around the expert layer, as the decoder's (the output of the
    expert layer is summed, never saved). `options` None is the local schedule."""
    def block(x, wts, w1, w2, w3):
        z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)      # saves x
        return x + moe_experts_forward(z, idx, wts, w1, w2, w3, options, group=group, stats=stats)
    return block


def run_phases(block, x, wts, ws, g, ckpt):
    """(output, grads of x, wts, w1..w3, forward GEMM flops, backward GEMM flops incl. recompute)."""
    xl, wl, *wl3 = leaves(x, wts, *ws)
    with GemmFlops() as fwd:
        y = checkpoint(block, xl, wl, *wl3, use_reentrant=False) if ckpt else block(xl, wl, *wl3)
    with GemmFlops() as bwd:
        (y * g).sum().backward()
    return y.detach(), [t.grad for t in (xl, wl, *wl3)], fwd.flops, bwd.flops


def reference_grads(block_args, x, idx, wts, ws, g):
    xl, wl, *wl3 = leaves(x, wts, *ws)
    z = xl * torch.rsqrt(xl.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = xl + reference_experts_forward(z, idx, wl, *wl3)
    (y * g).sum().backward()
    return y.detach(), [t.grad for t in (xl, wl, *wl3)]


@pytest.mark.parametrize("h,i", [(8, 12), (6, 10)])          # _grouped_mm on CPU; per-expert loop
def test_gemm_passes_bare_and_checkpointed(h, i):
    """K chunks: 3 passes forward, 8 backward, bare or checkpointed (the block's recompute runs no
    expert GEMM); the unchunked layer: 3 + 6 bare, 3 + 9 checkpointed. Values match the reference."""
    n, e = 40, 6
    ws, [(x, idx, wts, g)] = make_inputs(1, n, h, i, e)
    one_pass = 2 * n * K_TOP * h * i
    want_y, want_grads = reference_grads(None, x, idx, wts, ws, g)
    for opts, passes in [(PipelinedLLEPOptions(token_budget=7), {False: (3, 8), True: (3, 8)}),
                         (None, {False: (3, 6), True: (3, 9)})]:
        for ckpt in (False, True):
            stats = DispatchStats() if opts is not None else None
            y, grads, f, b = run_phases(block_fn(opts, idx, None, stats), x, wts, ws, g, ckpt)
            tag = f"{opts or 'local'} ckpt={ckpt} h={h} i={i}"
            assert (f / one_pass, b / one_pass) == passes[ckpt], tag
            if stats is not None:
                assert stats.num_chunks == 6, tag                      # ceil(40 / 7)
            assert_close_to_scale(y, want_y, name=f"y {tag}")
            for name, got, want in zip(("x", "wts", "w1", "w2", "w3"), grads, want_grads):
                assert_close_to_scale(got, want, name=f"grad {name} {tag}")


def test_output_saved_in_checkpoint_fails_loudly():
    """The recompute's skipped chunk output is NaN: a block that (against the contract) saved the
    expert layer's output would get NaN gradients, never silently wrong ones."""
    ws, [(x, idx, wts, g)] = make_inputs(2, 16, 8, 12, 6)

    def bad_block(x_, wts_, w1, w2, w3):
        return moe_experts_forward(x_, idx, wts_, w1, w2, w3, PipelinedLLEPOptions(token_budget=4)) ** 2

    xl, wl, *wl3 = leaves(x, wts, *ws)
    (checkpoint(bad_block, xl, wl, *wl3, use_reentrant=False) * g).sum().backward()
    assert torch.isnan(xl.grad).any()


def test_transformer_block_checkpointed():
    """The decoder's real block (attention + MoE with shared expert), checkpointed as training runs
    it: pipelined_llep's output and every parameter gradient equal local dispatch's."""
    # imported here, not at the top: the models pull in torch._dynamo, which every spawned rank of
    # test_pipelined_checkpointed_block_multi_rank would import for nothing (seconds per rank on CI)
    from mop_train.models import zoo
    from mop_train.models.attention import rope_cos_sin, rope_inv_freq
    from mop_train.models.model import TransformerBlock
    args = replace(zoo.get_model_args("debug"), n_dense_layers=0)
    torch.manual_seed(fresh_seed(3))
    ref = TransformerBlock(0, args)
    ref.init_weights()
    blk = TransformerBlock(0, args)
    blk.load_state_dict(ref.state_dict())
    blk.moe.dispatch = ExpertDispatch(PipelinedLLEPOptions(token_budget=5))
    B, S = 2, 12
    x = torch.randn(B, S, args.dim)
    rope = rope_cos_sin(torch.arange(S), rope_inv_freq(args.rope_dim, args.rope_theta))
    g = torch.randn(B, S, args.dim)
    outs = []
    for module, ckpt in ((ref, False), (blk, True)):
        xl = x.clone().requires_grad_(True)
        y = checkpoint(module, xl, rope, use_reentrant=False) if ckpt else module(xl, rope)
        (y * g).sum().backward()
        outs.append((y.detach(), xl.grad, {k: p.grad for k, p in module.named_parameters()}))
    (y0, gx0, p0), (y1, gx1, p1) = outs
    assert blk.moe.dispatch.stats.num_chunks == 5             # ceil(24 / 5): the layer's own stats, filled
    assert_close_to_scale(y1, y0, name="block y")
    assert_close_to_scale(gx1, gx0, name="block grad x")
    for k in p0:
        if p0[k] is not None:
            assert_close_to_scale(p1[k], p0[k], name=f"block grad {k}")


@pytest.mark.parametrize("h,i", [(8, 12), (6, 10)])
def test_grouped_weight_grads_match_per_expert(h, i):
    """ExpertGradSum: grouped (forced on CPU) == per-expert in-place, over chunks with empty experts and
    a chunk that fills every expert, with raw counts as groups (what `group_offsets` returns where
    torch._grouped_mm is not used), and switching paths between chunks either way keeps the sum."""
    gen = torch.Generator().manual_seed(fresh_seed(4))
    e = 5
    w = [torch.empty(e, i, h), torch.empty(e, h, i), torch.empty(e, i, h)]
    chunks = []
    for counts in ([3, 0, 4, 0, 1], [0, 0, 2, 5, 0], [1, 0, 1, 1, 1], [2, 1, 1, 3, 1]):
        R = sum(counts)
        x, go = torch.randn(R, h, generator=gen), torch.randn(R, h, generator=gen)
        dh1, a, dh3 = (torch.randn(R, i, generator=gen) for _ in range(3))
        chunks.append((x, torch.tensor(counts), dh1, go, a, dh3))
    aligned = (h * 4) % 16 == 0 and (i * 4) % 16 == 0                # torch._grouped_mm's stride rule
    modes = (False, True, "counts as groups", "grouped first", "per-expert first") if aligned else (False,)
    # Expert 1 gets no rows in the first three chunks (its sum must be exact zeros); the last fills all.
    for used in (chunks[:3], chunks):
        sums = {}
        for mode in modes:
            acc = ExpertGradSum(e, *w, grouped=mode if isinstance(mode, bool) else True)
            for j, (x, counts, dh1, go, a, dh3) in enumerate(used):
                if mode in ("grouped first", "per-expert first"):
                    acc.grouped = (j % 2 == 0) == (mode == "grouped first")
                groups = counts if mode == "counts as groups" else group_offsets(x, counts, w[0])
                with OpNames() as ops:
                    acc.add(x, groups, counts, dh1, go, a, dh3)
                assert ("_grouped_mm" in ops.names) == acc.grouped, (mode, j)   # the forced path ran
            sums[mode] = acc.take()
        want = [torch.zeros_like(t) for t in w]
        for x, counts, dh1, go, a, dh3 in used:
            for ex, (xe, d1, ge, ae, d3) in enumerate(zip(*(t.split(counts.tolist())
                                                             for t in (x, dh1, go, a, dh3)))):
                want[0][ex] += d1.t() @ xe
                want[1][ex] += ge.t() @ ae
                want[2][ex] += d3.t() @ xe
        for mode, got in sums.items():
            for name, a_, b_ in zip(("w1", "w2", "w3"), got, want):
                assert_close_to_scale(a_, b_, name=f"grouped={mode} d{name} over {len(used)} chunks")
            if len(used) == 3:
                assert all(torch.equal(t[1], torch.zeros_like(t[1])) for t in got), mode


def _dist_worker(rank, world):
    """Each rank: its tokens, its expert shard; checkpointed block and bare, against the reference
    on the full weights, and the GEMM passes over the routes this rank computed."""
    h, i, n, e = 8, 12, 14 + 3 * rank, 4 * world
    ws, per_rank = make_inputs(10 + world, 14 + 3 * (world - 1), h, i, e, world)
    M = e // world
    shard = [w[rank * M:(rank + 1) * M] for w in ws]
    x, idx, wts, g = (t[:n] for t in per_rank[rank])
    # The reference: each rank's layer on the full weights; shard grads sum over ranks.
    full = [torch.zeros_like(w) for w in ws]
    for r in range(world):
        xr, ir, wr, gr = (t[:14 + 3 * r] for t in per_rank[r])
        y_r, grads_r = reference_grads(None, xr, ir, wr, ws, gr)
        if r == rank:
            want_y, want_x, want_w = y_r, grads_r[0], grads_r[1]
        for f, gw in zip(full, grads_r[2:]):
            f += gw
    for opts in (PipelinedLLEPOptions(min_tokens_per_gemm=2, imbalance_threshold=1.0, token_budget=4),
                 PipelinedLLEPOptions(token_budget=5)):
        for ckpt in (False, True):
            stats = DispatchStats()
            block = block_fn(opts, idx, dist.group.WORLD, stats)
            y, grads, f, b = run_phases(block, x, wts, shard, g, ckpt)
            tag = f"rank {rank}/{world} {opts} ckpt={ckpt}"
            one_pass = 2 * sum(stats.chunk_received) * h * i
            assert (f, b) == (3 * one_pass, 8 * one_pass), (tag, f / max(one_pass, 1), b / max(one_pass, 1))
            assert_close_to_scale(y, want_y, name=f"y {tag}")
            assert_close_to_scale(grads[0], want_x, name=f"grad x {tag}")
            assert_close_to_scale(grads[1], want_w, name=f"grad wts {tag}")
            for name, got, f_ in zip(("w1", "w2", "w3"), grads[2:], full):
                assert_close_to_scale(got, f_[rank * M:(rank + 1) * M], name=f"grad {name} {tag}")
            if opts.imbalance_threshold == 1.0:
                assert stats.weight_transfer_bytes == stats.migrated_experts * 4 * 3 * h * i


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipelined_checkpointed_block_multi_rank(world):
    run_distributed(_dist_worker, world)


def _cuda_expert_weights(e, h, i):
    """w1, w2, w3 of e experts on CUDA in bf16 (their values are never read: only shape and device)."""
    return [torch.empty(e, i, h, device="cuda", dtype=torch.bfloat16),
            torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16),
            torch.empty(e, i, h, device="cuda", dtype=torch.bfloat16)]


def _cuda_chunk(gen, counts, h, i, want):
    """One chunk's rows (x, dh1, go, a, dh3) drawn on the CPU and returned on CUDA in bf16, after adding
    their fp32 per-expert dW (of the bf16-rounded values) to `want` [w1, w2, w3]."""
    R = int(counts.sum())
    x, go = torch.randn(R, h, generator=gen), torch.randn(R, h, generator=gen)
    dh1, a, dh3 = (torch.randn(R, i, generator=gen) for _ in range(3))
    for ex, (xe, d1, ge, ae, d3) in enumerate(zip(*(t.bfloat16().float().split(counts.tolist())
                                                   for t in (x, dh1, go, a, dh3)))):
        want[0][ex] += d1.t() @ xe
        want[1][ex] += ge.t() @ ae
        want[2][ex] += d3.t() @ xe
    return [t.cuda().bfloat16() for t in (x, dh1, go, a, dh3)]


@pytest.mark.gpu
def test_grouped_weight_grads_cuda_bf16():
    """On CUDA bf16 (sm90+: torch._grouped_mm) the grouped dW, with empty experts and unaligned row
    counts, is within bf16 rounding of the fp32 per-expert sum."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+")
    gen = torch.Generator().manual_seed(fresh_seed(5))
    e, h, i = 7, 64, 96
    w = _cuda_expert_weights(e, h, i)
    acc = ExpertGradSum(e, *w)
    want = [torch.zeros(t.shape) for t in w]
    for counts in ([3, 0, 17, 0, 1, 9, 0], [0, 0, 2, 5, 0, 0, 33]):
        counts = torch.tensor(counts)
        cuda = _cuda_chunk(gen, counts, h, i, want)
        groups = group_offsets(cuda[0], counts, w[0])
        assert groups.dtype == torch.int32                                   # the grouped path
        acc.add(cuda[0], groups, counts, *cuda[1:])
    for name, got, ref in zip(("w1", "w2", "w3"), acc.take(), want):
        assert got.dtype == torch.bfloat16
        assert_close_to_scale(got.float().cpu(), ref, rtol=2e-2, name=f"cuda grouped d{name}")


def nan_pool() -> torch.cuda.MemPool:
    """A private CUDA memory pool whose cached free memory reads NaN (small blocks and one large), so a
    kernel output that is allocated in it and never written shows up as NaN."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        junk = [torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
                for n in [1 << 19] * 8 + [32 << 20]]           # 8 x 1 MiB (small pool), 64 MiB (large)
        del junk
    return pool


@pytest.mark.gpu
def test_grouped_weight_grads_cuda_idle_experts_exact_zero():
    """On CUDA bf16 (sm90+) ExpertGradSum picks torch._grouped_mm by itself, and an expert with no rows
    in a chunk adds exactly nothing, also if its slice of the grouped output were left unwritten (the
    memory it is allocated from reads NaN; the sum zeroes those slices itself): an expert no chunk
    reached reads exact zeros, the others match the fp32 per-expert sum. With no chunk at all, take()
    gives zeros on the weights' device."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+")
    gen = torch.Generator().manual_seed(fresh_seed(6))
    e, h, i = 6, 64, 96
    w = _cuda_expert_weights(e, h, i)
    for got, ref in zip(ExpertGradSum(e, *w).take(), w):
        assert (got.device, got.dtype, got.shape) == (ref.device, ref.dtype, ref.shape)
        assert not got.any()
    pool = nan_pool()
    acc = ExpertGradSum(e, *w)
    want = [torch.zeros(t.shape) for t in w]
    # Every expert but 1 is idle in one chunk and busy in another; expert 1 gets no rows at all.
    with torch.cuda.use_mem_pool(pool):
        for counts in ([5, 0, 17, 0, 3, 9], [0, 0, 2, 11, 0, 6], [4, 0, 0, 1, 7, 0]):
            counts = torch.tensor(counts)
            cuda = _cuda_chunk(gen, counts, h, i, want)
            groups = group_offsets(cuda[0], counts, w[0])
            with OpNames() as ops:
                acc.add(cuda[0], groups, counts, *cuda[1:])
            assert "_grouped_mm" in ops.names, sorted(ops.names)              # chosen without forcing
            # The idle experts' slices are zeroed by the sum itself: torch._grouped_mm's output for an
            # empty group is unspecified (torch 2.11 on sm90 happens to write zeros there).
            assert ops.names & {"index_fill_", "index_put_", "masked_fill_", "fill_", "zero_"}, sorted(ops.names)
        sums = acc.take()
    for name, got, ref in zip(("w1", "w2", "w3"), sums, want):
        assert got.dtype == torch.bfloat16 and got.device == w[0].device
        assert not got[1].any(), f"d{name}: the expert with no rows is not exactly zero"
        assert_close_to_scale(got.float().cpu(), ref, rtol=2e-2, name=f"cuda grouped d{name}, idle experts")
    del cuda, groups, sums, acc                                   # the pool's tensors before the pool
    del pool


@pytest.mark.gpu
def test_host_copies_and_group_offsets_without_host_sync():
    """Counts, offsets and ids reach the GPU as queued copies: under set_sync_debug_mode("error"),
    host_to_device and group_offsets (counts on the host, or on x's GPU) make no host sync, and the
    offsets are the int32 cumulative counts on x's device. host_to_device to another device is a plain
    copy there; where the CUDA kernel is not used (fp32, fp16) group_offsets gives the counts on the CPU."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+")
    gen = torch.Generator().manual_seed(fresh_seed(7))
    counts = torch.tensor([3, 0, 17, 0, 1, 9, 0])
    x = torch.randn(int(counts.sum()), 64, generator=gen).to("cuda", torch.bfloat16)
    w = torch.empty(7, 96, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(50, generator=gen)[:5]
    dev_counts = counts.to("cuda")
    torch.cuda.synchronize()
    with no_host_syncs():
        got_ids = host_to_device(ids, "cuda")
        from_host = group_offsets(x, counts, w)
        from_dev = group_offsets(x, dev_counts, w)
    assert got_ids.device == x.device and torch.equal(got_ids.cpu(), ids)
    want = torch.cumsum(counts, 0).to(torch.int32)
    for tag, got in (("host counts", from_host), ("device counts", from_dev)):
        assert (got.device, got.dtype) == (x.device, torch.int32), tag
        assert torch.equal(got.cpu(), want), tag
    for device in ("cpu", "meta"):
        got = host_to_device(ids, device)
        assert (got.device.type, got.dtype, got.shape) == (device, ids.dtype, ids.shape)
    assert torch.equal(host_to_device(ids, "cpu"), ids)
    for dtype in (torch.float32, torch.float16):
        for c in (counts, dev_counts):
            got = group_offsets(x.to(dtype), c, w.to(dtype))
            assert (got.device.type, got.dtype) == ("cpu", torch.int64), (dtype, c.device)
            assert torch.equal(got, counts), (dtype, c.device)


@pytest.mark.gpu
def test_grouped_mm_support_asks_x_own_gpu(monkeypatch):
    """Whether torch._grouped_mm may run is asked of the GPU x lives on, not of the current device (on a
    host of several GPUs they can differ): with the current device patched to an index no GPU has, the
    sm90 check is asked about x.device.index, once, for bf16 x."""
    gen = torch.Generator().manual_seed(fresh_seed(8))
    x = torch.randn(5, 64, generator=gen).to("cuda", torch.bfloat16)
    w = torch.empty(3, 96, 64, device="cuda", dtype=torch.bfloat16)
    asked = []
    with monkeypatch.context() as m:
        m.setattr(local_dispatch, "_sm90_or_newer", lambda index: asked.append(index) or True)
        m.setattr(torch.cuda, "current_device", lambda: 12345)
        supported = local_dispatch._grouped_mm_supported(x, w)
    assert supported
    assert asked == [x.device.index]


def _general_planning(monkeypatch, options):
    """run_chunks at group size one through the planning every larger group runs (counts gathered to the
    host, the LLEP plan, the receive permutation) instead of `_plan_local_chunks`."""
    def general(indices, chunk_tokens, num_experts):
        plan, C, _ = llep.build_plan(indices, num_experts, None, options)
        return llep._plan_chunks(indices, plan, C, chunk_tokens, None)
    monkeypatch.setattr(llep, "_plan_local_chunks", general)


@pytest.mark.parametrize("membership", ["strided", "contiguous"])
def test_group_of_one_plans_without_host_reads_bit_for_bit(membership, monkeypatch):
    """PipelinedLLEP at group size one plans its chunks on the device (no count read back, rows already
    in slot order): y and every gradient bitwise what the general planning gives, in fp32 and bf16, with
    experts no route reaches, plain and under an activation checkpoint; the dispatch figures agree too."""
    rng = random.Random(fresh_seed(7341 + (membership == "contiguous")))
    for dtype in (torch.float32, torch.bfloat16):
        N, H, I, E = rng.randint(30, 90), 8 * rng.randint(1, 4), 8 * rng.randint(1, 3), rng.randint(3, 9)
        k, K = rng.randint(1, min(3, E)), rng.randint(1, 5)
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        x = torch.randn(N, H, generator=gen).to(dtype)
        ws = [(torch.randn(E, I, H, generator=gen) / H ** 0.5).to(dtype), (torch.randn(E, H, I, generator=gen)
              / I ** 0.5).to(dtype), (torch.randn(E, I, H, generator=gen) / H ** 0.5).to(dtype)]
        scores = torch.rand(N, E, generator=gen)
        scores[:, rng.randrange(E)] = -1.0                                  # an idle expert
        wts, idx = scores.topk(k, dim=1)
        grad = torch.randn(N, H, generator=gen).to(dtype)
        options = PipelinedLLEPOptions(token_budget=-(-N // K), max_chunks=K, membership=membership)
        results = []
        for general in (False, True):
            with monkeypatch.context() as m:
                if general:
                    _general_planning(m, options)
                for ckpt in (False, True):
                    leaves_ = [t.clone().requires_grad_() for t in (x, wts, *ws)]
                    stats = DispatchStats()

                    def layer(x_, w_, *ws_):
                        return moe_experts_forward(x_, idx, w_, *ws_, options, stats=stats)
                    y = checkpoint(layer, *leaves_, use_reentrant=False) if ckpt else layer(*leaves_)
                    y.backward(grad)
                    results.append((y.detach(), [t.grad for t in leaves_],
                                    (stats.num_chunks, stats.chunk_received, stats.chunk_sent)))
        for (y1, g1, s1), (y0, g0, s0) in zip(results[:2], results[2:]):
            assert torch.equal(y1, y0) and s1 == s0, (dtype, s1, s0)
            for name, a, b in zip(("x", "routing weights", "w1", "w2", "w3"), g1, g0):
                assert torch.equal(a, b), f"{dtype} grad of {name}"
    bad = idx.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match="indices hold expert ids outside"):
        moe_experts_forward(x, bad, wts, *ws, PipelinedLLEPOptions(token_budget=N))


@pytest.mark.gpu
def test_group_of_one_runs_without_host_syncs_on_cuda():
    """PipelinedLLEP at group size one on CUDA (bf16, grouped GEMMs, K = 3 chunks): forward and backward
    under set_sync_debug_mode("error") (no count read back, no idle-expert list, no chunk sizes read)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; this machine has none")
    gen = torch.Generator().manual_seed(fresh_seed(7343))
    N, H, I, E, k = 96, 64, 32, 8, 2
    x = torch.randn(N, H, generator=gen).bfloat16().cuda().requires_grad_()
    ws = [torch.randn(s, generator=gen).bfloat16().cuda().div(8).requires_grad_() for s in ((E, I, H), (E, H, I),
                                                                                          (E, I, H))]
    wts, idx = torch.rand(N, E, generator=gen).topk(k, dim=1)
    wts, idx = wts.cuda().requires_grad_(), idx.cuda()
    grad = torch.randn(N, H, generator=gen).bfloat16().cuda()
    options = PipelinedLLEPOptions(token_budget=N // 3, max_chunks=3)
    moe_experts_forward(x, idx, wts, *ws, options).backward(grad)           # warm-up: lazy inits may sync
    torch.cuda.synchronize()
    with no_host_syncs():
        moe_experts_forward(x, idx, wts, *ws, options).backward(grad)
    torch.cuda.synchronize()
