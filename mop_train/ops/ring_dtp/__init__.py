"""Ring-DTP: exact vocabulary projection + cross-entropy when the batch and the weight are both sharded.

Each rank of the vocab group holds its own distinct tokens X [N, H] (with targets [N]) and one
contiguous shard of the V x H output projection. A token's loss needs only three fp32 scalars
(running max, running sum of exponentials, target logit), so shards are visited block by block
with an online log-sum-exp and the N x V logits never exist. Over P rounds either the shards or the
activations travel the ring ("auto": weights move exactly when N_max > ceil(V/P)); backward replays
the rounds on recomputed logits and the moving tensor's gradient travels back to its owner.

Paper section 3.2 (Ring-DTP). Legend: N tokens (this rank), H hidden, V vocab, P vocab-group size,
S = ceil(V/P) shard rows, b block rows.
"""

from __future__ import annotations

import torch

from mop_train.ops.ring_dtp.function import RingDTPCrossEntropy, RingDTPOptions
from mop_train.ops.ring_dtp.memory import (MODES, resolve_mode, ring_dtp_largest_tensor_bytes,
                                           ring_dtp_peak_bytes)
from mop_train.ops.ring_dtp.reference import reference_cross_entropy, reference_ring_dtp_cross_entropy
from mop_train.ops.ring_dtp.ring import Ring

REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("triton", "torch", "reference")


def _validate(hidden, weight_shard, targets, ring: Ring, reduction, block_size, impl) -> None:
    if hidden.dim() != 2 or weight_shard.dim() != 2 or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight_shard [rows, H] with the same H; got "
                         f"{tuple(hidden.shape)} and {tuple(weight_shard.shape)}")
    if not (hidden.dtype.is_floating_point and weight_shard.dtype.is_floating_point):
        raise ValueError(f"hidden ({hidden.dtype}) and weight_shard ({weight_shard.dtype}) must be floating "
                         f"point; the products run in hidden's dtype")
    if targets.shape != (hidden.shape[0],) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be integer [{hidden.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    lo, hi = ring.shard_bounds(ring.rank)
    if weight_shard.shape[0] != hi - lo:
        raise ValueError(f"weight_shard has {weight_shard.shape[0]} rows but group rank {ring.rank} of "
                         f"{ring.size} owns vocabulary rows [{lo}, {hi}) of vocab_size={ring.vocab_size}; "
                         f"pass rows [r*ceil(V/P), min(V, (r+1)*ceil(V/P)))")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1 (vocabulary rows per logits block)")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS} (or None: triton on CUDA, torch otherwise)")


def _check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise ValueError(f"target {value} is outside [0, vocab_size={vocab_size}) and is not "
                         f"ignore_index={ignore_index}; fix the labels or the vocab_size")


def ring_dtp_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor, group=None,
                           *, vocab_size: int, mode: str = "auto", ignore_index: int = -100,
                           reduction: str = "mean", block_size: int = 8192, impl: str | None = None) -> torch.Tensor:
    """Cross-entropy of this rank's tokens against the whole vocabulary, sharded over `group`.

    Args:
        hidden: [N, H] this rank's tokens (distinct from every other rank's); N may be 0.
        weight_shard: [V_r, H] rows [r*S, min(V, (r+1)*S)) of the projection, r = rank in group.
            The products run in hidden's dtype: a weight_shard of another dtype (an fp32 master
            under bf16 mixed precision) is cast inside, and its gradient returned in its own dtype.
        targets: [N] global vocabulary ids, or ignore_index.
        group: the vocab process group; None (or size 1) is the single-device fused path.
        vocab_size: V. mode: "auto" | "move_activations" | "move_weights".
        reduction: "mean" over this rank's non-ignored tokens (nan if none, as PyTorch), "sum"
            (what a trainer dividing by the global valid-token count wants), or "none" ([N], 0 at
            ignored tokens). The loss is fp32 whatever the input dtype.
        block_size: vocabulary rows per logits block (the block is [N or N_max, block_size]).
        impl: "triton" (CUDA), "torch" (chunked torch ops, any device), "reference" (full logits);
            None picks triton on CUDA, torch otherwise.
    Returns:
        the loss: a scalar, or [N] for reduction="none".
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    ring = Ring.of(group, vocab_size)
    impl = impl if impl is not None else ("triton" if hidden.is_cuda else "torch")
    _validate(hidden, weight_shard, targets, ring, reduction, block_size, impl)
    _check_targets(targets, vocab_size, ignore_index)
    if impl == "reference":
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        return reference_ring_dtp_cross_entropy(hidden, weight_shard, targets, group, vocab_size=vocab_size,
                                                ignore_index=ignore_index, reduction=reduction)
    counts = ring.token_counts(hidden.shape[0], hidden.device)           # one all-gather when P > 1
    opts = RingDTPOptions(mode=resolve_mode(mode, max(counts), vocab_size, ring.size),
                          ignore_index=ignore_index, block_size=block_size, impl=impl)
    loss = RingDTPCrossEntropy.apply(hidden.contiguous(), weight_shard.contiguous(),
                                     targets.long().contiguous(), ring, counts, opts)  # [N] fp32
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum()


__all__ = ["MODES", "REDUCTIONS", "reference_cross_entropy", "reference_ring_dtp_cross_entropy",
           "resolve_mode", "ring_dtp_cross_entropy", "ring_dtp_largest_tensor_bytes", "ring_dtp_peak_bytes"]
