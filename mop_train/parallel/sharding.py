"""Weights sharded by a MoP group rather than by FSDP: expert weights over the expert group and
the output projection over the vocab group.

Each such weight becomes a DTensor on a 2-D mesh (replica, shard) with placements
[Replicate(), Shard(0)]: rank j of a group holds rows chunk j (torch.chunk sizes, i.e.
[j*ceil(R/G), min(R, (j+1)*ceil(R/G))), possibly empty), and the ranks at the same position of
every group hold the same rows. DCP then saves and reshards them like any other DTensor. Compute
uses the local tensor; after backward, `reduce_replica_grads` sums each local gradient over its
replica group (those ranks saw different tokens), and `clip_grad_norm_` computes one global norm
over FSDP DTensors and these.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from mop_train.ops.ring_dtp.ring import shard_bounds


def chunk_rows(num_rows: int, num_chunks: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk `index` when `num_rows` rows are cut like torch.chunk (ceil-sized).

    The same rule as Ring-DTP's vocabulary shards, which the sharded projection must match, so it
    is that one function."""
    return shard_bounds(num_rows, num_chunks, index)


def shard_rows(param: torch.Tensor, mesh) -> nn.Parameter:
    """A full (or meta) tensor -> Parameter DTensor [Replicate(), Shard(0)] on a (replica, shard) mesh."""
    if isinstance(param, DTensor):
        raise ValueError("shard_rows expects a plain tensor; this parameter is already a DTensor "
                         f"on mesh {param.device_mesh}")
    G = mesh.size(1)
    start, end = chunk_rows(param.shape[0], G, mesh.get_local_rank(1))
    local = param.detach()[start:end].clone()
    dt = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                            shape=param.shape, stride=param.stride())
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (differentiable), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def reduce_replica_grads(params: Iterable[torch.Tensor], group, *,
                         reduce_dtype: torch.dtype | None = None) -> None:
    """Sum each parameter's local gradient over `group` (ranks holding the same shard), in place,
    flattened into one buffer per dtype so the group pays one collective per dtype.

    `reduce_dtype`: the dtype the sum travels and accumulates in (the run's mixed-precision
    `reduce_dtype`, as FSDP2 reduces its own gradients); None keeps each gradient's dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1).to(reduce_dtype or dtype) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _mesh_key(p: torch.Tensor):
    return id(p.device_mesh) if isinstance(p, DTensor) else None


def total_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Global gradient norm over parameters that live on different meshes (FSDP's and the MoP
    groups'), as a plain tensor. Plain (non-DTensor) parameters are treated as replicated on every rank."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(_mesh_key(p), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return torch.tensor(0.0)
    stacked = torch.stack([n.float() for n in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grads_with_norm_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm), torch.nn.utils' rule; max_norm <= 0 disables."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local(p.grad).mul_(coef.to(local(p.grad).device, local(p.grad).dtype))


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`total_grad_norm`, then `clip_grads_with_norm_`; returns the norm (before clipping)."""
    params = list(params)
    total = total_grad_norm(params, norm_type)
    clip_grads_with_norm_(params, max_norm, total)
    return total
