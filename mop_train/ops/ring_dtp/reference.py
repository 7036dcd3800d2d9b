"""The plain spec Ring-DTP replaces: gather every vocabulary shard, form the full logits, cross-entropy.

    logits = X W^T            [N, V]   (the tensor Ring-DTP never forms)
    loss   = F.cross_entropy(logits, targets, ignore_index, reduction)

`reference_cross_entropy` is the single-device oracle; `reference_ring_dtp_cross_entropy` is the
same over a vocab group (all-gather of the shards, whose backward all-reduces the full weight
gradient and keeps this rank's rows). Both are the test oracle and `impl="reference"`.

Paper section 3.2. Legend: N tokens, H hidden, V vocab, P vocab-group size, S = ceil(V/P).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of hidden [N, H] against the full projection weight [V, H] (full logits)."""
    logits = hidden @ weight.t()                                        # [N, V]
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


class _GatherShards(torch.autograd.Function):
    """[rows, H] shard -> [V, H] full weight; backward sums every rank's gradient, keeps own rows."""

    @staticmethod
    def forward(ctx, shard, group, vocab_size, lo, hi):
        world = dist.get_world_size(group)
        rows = -(-vocab_size // world)                                  # S
        padded = shard.new_zeros(rows, shard.shape[1])
        padded[: hi - lo] = shard
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        ctx.group, ctx.lo, ctx.hi = group, lo, hi
        return torch.cat(parts)[:vocab_size]                            # [V, H]

    @staticmethod
    def backward(ctx, grad_full):
        grad_full = grad_full.contiguous()
        dist.all_reduce(grad_full, group=ctx.group)
        return grad_full[ctx.lo:ctx.hi].clone(), None, None, None, None


def reference_ring_dtp_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor,
                                     group, *, vocab_size: int, ignore_index: int = -100,
                                     reduction: str = "mean") -> torch.Tensor:
    """Same contract as `ring_dtp_cross_entropy`, computed from the full logits (fp32 loss)."""
    if group is None or dist.get_world_size(group) == 1:
        weight = weight_shard
    else:
        rows = -(-vocab_size // dist.get_world_size(group))
        rank = dist.get_rank(group)
        lo, hi = min(vocab_size, rank * rows), min(vocab_size, (rank + 1) * rows)
        weight = _GatherShards.apply(weight_shard, group, vocab_size, lo, hi)
    return reference_cross_entropy(hidden, weight, targets, ignore_index=ignore_index,
                                   reduction=reduction).float()
