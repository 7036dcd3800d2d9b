"""Ring-DTP: exact vocabulary projection + cross-entropy when the batch and the weight are both sharded.

Each rank of the vocab group holds its own distinct tokens X [N, H] (with targets [N]) and one
contiguous shard of the V x H output projection. A token's loss needs only three fp32 scalars
(running max, running sum of exponentials, target logit), so shards are visited block by block
with an online log-sum-exp and the N x V logits never exist. Over P rounds either the shards or the
activations travel the ring ("auto": weights move exactly when N_max > ceil(V/P)). Two schedules:
"recompute" replays the rounds in backward on recomputed logits (four GEMM passes, smallest memory);
"grad_in_forward" forms dX and dW during the forward from stored per-chunk logits (three passes;
fp32 dW_r and dX kept until backward), for a sum or mean whose upstream is one scalar.

Paper section 3.2. Legend: N tokens (this rank), H hidden, V vocab, P vocab-group size,
S = ceil(V/P) shard rows, b block rows, c tokens per grad_in_forward chunk.
"""

from __future__ import annotations

import importlib.util

import torch

from mop_train.ops.ring_dtp.function import RingDTPCrossEntropy, RingDTPOptions, per_token_loss
from mop_train.ops.ring_dtp.grad_in_forward import GradInForwardOptions, RingDTPGradInForward
from mop_train.ops.ring_dtp.memory import (MODES, SCHEDULES, default_token_chunk, resolve_mode,
                                           ring_dtp_largest_tensor_bytes, ring_dtp_peak_bytes)
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
    if impl == "triton" and not hidden.is_cuda:
        raise ValueError(f"impl='triton' runs its kernels on CUDA, but hidden is on {hidden.device}; use impl='torch' "
                         f"(or None, which picks it off CUDA)")
    if impl == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("impl='triton' needs the triton package, which this install lacks; install it "
                         "(pip install triton, or the mop_train[gpu] extra) or use impl='torch'")


def _check_schedule(schedule, mode, reduction, token_chunk) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if token_chunk is not None and token_chunk < 1:
        raise ValueError(f"token_chunk={token_chunk} must be >= 1 (tokens per grad_in_forward chunk) or None")
    if schedule != "grad_in_forward":
        return
    if reduction == "none":
        raise ValueError("schedule='grad_in_forward' needs reduction='sum' or 'mean': with reduction='none' the "
                         "per-token upstream gradient weights every token's share of dW and is known only in "
                         "backward; use schedule='recompute' (or 'auto', which picks it)")
    if mode == "move_weights":
        raise ValueError("schedule='grad_in_forward' moves activations (a token chunk's partial logits wait on "
                         "their shard's rank for the chunk's log-sum-exp); pass mode='auto' or "
                         "'move_activations', or schedule='recompute' to move weights")


def _first_bad_target(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> int | None:
    """The first target outside [0, vocab_size) that is not ignore_index, or None."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    return int(targets[bad][0]) if bool(bad.any()) else None


def _check_targets(rows: list[list[int]], vocab_size: int, ignore_index: int) -> None:
    """Raise on every rank of the group when any rank's targets are bad (gathered rows' last two
    entries: a flag and the value): a rank raising alone would leave the others in the next collective."""
    for rank, row in enumerate(rows):
        if row[-2]:
            where = f" on rank {rank} of the vocab group" if len(rows) > 1 else ""
            raise ValueError(f"target {row[-1]}{where} is outside [0, vocab_size={vocab_size}) and is not "
                             f"ignore_index={ignore_index}; fix the labels or the vocab_size")


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The products' dtype: autocast's where autocast would cast hidden (as torch.mm would), else hidden's."""
    kind = hidden.device.type
    if hidden.dtype != torch.float64 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return hidden.dtype


def _grad_in_forward_fits(rows, h, v, p, dtype, hidden_dtype, weight_dtype, block_size, impl, token_chunk) -> bool:
    """auto's test, on every rank's gathered (N, budget): each rank's bound within its own budget."""
    n_max = max(r[0] for r in rows)
    return all(r[4] >= 0 and ring_dtp_peak_bytes(r[0], h, v, p, dtype=dtype, block_size=block_size, n_max=n_max,
                                                 impl=impl, schedule="grad_in_forward", token_chunk=token_chunk,
                                                 hidden_dtype=hidden_dtype, weight_dtype=weight_dtype) <= r[4]
               for r in rows)


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def ring_dtp_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor, group=None,
                           *, vocab_size: int, mode: str = "auto", schedule: str = "auto",
                           memory_budget: int | None = None, token_chunk: int | None = None,
                           ignore_index: int = -100, reduction: str = "mean", block_size: int = 8192,
                           impl: str | None = None) -> torch.Tensor:
    """Cross-entropy of this rank's tokens against the whole vocabulary, sharded over `group`.

    Args:
        hidden: [N, H] this rank's tokens (distinct from every other rank's); N may be 0. Float64 tokens
            that want a gradient need impl="reference" (the fused impls accumulate in float32).
        weight_shard: [V_r, H] rows [r*S, min(V, (r+1)*S)) of the projection, r = rank in group.
            The products run in hidden's dtype (autocast's inside torch.autocast): an input of
            another dtype (an fp32 master under bf16 mixed precision) is cast inside, and its
            gradient returned in its own dtype.
        targets: [N] global vocabulary ids, or ignore_index.
        group: the vocab process group; None (or size 1) is the single-device fused path. Every
            rank of the group makes the same call (arguments, grad mode).
        vocab_size: V. mode: "auto" | "move_activations" | "move_weights".
        schedule: "recompute" (backward recomputes the logits: four GEMM passes, least memory),
            "grad_in_forward" (dX, dW formed in forward: three passes, fp32 dW_r and dX held until
            backward; reduction "sum"/"mean" only, moves activations, one upstream scalar for all
            ranks, one backward per call), or "auto": grad_in_forward when its bound
            (`ring_dtp_peak_bytes(..., schedule="grad_in_forward")`) fits memory_budget on every
            rank and the call allows it, else recompute. Without any gradient to form (no_grad, or
            no input requiring grad on any rank) only the loss is computed, whatever the schedule.
        memory_budget: bytes this op may allocate above its inputs (the planner's headroom), for
            "auto"; None: recompute.
        token_chunk: c, tokens per rank per grad_in_forward round (None: `default_token_chunk`).
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
    _check_schedule(schedule, mode, reduction, token_chunk)
    valid = targets != ignore_index
    grad = torch.is_grad_enabled()
    wants = (grad and hidden.requires_grad, grad and weight_shard.requires_grad)
    budget = -1 if memory_budget is None else int(memory_budget)
    bad = _first_bad_target(targets, vocab_size, ignore_index)
    rows = ring.gather_ints([hidden.shape[0], int(valid.sum()), *map(int, wants), budget, bad is not None, bad or 0],
                            hidden.device)                              # one all-gather when P > 1
    _check_targets(rows, vocab_size, ignore_index)
    if impl == "reference":
        return reference_ring_dtp_cross_entropy(hidden, weight_shard, targets, group, vocab_size=vocab_size,
                                                ignore_index=ignore_index, reduction=reduction)
    targets = targets.long().contiguous()
    counts = [r[0] for r in rows]
    needs = {bool(r[2] or r[3]) for r in rows}
    if len(needs) > 1:
        raise ValueError("some ranks of the vocab group need gradients from ring_dtp_cross_entropy and others "
                         "do not (torch.no_grad or requires_grad differ); every rank makes the same call")
    dtype = _compute_dtype(hidden)
    if dtype == torch.float64 and needs == {True}:
        raise ValueError(f"hidden is float64 and a gradient is wanted, but impl={impl!r} accumulates the log-sum-exp "
                         f"and the gradients in float32, which would hand float64 inputs float32-accurate "
                         f"gradients; use impl='reference' (full logits, float64 autograd) or float32 inputs")
    if schedule == "auto":
        allowed = reduction != "none" and mode != "move_weights"
        fits = allowed and _grad_in_forward_fits(rows, hidden.shape[1], vocab_size, ring.size, dtype, hidden.dtype,
                                                 weight_shard.dtype, block_size, impl, token_chunk)
        schedule = "grad_in_forward" if fits else "recompute"
    hidden, weight_shard = hidden.contiguous(), weight_shard.contiguous()
    with torch.autocast(hidden.device.type, enabled=False):            # one dtype for the lse and its reuse
        if needs == {False} or schedule == "recompute":
            opts = RingDTPOptions(mode=resolve_mode(mode, max(counts), vocab_size, ring.size),
                                  ignore_index=ignore_index, block_size=block_size, impl=impl, compute_dtype=dtype)
            if needs == {False}:  # evaluation: the loss only, nothing saved
                loss = per_token_loss(ring, counts, hidden, weight_shard, targets, opts)[0]
            else:
                loss = RingDTPCrossEntropy.apply(hidden, weight_shard, targets, ring, counts, opts)  # [N] fp32
            return _reduce(loss, valid, reduction)
        opts = GradInForwardOptions(
            ignore_index=ignore_index, block_size=block_size, impl=impl,
            token_chunk=token_chunk or default_token_chunk(max(counts), vocab_size, ring.size, block_size),
            mean=reduction == "mean", valid_counts=tuple(r[1] for r in rows), want_dx=wants[0], want_dw=wants[1],
            dx_ring=any(r[2] for r in rows), compute_dtype=dtype)
        return RingDTPGradInForward.apply(hidden, weight_shard, targets, ring, counts, opts)


__all__ = ["MODES", "REDUCTIONS", "SCHEDULES", "default_token_chunk", "reference_cross_entropy",
           "reference_ring_dtp_cross_entropy", "resolve_mode", "ring_dtp_cross_entropy",
           "ring_dtp_largest_tensor_bytes", "ring_dtp_peak_bytes"]
