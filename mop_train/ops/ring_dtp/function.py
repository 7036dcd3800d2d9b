"""The Ring-DTP autograd.Function: per-token cross-entropy over a ring of vocabulary shards.

Every rank keeps its own tokens (X_j, t_j) and its shard W_r. In P rounds every token set meets
every shard once (`local.fold_shard` / `local.shard_backward` per meeting); between rounds one
payload moves one hop to the next rank:
  move_weights:     the shard travels; X, targets and accumulators stay (forward: P-1 hops, no return).
  move_activations: X and targets travel with their fp32 accumulators; a last hop returns the
                    accumulators to their owner.
The next round's operand is sent while the current meeting computes; accumulators move after it.
Backward replays the rounds on recomputed logits; the gradient of the moving tensor (dW or dX,
fp32) travels with it and a last hop delivers it to its owner. At P = 1 (one shard, no hops) the
fp32 dX accumulator lives in dW's not-yet-written rows (`local.single_shard_backward`).
Saved: X, W_r, targets, lse [N]. Products run in one compute dtype (X's, or autocast's): an X or
W_r of another dtype (the fp32 master under bf16 mixed precision) is cast for the products in
forward and again in backward, so the log-sum-exp and its recompute see the same logits; W_r's
gradient comes back in its own dtype (fp32 accumulators, no round trip through bf16). Backward runs
with autocast off whatever the caller's context.

Paper section 3.2. Legend: N tokens (this rank), N_q (rank q), H hidden, V vocab, P group size,
S = ceil(V/P) shard rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mop_train.ops.ring_dtp.local import fold_shard, new_stats, shard_backward, single_shard_backward
from mop_train.ops.ring_dtp.ring import Ring, wait_all


@dataclass(frozen=True)
class RingDTPOptions:
    mode: str  # "move_activations" | "move_weights" (already resolved from "auto")
    ignore_index: int
    block_size: int
    impl: str  # "triton" | "torch"
    compute_dtype: torch.dtype  # dtype of the products (X's, or autocast's)


def _forward_move_weights(ring: Ring, x, w, targets, opts: RingDTPOptions) -> torch.Tensor:
    stats = new_stats(x.shape[0], x.device)                             # [3, N]
    shard, owner = w, ring.rank
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            lo, hi = ring.shard_bounds(ring.previous(owner))
            incoming = w.new_empty(hi - lo, w.shape[1])                 # [S or less, H]
            works = ring.shift([shard], [incoming])
        fold_shard(x, shard, ring.shard_bounds(owner)[0], targets, stats,
                   block_size=opts.block_size, impl=opts.impl)
        if not last:
            wait_all(works)
            shard, owner = incoming, ring.previous(owner)
    return stats


def _forward_move_activations(ring: Ring, counts, x, w, targets, opts: RingDTPOptions) -> torch.Tensor:
    lo = ring.shard_bounds(ring.rank)[0]
    tokens, token_targets, owner = x, targets, ring.rank
    stats = new_stats(x.shape[0], x.device)
    for step in range(ring.size):
        last = step == ring.size - 1
        source = ring.previous(owner)
        if not last:
            in_x = x.new_empty(counts[source], x.shape[1])              # [N_source, H]
            in_targets = targets.new_empty(counts[source])
            works = ring.shift([tokens, token_targets], [in_x, in_targets])
        fold_shard(tokens, w, lo, token_targets, stats, block_size=opts.block_size, impl=opts.impl)
        if ring.size > 1:  # accumulators follow their tokens; on the last step this is the return hop
            in_stats = stats.new_empty(3, counts[source])
            wait_all(ring.shift([stats], [in_stats]))
            stats = in_stats
        if not last:
            wait_all(works)
            tokens, token_targets, owner = in_x, in_targets, source
    return stats


def _backward_move_weights(ring: Ring, x, w, targets, lse, scale, opts: RingDTPOptions):
    dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)     # [N, H]
    accumulate = ring.size > 1
    shard, owner = w, ring.rank
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if accumulate else torch.empty_like(w)
    for step in range(ring.size):
        last = step == ring.size - 1
        source = ring.previous(owner)
        if not last:
            lo, hi = ring.shard_bounds(source)
            incoming = w.new_empty(hi - lo, w.shape[1])
            works = ring.shift([shard], [incoming])
        shard_backward(x, shard, ring.shard_bounds(owner)[0], targets, lse, scale, dx, dw,
                       accumulate_dw=accumulate, block_size=opts.block_size, impl=opts.impl)
        if accumulate:  # dW travels with its shard; the last hop lands it at the owner
            lo, hi = ring.shard_bounds(source)
            in_dw = torch.empty(hi - lo, w.shape[1], dtype=torch.float32, device=w.device)
            wait_all(ring.shift([dw], [in_dw]))
            dw = in_dw
        if not last:
            wait_all(works)
            shard, owner = incoming, source
    return dx, dw


def _backward_move_activations(ring: Ring, counts, x, w, targets, lse, scale, opts: RingDTPOptions):
    accumulate = ring.size > 1
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if accumulate else torch.empty_like(w)
    lo = ring.shard_bounds(ring.rank)[0]
    tokens, token_targets, owner = x, targets, ring.rank
    per_token = torch.stack([lse, scale])                               # [2, N] fp32, travels with X
    dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for step in range(ring.size):
        last = step == ring.size - 1
        source = ring.previous(owner)
        if not last:
            in_x = x.new_empty(counts[source], x.shape[1])
            in_targets = targets.new_empty(counts[source])
            in_per_token = per_token.new_empty(2, counts[source])
            works = ring.shift([tokens, token_targets, per_token], [in_x, in_targets, in_per_token])
        shard_backward(tokens, w, lo, token_targets, per_token[0], per_token[1], dx, dw,
                       accumulate_dw=accumulate, block_size=opts.block_size, impl=opts.impl)
        if accumulate:  # dX travels with its tokens; the last hop lands it at the owner
            in_dx = torch.empty(counts[source], x.shape[1], dtype=torch.float32, device=x.device)
            wait_all(ring.shift([dx], [in_dx]))
            dx = in_dx
        if not last:
            wait_all(works)
            tokens, token_targets, per_token, owner = in_x, in_targets, in_per_token, source
    return dx, dw


def _compute_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An input in the products' dtype: a higher-precision master (fp32 under bf16 mixed
    precision) is cast here rather than by the caller, so its gradient is handed back in the
    master's dtype straight from the fp32 accumulator, never rounded through the compute dtype."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def per_token_loss(ring: Ring, counts: list[int], hidden, weight_shard, targets, opts: RingDTPOptions):
    """(loss [N] fp32, 0 at ignored tokens; lse [N] fp32): the forward, also the no-grad path."""
    x = _compute_copy(hidden, opts.compute_dtype)                      # [N, H]
    w = _compute_copy(weight_shard, opts.compute_dtype)                # [S, H]
    if opts.mode == "move_weights":
        stats = _forward_move_weights(ring, x, w, targets, opts)
    else:
        stats = _forward_move_activations(ring, counts, x, w, targets, opts)
    del x, w
    lse = stats[0] + torch.log(stats[1])                                # [N] fp32
    valid = targets != opts.ignore_index
    return torch.where(valid, lse - stats[2], 0.0), lse


class RingDTPCrossEntropy(torch.autograd.Function):
    """Per-token loss [N] fp32 (0 at ignored tokens); differentiable in hidden and weight_shard."""

    @staticmethod
    def forward(ctx, hidden, weight_shard, targets, ring: Ring, counts: list[int], opts: RingDTPOptions):
        loss, lse = per_token_loss(ring, counts, hidden, weight_shard, targets, opts)
        ctx.save_for_backward(hidden, weight_shard, targets, lse)
        ctx.ring, ctx.counts, ctx.opts = ring, counts, opts
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        with torch.autocast(grad_loss.device.type, enabled=False):
            return RingDTPCrossEntropy._backward(ctx, grad_loss)

    @staticmethod
    def _backward(ctx, grad_loss):
        hidden, weight_shard, targets, lse = ctx.saved_tensors
        ring, counts, opts = ctx.ring, ctx.counts, ctx.opts
        x = _compute_copy(hidden, opts.compute_dtype)
        w = _compute_copy(weight_shard, opts.compute_dtype)
        valid = targets != opts.ignore_index
        scale = torch.where(valid, grad_loss.float(), 0.0).contiguous()  # [N]; ignored tokens get 0
        if ring.size == 1:
            dx, dw = single_shard_backward(x, w, targets, lse, scale, block_size=opts.block_size, impl=opts.impl)
        elif opts.mode == "move_weights":
            dx, dw = _backward_move_weights(ring, x, w, targets, lse, scale, opts)
        else:
            dx, dw = _backward_move_activations(ring, counts, x, w, targets, lse, scale, opts)
        del x, w
        return dx.to(hidden.dtype), dw.to(weight_shard.dtype), None, None, None, None
