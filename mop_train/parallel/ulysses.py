"""Ulysses sequence parallelism: trade a sequence shard for a head shard around attention.

Each of the D ranks of a sequence group holds S/D consecutive positions of the same sequences with
all heads. Before attention one all-to-all gives every rank the full sequence for h/D of the heads;
attention runs locally (causal, full length); a second all-to-all returns each rank its own
positions with all heads. Backward is the same two all-to-alls, reversed. Exact: attention per head
is unchanged, only where it runs moves. Heads split into D contiguous blocks, so with GQA each
block of h/D query heads travels with its own h_kv/D key/value heads. A document mask needs no
exchange: its doc_ids [B, S] already cover the full sequence, which is what the core sees.

Legend: B batch, S sequence length, D sequence-group size, h query heads, h_kv key/value heads,
d head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class _EvenAllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits along dim 0. Its adjoint is the same exchange: the
    gradient of the block this rank sent to rank j is the block rank j sends back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # empty_like would copy a non-contiguous layout
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/D, h, d] (my positions, all heads) -> [B, S, h/D, d] (all positions, my heads)."""
    D = dist.get_world_size(group)
    B, S_l, h, d = x.shape
    send = x.reshape(B, S_l, D, h // D, d).permute(2, 0, 1, 3, 4).contiguous()   # [D, B, S/D, h/D, d]
    recv = _EvenAllToAll.apply(send, group)                                      # [D(src), B, S/D, h/D, d]
    return recv.permute(1, 0, 2, 3, 4).reshape(B, D * S_l, h // D, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, h/D, d] (all positions, my heads) -> [B, S/D, h, d] (my positions, all heads)."""
    D = dist.get_world_size(group)
    B, S, h_l, d = x.shape
    send = x.reshape(B, D, S // D, h_l, d).permute(1, 0, 2, 3, 4).contiguous()   # [D(dst), B, S/D, h/D, d]
    recv = _EvenAllToAll.apply(send, group)                                      # [D(src head block), ...]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, S // D, D * h_l, d)


class UlyssesAttention(nn.Module):
    """Wraps a core attention `inner(q, k, v) -> out` ([B, S, h, d] layout) for a sequence group.

    q [B, S/D, h, d_qk], k [B, S/D, h_kv, d_qk], v [B, S/D, h_kv, d_v] -> [B, S/D, h, d_v].
    doc_ids: None, or [B, S] document ids of the FULL sequence, passed to `inner` unchanged.
    At group size 1 it calls `inner` directly.
    """

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = () if doc_ids is None else (doc_ids,)
        if self.group is None or dist.get_world_size(self.group) == 1:
            return self.inner(q, k, v, *extra)
        D = dist.get_world_size(self.group)
        if q.shape[2] % D or k.shape[2] % D:  # a job's head counts are checked at config time (check_layout_fits)
            raise ValueError(f"UlyssesAttention: q's {q.shape[2]} and k's {k.shape[2]} heads must split over "
                             f"the {D} ranks of the sequence group")
        out = self.inner(_seq_to_heads(q, self.group), _seq_to_heads(k, self.group),
                         _seq_to_heads(v, self.group), *extra)                   # [B, S, h/D, d_v]
        return _heads_to_seq(out, self.group)
