"""Group-sharded DTensor weights: row placement, replica gradient sums, and the global grad norm, on
gloo (CPU meshes, 2 and 4 ranks) and NCCL (CUDA meshes, 2 GPUs, marked gpu); fp32 throughout. The norm
and clipping rules themselves are also checked in-process on plain tensors against torch.nn.utils."""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mop_train.layout import RankLayout, plan_layout
from mop_train.parallel.sharding import (chunk_rows, clip_grad_norm_, local, reduce_replica_grads,
                                         shard_rows, total_grad_norm)
from tests.dist_utils import backend_params, run_distributed, worker_device
from tests.utils import assert_bitwise_equal, assert_close, dispatched_ops, fresh_seed


def test_chunk_rows_matches_torch_chunk_and_spec():
    for rows in (0, 1, 5, 9, 10, 16):
        for g in (1, 2, 3, 4):
            pieces = torch.arange(rows).chunk(g) if rows else ()
            for j in range(g):
                start, end = chunk_rows(rows, g, j)
                size = -(-rows // g)
                assert (start, end) == (min(rows, j * size), min(rows, (j + 1) * size))
                expected = pieces[j].tolist() if j < len(pieces) else []
                assert list(range(start, end)) == expected


def _plain_params_with_grads(g, grad_scale=1.0):
    """Plain tensors (replicated, no mesh) of odd shapes with random grads, and one without a grad."""
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((5, 3), (7,), (2, 3, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * grad_scale
    return params + [torch.nn.Parameter(torch.randn(4, generator=g))]


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


def _copies(params):
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(out, params):
        c.grad = None if p.grad is None else p.grad.clone()
    return out


def test_clip_grad_norm_of_plain_tensors_matches_torch():
    g = torch.Generator().manual_seed(fresh_seed(11))
    for norm_type in (2.0, 1.0, 3.0, math.inf):
        for clip_ratio in (0.3, 4.0):  # max_norm below the norm (clips) and above it (leaves grads alone)
            ours = _plain_params_with_grads(g)
            theirs = _copies(ours)
            max_norm = clip_ratio * torch.nn.utils.get_total_norm(_grads(theirs), norm_type).item()
            ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
            norm = clip_grad_norm_(ours, max_norm, norm_type)
            assert_close(norm, ref, name=f"norm p={norm_type}")
            for a, b in zip(ours, theirs):
                assert (a.grad is None) == (b.grad is None)
                if a.grad is not None:
                    assert_close(a.grad, b.grad, name=f"clipped grad p={norm_type} ratio={clip_ratio}")
    # total_grad_norm defaults to the 2-norm, as torch's does (the training loop relies on the default).
    params = _plain_params_with_grads(g)
    assert_close(total_grad_norm(params), torch.nn.utils.get_total_norm(_grads(params)), name="default norm")


def test_clip_grad_norm_edge_cases():
    g = torch.Generator().manual_seed(fresh_seed(12))
    # max_norm <= 0 disables clipping: the norm is still returned, every grad is left as it was.
    params = _plain_params_with_grads(g)
    before = _copies(params)
    norm = clip_grad_norm_(params, 0.0)
    assert_close(norm, torch.nn.utils.get_total_norm(_grads(before)), name="norm")
    for a, b in zip(params, before):
        if a.grad is not None:
            assert_bitwise_equal(a.grad, b.grad, name="unclipped grad at max_norm=0")
    # A norm far below max_norm (even below the 1e-6 guard) never scales a gradient up or flips its sign.
    params = _plain_params_with_grads(g, grad_scale=1e-8)
    before = _copies(params)
    clip_grad_norm_(params, 1.0)
    for a, b in zip(params, before):
        if a.grad is not None:
            assert_close(a.grad, b.grad, rtol=1e-6, atol=0, name="tiny grad")
    # No gradient at all: the norm of nothing is zero and nothing is touched.
    no_grads = [torch.nn.Parameter(torch.randn(3, generator=g))]
    assert total_grad_norm(no_grads).item() == 0.0
    assert clip_grad_norm_(no_grads, 1.0).item() == 0.0
    assert no_grads[0].grad is None


def _sharded_grad(per_rank, rank, param, mesh, rows):
    return DTensor.from_local(per_rank[rank][slice(*rows)].clone(), mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _sharded_weights(rank, world_size, seed):
    device = worker_device()  # the layout's meshes take the backend's device type (cuda under NCCL)
    for degree in (d for d in (1, 2, world_size) if world_size % d == 0):
        layout = RankLayout.build(plan_layout(world_size, 1, degree, degree))
        mesh = layout.vocab_mesh
        g = torch.Generator().manual_seed(fresh_seed(seed))
        # 9 rows over 2 or 4 ranks: uneven, and at 4 one chunk is short; 5 rows over 4: one chunk is empty.
        V, V2, H = 9, 5, 6
        full_w = torch.randn(V, H, generator=g).to(device)
        full_w2 = torch.randn(V2, H, generator=g).to(device)
        dense = torch.randn(7, H, generator=g).to(device)
        p = shard_rows(full_w, mesh)
        p2 = shard_rows(full_w2.clone().requires_grad_(), mesh)
        assert not p.requires_grad and p2.requires_grad, "shard_rows must keep requires_grad"
        rows, rows2 = chunk_rows(V, degree, layout.vocab_rank), chunk_rows(V2, degree, layout.vocab_rank)
        assert_close(local(p), full_w[slice(*rows)], rtol=0, atol=0, name="local rows")
        assert_close(p.full_tensor(), full_w, rtol=0, atol=0, name="full tensor")
        assert_close(p2.full_tensor(), full_w2, rtol=0, atol=0, name="full tensor, 5 rows")
        # Deferred init: a meta tensor shards without data (nothing to check or exchange).
        meta = shard_rows(torch.empty(V, H, device="meta"), mesh)
        assert local(meta).is_meta and local(meta).shape == (rows[1] - rows[0], H)
        # Each rank keeps the rows of its own tensor: shard_rows exchanges nothing (no run_check broadcast).
        own = full_w + rank
        assert_close(local(shard_rows(own, mesh)), own[slice(*rows)], rtol=0, atol=0, name="own rows")
        with pytest.raises(ValueError, match="^shard_rows expects a plain tensor"):
            shard_rows(p, mesh)
        d = torch.nn.Parameter(distribute_tensor(dense, layout.mesh, [Shard(0)]))
        bias = torch.nn.Parameter(torch.randn(H, generator=g).to(device))  # plain: replicated on every rank
        # Each rank contributes its own gradient; the reference sums them over the world.
        per_rank_w = [torch.randn(V, H, generator=g).to(device) for _ in range(world_size)]
        per_rank_w2 = [torch.randn(V2, H, generator=g).to(device) for _ in range(world_size)]
        per_rank_d = torch.randn(7, H, generator=g).to(device)
        p.grad = _sharded_grad(per_rank_w, rank, p, mesh, rows)
        p2.grad = _sharded_grad(per_rank_w2, rank, p2, mesh, rows2)
        d.grad = distribute_tensor(per_rank_d, layout.mesh, [Shard(0)])
        bias.grad = torch.randn(H, generator=g).to(device)
        mine = [local(p.grad).clone(), local(p2.grad).clone()]
        reduce_replica_grads([p, p2, bias], None)  # no group: nothing to sum
        assert_bitwise_equal(local(p.grad), mine[0], name="grad after reducing over no group")
        replicas = [r for grp in layout.plan.vocab_replica_groups if rank in grp for r in grp]
        if len(replicas) == 1:  # a group of one: nothing to sum, so no rounding to reduce_dtype either
            reduce_replica_grads([p, p2, bias], layout.vocab_replica_group, reduce_dtype=torch.bfloat16)
            assert_bitwise_equal(local(p.grad), mine[0], name="grad after a group of one")
        # The sum travels in reduce_dtype: in float64 the sum of <= 4 fp32 values is exact, so each
        # summed grad is that exact sum rounded once to fp32 (an fp32 ring sum rounds at every hop).
        # The plain bias has the same grad on every rank, so its sum stays replicated.
        bias_grad = bias.grad.clone()
        reduce_replica_grads([p, p2, bias], layout.vocab_replica_group, reduce_dtype=torch.float64)
        summed = sum(per_rank_w[r].double() for r in replicas).float()
        summed2 = sum(per_rank_w2[r].double() for r in replicas).float()
        bias_grad = (bias_grad.double() * len(replicas)).float()
        assert_bitwise_equal(bias.grad, bias_grad, name="replica-summed plain grad")
        assert_bitwise_equal(local(p.grad), summed[slice(*rows)], name="replica-summed grad")
        assert_bitwise_equal(local(p2.grad), summed2[slice(*rows2)], name="replica-summed grad, 5 rows")
        # Reference norm: every replica group position holds its own summed rows.
        full_grads = [torch.cat([sum(per_rank[r] for r in grp)[slice(*chunk_rows(len(per_rank[0]), degree, j))]
                                 for j, grp in enumerate(layout.plan.vocab_replica_groups)])
                      for per_rank in (per_rank_w, per_rank_w2)]
        ref_norm = torch.sqrt(sum(t.pow(2).sum() for t in full_grads + [per_rank_d, bias_grad]))
        norm = clip_grad_norm_([p, p2, d, bias], max_norm=0.5)
        assert_close(norm, ref_norm, name="global norm")
        scale = min(1.0, 0.5 / (ref_norm.item() + 1e-6))
        assert_close(local(p.grad), summed[slice(*rows)] * scale, name="clipped sharded grad")
        assert_close(local(p2.grad), summed2[slice(*rows2)] * scale, name="clipped sharded grad, 5 rows")
        assert_close(d.grad.full_tensor(), per_rank_d * scale, name="clipped dense grad")
        assert_close(bias.grad, bias_grad * scale, name="clipped plain grad")


@pytest.mark.slow
@pytest.mark.parametrize("backend,world_size", backend_params([2, 4]))
def test_sharded_weights_and_norm(backend, world_size):
    run_distributed(_sharded_weights, world_size, torch.seed() % 10_000, backend=backend)


def _ragged_grads(device, seed):
    """Random gradients of sizes on both sides of the foreach kernels' 65,536-element chunk, in fp32 and
    bf16, with an empty one (a rank holding no rows)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3,), (257, 300), (70_001,), (2, 65_536), (0, 8), (1,), (513, 129)]
    grads = [torch.randn(s, generator=g) * (1 + k) for k, s in enumerate(shapes)]
    grads += [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes[:4]]
    grads = [t.to(device) for t in grads]
    return grads + [torch.randn(300, 257, generator=g).to(device).t()]  # non-contiguous: a list of its own


def _count_ops(fn):
    return [name for name, _ in dispatched_ops(fn)]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_norm_terms_come_from_one_foreach_launch_per_dtype_and_match_torch(norm_type):
    from mop_train.parallel.sharding import grad_norm_term, grad_norm_terms
    grads = _ragged_grads("cpu", fresh_seed())
    terms = grad_norm_terms(grads, norm_type)
    for grad, term in zip(grads, terms):
        want = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32) if grad.numel() else torch.zeros(())
        want = want if math.isinf(norm_type) else want.pow(norm_type)
        assert term.dtype == torch.float32 and term.dim() == 0
        assert_close(term, want, name=f"term of a {tuple(grad.shape)} {grad.dtype} gradient, p={norm_type}")
        # the streamed path's term, formed alone, is the same bits as the one formed in the list
        assert_bitwise_equal(grad_norm_term(grad, norm_type), term, name="a term alone against in its list")
    calls = _count_ops(lambda: grad_norm_terms(grads, norm_type))
    # fp32, bf16, and the non-contiguous gradient alone
    assert calls.count("_foreach_norm") == 3 and "linalg_vector_norm" not in calls, calls
    assert calls.count("_foreach_pow") == (0 if math.isinf(norm_type) else 3), calls


def test_clipping_is_one_foreach_multiply_per_dtype_and_the_same_bits_as_one_by_one():
    grads = _ragged_grads("cpu", fresh_seed())
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = total_grad_norm(params)
    calls = _count_ops(lambda: total_grad_norm(params))
    assert calls.count("_foreach_norm") == 3 and "linalg_vector_norm" not in calls, calls
    from mop_train.parallel.sharding import clip_coefficient, clip_grads_with_norm_
    max_norm = 0.25 * total.item()  # clips: the coefficient is about 1/4
    coef = clip_coefficient(max_norm, total)
    calls = _count_ops(lambda: clip_grads_with_norm_(params, max_norm, total))
    assert calls.count("_foreach_mul_") == 2 and "mul_" not in calls, calls
    for p, g in zip(params, grads):
        assert_bitwise_equal(p.grad, g.mul_(coef.to(g.dtype)), name=f"clipped {tuple(g.shape)} {g.dtype}")


@pytest.mark.gpu
def test_norm_terms_on_cuda_do_not_depend_on_their_list():
    """On CUDA `_foreach_norm` takes its fast path: the terms formed in one list (the device-gradient
    path) must be bit for bit those formed one gradient at a time (the streamed path), and the clipped
    gradients those of one multiply each."""
    from mop_train.parallel.sharding import clip_coefficient, clip_grads_with_norm_, grad_norm_term, grad_norm_terms
    grads = _ragged_grads("cuda", fresh_seed())
    for norm_type in (2.0, 1.0, math.inf):
        together = grad_norm_terms(grads, norm_type)
        for k, (grad, term) in enumerate(zip(grads, together)):
            assert_bitwise_equal(grad_norm_term(grad, norm_type), term, name=f"gradient {k}, p={norm_type}")
            assert_bitwise_equal(grad_norm_terms(grads[k:] + grads[:k], norm_type)[0], term,
                                 name=f"gradient {k} first in its list, p={norm_type}")
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = total_grad_norm(params)
    clip_grads_with_norm_(params, 0.25 * total.item(), total)
    coef = clip_coefficient(0.25 * total.item(), total)
    for p, g in zip(params, grads):
        assert_bitwise_equal(p.grad, g * coef.to(g.dtype), name=f"clipped {tuple(g.shape)} {g.dtype}")
