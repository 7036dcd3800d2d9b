"""Weights sharded by a MoP group rather than by FSDP: expert weights over the expert group and
the output projection over the vocab group.

Each such weight becomes a DTensor on a 2-D mesh (replica, shard) with placements
[Replicate(), Shard(0)]: rank j of a group holds rows chunk j (torch.chunk sizes, i.e.
[j*ceil(R/G), min(R, (j+1)*ceil(R/G))), possibly empty), and the ranks at the same position of
every group hold the same rows. DCP then saves and reshards them like any other DTensor. Compute
uses the local tensor; after backward, `reduce_replica_grads` sums each local gradient over its
replica group (those ranks saw different tokens), one collective per parameter, and
`total_grad_norm` computes one global norm over FSDP DTensors and these from per-parameter terms
(`grad_norm_terms`, foreach kernels as torch's clip_grad_norm_), which the streamed-gradient path
computes the same way as gradients leave.
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
    """Sum each parameter's local gradient over `group` (ranks holding the same shard), in place:
    one collective per parameter, the same sum whether it runs after backward (here) or as each
    gradient becomes final ([mop.offload_adamw] gradients = "stream", `reduce_replica_grad`).

    `reduce_dtype`: the dtype the sum travels and accumulates in (the run's mixed-precision
    `reduce_dtype`, as FSDP2 reduces its own gradients); None keeps each gradient's dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for p in params:
        if p.grad is not None:
            reduce_replica_grad(local(p.grad), group, reduce_dtype=reduce_dtype)


def reduce_replica_grad(grad: torch.Tensor, group, *, reduce_dtype: torch.dtype | None = None) -> None:
    """Sum one local gradient over `group` in place, travelling in `reduce_dtype` (None: its own)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    flat = grad.reshape(-1).to(reduce_dtype or grad.dtype)
    dist.all_reduce(flat, group=group)
    if flat.data_ptr() != grad.data_ptr():
        grad.copy_(flat.view_as(grad))


def grad_norm_terms(grads: list[torch.Tensor], norm_type: float = 2.0) -> list[torch.Tensor]:
    """Each local gradient's share of the global norm, in order: ||g||_p^p (||g||_inf for p = inf),
    a 0-dim fp32 tensor on the gradient's device.

    One `_foreach_norm` and one `_foreach_pow` per (device, dtype) of the list, the kernels torch's own
    `clip_grad_norm_` uses, instead of two launches per gradient (at 2 x 4K on one H100 those launches
    left the device idle 3.3 ms a step: RESULTS.md 2026-12-07). A term depends on its own gradient
    only, never on the rest of its list: the foreach kernels reduce each tensor's chunks apart, and
    each list holds contiguous gradients of one device and dtype, so it takes the kernel path each
    would take alone (a non-contiguous gradient, which would send its whole list down the slow path,
    is a list of its own). The streamed path forms each term alone as its gradient leaves
    (`grad_norm_term`) and so gets the same bits; tests/test_sharding.py holds CUDA to it."""
    terms: list = [None] * len(grads)
    groups: dict = {}
    for i, grad in enumerate(grads):
        if grad.numel() == 0:  # an empty shard (a rank holding no rows) adds nothing, also to the inf norm
            terms[i] = torch.zeros((), dtype=torch.float32, device=grad.device)
        elif grad.is_contiguous():
            groups.setdefault((grad.device, grad.dtype), []).append(i)
        else:  # one off the foreach fast path would take its whole list off it: alone, as it is alone
            groups[("alone", i)] = [i]
    for members in groups.values():
        norms = torch._foreach_norm([grads[i] for i in members], norm_type, dtype=torch.float32)
        if not math.isinf(norm_type):
            norms = torch._foreach_pow(norms, norm_type)
        for i, term in zip(members, norms):
            terms[i] = term
    return terms


def grad_norm_term(grad: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """One local gradient's share of the global norm (`grad_norm_terms` of a list of one): the streamed
    path's term, formed as the gradient leaves the device, bit for bit the one `total_grad_norm` forms."""
    return grad_norm_terms([grad], norm_type)[0]


def _group_key(p: torch.Tensor):
    if isinstance(p, DTensor):
        return id(p.device_mesh), tuple(p.placements)
    return None


def total_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0, *, terms: dict | None = None) -> torch.Tensor:
    """Global gradient norm over parameters that live on different meshes (FSDP's and the MoP
    groups'), as a plain tensor. Plain (non-DTensor) parameters are treated as replicated on every rank.

    Per parameter, `grad_norm_term` of its local gradient, or `terms[id(param)]` when given there
    (gradients streamed to the host: computed as they left); per (mesh, placements), the terms are
    summed (max for inf) in parameter order and all-reduced over each mesh dimension the gradient is
    sharded on; the groups' sums are added and the p-th root taken."""
    inf = math.isinf(norm_type)
    params = list(params)
    formed = [p for p in params if not (terms is not None and id(p) in terms) and p.grad is not None]
    own = dict(zip(map(id, formed), grad_norm_terms([local(p.grad) for p in formed], norm_type)))
    groups: dict = {}
    for p in params:
        if terms is not None and id(p) in terms:
            term = terms[id(p)]
        elif id(p) in own:
            term = own[id(p)]
        else:
            continue
        groups.setdefault(_group_key(p), (p, []))[1].append(term)
    totals = []
    for p, group_terms in groups.values():
        stacked = torch.stack(group_terms)
        total = stacked.max() if inf else stacked.sum()
        if isinstance(p, DTensor):
            for dim, placement in enumerate(p.placements):
                if placement.is_shard():
                    dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                                    group=p.device_mesh.get_group(dim))
        totals.append(total)
    if not totals:
        return torch.tensor(0.0)
    stacked = torch.stack([t.to(totals[0].device) for t in totals])
    return stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor | None:
    """min(1, max_norm / total_norm), torch.nn.utils' rule (0-dim, on the norm's device); None when
    max_norm <= 0 (clipping off)."""
    if max_norm <= 0:
        return None
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_grads_with_norm_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm), torch.nn.utils' rule; max_norm <= 0 disables."""
    coef = clip_coefficient(max_norm, total_norm)
    if coef is None:
        return
    groups: dict = {}  # one foreach multiply per (device, dtype), each element as its own mul_ would give
    for p in params:
        if p.grad is not None:
            grad = local(p.grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device, dtype))


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`total_grad_norm`, then `clip_grads_with_norm_`; returns the norm (before clipping)."""
    params = list(params)
    total = total_grad_norm(params, norm_type)
    clip_grads_with_norm_(params, max_norm, total)
    return total
