"""Routed SwiGLU experts on one rank, no communication: `dispatch="local"`.

Routes are sorted by expert (stable), the experts run as grouped matmuls over contiguous
per-expert row blocks, and outputs are scaled by their routing weight and summed back per token.
Every expert-parallel dispatch ends in `grouped_swiglu` on the rows it receives.

Legend: N tokens, H hidden, I expert hidden width, E experts (on this rank), k top-k, R = N*k routes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mop_train.ops.moe_dispatch.combine import gather_token_rows, permute_rows, sum_token_rows, token_slots
from mop_train.ops.moe_dispatch.comm import host_to_device


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _grouped_mm_supported(x: torch.Tensor, w1: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    # torch._grouped_mm needs every row stride to be a multiple of 16 bytes.
    if any((d * x.element_size()) % 16 for d in w1.shape[1:]):
        return False
    if x.device.type == "cuda":
        # The CUDA kernel needs sm90+ and bf16; other cases take the per-expert loop.
        return x.dtype == torch.bfloat16 and _sm90_or_newer(x.device.index if x.device.index is not None
                                                            else torch.cuda.current_device())
    # (ATen's CPU kernel takes fp32, bf16 and fp16; fp64 takes the per-expert loop)
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def route_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_experts] int64: how many of `indices` (expert ids, any shape) name each expert, on their
    device. torch.bincount gives the same counts but, on CUDA, reads the largest id back to the host to
    size its output: one host sync per MoE layer, which the 1 x 32K profile showed (RESULTS.md
    2026-12-03) and which stalls the launch queue where the step is host-bound (2 x 4K). Integer adds
    are exact in any order, so the counts are bitwise bincount's. Ids may be int32 or int64, as bincount's."""
    flat = indices.reshape(-1)
    ones = torch.ones(flat.shape, dtype=torch.int64, device=flat.device)   # index_add_ adds in self's dtype
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, ones)


def group_offsets(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor):
    """What `grouped_mm` takes as `groups`: int32 end offsets on x's device for torch._grouped_mm
    (one host-device copy without a host sync when the counts are on the host, reused by every
    matmul over the same blocks), else the counts on the CPU."""
    if _grouped_mm_supported(x, w):
        if counts.device.type == "cpu":
            return host_to_device(torch.cumsum(counts, 0).to(torch.int32), x.device)
        return torch.cumsum(counts.to(device=x.device), 0).to(torch.int32)
    return counts.cpu().long()


def grouped_mm(x: torch.Tensor, groups: torch.Tensor, w: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """Row block e of x times w[e]^T (transpose) or w[e].

    Args:
        x: [R, A] rows sorted by expert; groups: `group_offsets(x, counts, w)` of the [E] row counts.
        w: [E, B, A] if transpose else [E, A, B].
    Returns:
        [R, B]
    """
    wt = w.transpose(-2, -1) if transpose else w                  # [E, A, B]
    if x.shape[0] == 0:
        return x.new_zeros(0, wt.shape[-1])
    if groups.dtype == torch.int32:
        return torch._grouped_mm(x, wt, offs=groups)
    return torch.cat([xe @ wt[e] for e, xe in enumerate(x.split(groups.tolist()))])


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """SwiGLU over row blocks: rows [off_e, off_e + counts[e]) of x go through expert e.

    Args:
        x: [R, H] rows sorted by expert.
        counts: [E] int64 rows per expert (on any device), sum == R.
        w1, w3: [E, I, H]; w2: [E, H, I].
    Returns:
        [R, H]
    """
    if x.shape[0] == 0:
        # Keep the graph connected so every expert weight gets a (zero) gradient.
        return x.new_zeros(0, w2.shape[1]) + 0 * (w1.sum() + w2.sum() + w3.sum()).to(x.dtype)
    groups = group_offsets(x, counts, w1)
    h1 = grouped_mm(x, groups, w1, transpose=True)                # [R, I]
    h3 = grouped_mm(x, groups, w3, transpose=True)                # [R, I]
    return grouped_mm(F.silu(h1) * h3, groups, w2, transpose=True)  # [R, H]


def local_experts_forward(x, indices, weights, w1, w2, w3):
    """All E experts on this rank. x [N, H]; indices, weights [N, k] -> y [N, H]."""
    N, k = indices.shape
    E = w1.shape[0]
    flat = indices.reshape(-1)                                    # [R]
    order = torch.argsort(flat, stable=True)                      # [R] route ids sorted by expert
    counts = route_counts(flat, E)                                # [E], no host sync
    token = order // k                                            # [R] each row's token
    slots = token_slots(order, k)                                 # [N, k] row of each route
    rows = gather_token_rows(x, token, slots)                     # [R, H]; grad: a sum per token
    out = grouped_swiglu(rows, counts, w1, w2, w3)                # [R, H]
    route_w = permute_rows(weights.reshape(-1), order, slots.reshape(-1))     # [R] (inverse of order)
    out = out * route_w.unsqueeze(1).to(out.dtype)
    return sum_token_rows(out, slots, token)                      # [N, H]; `out` not saved
