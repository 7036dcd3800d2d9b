"""Group-sharded DTensor weights: row placement, replica gradient sums, and the global grad norm, on
gloo (CPU meshes, 2 and 4 ranks) and NCCL (CUDA meshes, 2 GPUs, marked gpu); fp32 throughout."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from mop_train.layout import RankLayout, plan_layout
from mop_train.parallel.sharding import (chunk_rows, clip_grad_norm_, local, reduce_replica_grads,
                                         shard_rows)
from tests.dist_utils import backend_params, run_distributed, worker_device
from tests.utils import assert_close, fresh_seed


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


def _sharded_weights(rank, world_size, seed):
    device = worker_device()  # the layout's meshes take the backend's device type (cuda under NCCL)
    for degree in (d for d in (1, 2, world_size) if world_size % d == 0):
        layout = RankLayout.build(plan_layout(world_size, 1, degree, degree))
        g = torch.Generator().manual_seed(fresh_seed(seed))
        V, H = 9, 6  # 9 rows over 2 or 4 ranks: uneven, and at 4 one chunk is short
        full_w = torch.randn(V, H, generator=g).to(device)
        dense = torch.randn(7, H, generator=g).to(device)
        p = shard_rows(full_w, layout.vocab_mesh)
        start, end = chunk_rows(V, degree, layout.vocab_rank)
        assert_close(local(p), full_w[start:end], rtol=0, atol=0, name="local rows")
        assert_close(p.full_tensor(), full_w, rtol=0, atol=0, name="full tensor")
        d = torch.nn.Parameter(distribute_tensor(dense, layout.mesh, [Shard(0)]))
        # Each rank contributes its own gradient; the reference sums them over the world.
        per_rank_w = [torch.randn(V, H, generator=g).to(device) for _ in range(world_size)]
        per_rank_d = torch.randn(7, H, generator=g).to(device)
        p.grad = torch.distributed.tensor.DTensor.from_local(
            per_rank_w[rank][start:end].clone(), layout.vocab_mesh, p.placements, run_check=False,
            shape=p.shape, stride=p.stride())
        d.grad = distribute_tensor(per_rank_d, layout.mesh, [Shard(0)])
        reduce_replica_grads([p], layout.vocab_replica_group)
        replicas = [r for grp in layout.plan.vocab_replica_groups if rank in grp for r in grp]
        summed = sum(per_rank_w[r] for r in replicas)
        assert_close(local(p.grad), summed[start:end], name="replica-summed grad")
        # Reference norm: every replica group position holds its own summed rows.
        full_grad = torch.cat([sum(per_rank_w[r] for r in grp)[slice(*chunk_rows(V, degree, j))]
                               for j, grp in enumerate(layout.plan.vocab_replica_groups)])
        ref_norm = torch.sqrt(full_grad.pow(2).sum() + per_rank_d.pow(2).sum())
        norm = clip_grad_norm_([p, d], max_norm=0.5)
        assert_close(norm, ref_norm, name="global norm")
        scale = min(1.0, 0.5 / (ref_norm.item() + 1e-6))
        assert_close(local(p.grad), summed[start:end] * scale, name="clipped sharded grad")
        assert_close(d.grad.full_tensor(), per_rank_d * scale, name="clipped dense grad")


@pytest.mark.slow
@pytest.mark.parametrize("backend,world_size", backend_params([2, 4]))
def test_sharded_weights_and_norm(backend, world_size):
    run_distributed(_sharded_weights, world_size, torch.seed() % 10_000, backend=backend)
