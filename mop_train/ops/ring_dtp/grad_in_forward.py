"""Ring-DTP's grad_in_forward schedule: the loss's gradients formed in the forward, three GEMM passes.

The loss is a graph's last node, so its gradients wrt X and W can be formed before backward is
called, up to the upstream gradient; for a sum or a mean that upstream is one scalar, and backward
only scales the stored fp32 gradients (exact; a mean's 1/count is applied per owner in forward, since
dW_r sums every rank's tokens). Tokens go round in chunks of c per rank (move activations); one round:
  1. the chunks travel the ring; each rank forms the partial logits z = X_c W_r^T [c, V_r] of every
     chunk that passes and keeps them, with their partial (max, sum-exp, target logit);
  2. two all-reduces of those partials give every chunk's log-sum-exp on every rank;
  3. each rank turns its stored blocks into g = softmax - onehot in place; the dX accumulator of each
     chunk travels the same ring gathering g W_r and lands at its owner after P hops, while
     dW_r += g^T X_c accumulates in fp32 in place (the GEMM hides the hop).
Logits, dX and dW: one GEMM pass each, against four for the recompute schedule. Extra memory: the
fp32 dW_r [S, H] and dX [N, H] kept until backward, and one round's stored logits (about c x V).
reduction="none" is not offered: its per-token upstream weights dW's terms one token at a time
and is known only in backward. For the same reason every rank's upstream scalar must be the same (as
for loss.backward() on each rank, or a sum divided by a global token count): backward all-gathers
the P scalars (P > 1) and raises if they differ, rather than return a wrong dW.

Paper section 3.2. Legend: N tokens (this rank), N_q (rank q), H hidden, V vocab, P group size,
S = ceil(V/P) shard rows, V_r this rank's rows, c tokens per chunk (per owner per round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mop_train.ops.ring_dtp.local import add_dw, add_dx, block_grad_, block_stats
from mop_train.ops.ring_dtp.ring import Ring, wait_all


@dataclass(frozen=True)
class GradInForwardOptions:
    ignore_index: int
    block_size: int      # shard columns per torch-path step
    impl: str            # "triton" | "torch"
    token_chunk: int     # c, the same on every rank
    mean: bool           # reduction "mean" (else "sum")
    valid_counts: tuple  # non-ignored tokens of every group rank
    want_dx: bool        # this rank's hidden needs its gradient
    want_dw: bool        # this rank's shard needs its gradient
    dx_ring: bool        # some rank's hidden needs its gradient: every rank serves the dX ring
    compute_dtype: torch.dtype


def _owner_scale(opts: GradInForwardOptions, owner: int) -> float:
    """A token's upstream in forward: 1/(its owner's valid tokens) for a mean, 1 for a sum."""
    return 1.0 / max(1, opts.valid_counts[owner]) if opts.mean else 1.0


def _forward_round(ring: Ring, x, w, targets, rows, lo, opts):
    """Step 1: [(owner, X chunk, targets chunk, stored logits, partial stats)] for every owner."""
    start, stop = rows[ring.rank]
    chunk_x, chunk_t, owner = x[start:stop], targets[start:stop], ring.rank
    held = []
    for step in range(ring.size):
        last = step == ring.size - 1
        source = ring.previous(owner)
        if not last:
            m = rows[source][1] - rows[source][0]
            in_x, in_t = x.new_empty(m, x.shape[1]), targets.new_empty(m)     # [c_source, H], [c_source]
            works = ring.shift([chunk_x, chunk_t], [in_x, in_t])
        z = chunk_x @ w.t()                                                   # [c_owner, V_r] kept
        held.append((owner, chunk_x, chunk_t, z,
                     block_stats(z, chunk_t, lo, block_size=opts.block_size, impl=opts.impl)))
        if not last:
            wait_all(works)
            chunk_x, chunk_t, owner = in_x, in_t, source
    return held


def _global_lse(ring: Ring, held, c: int, device):
    """Step 2: lse and target logit [P, c] of every owner's chunk, from every shard's partials."""
    packed = torch.zeros(3, ring.size, c, dtype=torch.float32, device=device)  # (max, sum, target)
    packed[0].fill_(float("-inf"))
    for owner, _, _, _, stats in held:
        packed[:, owner, :stats.shape[1]] = stats
    if ring.size > 1:
        top = packed[0].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ring.group)
        empty = packed[0] == float("-inf")                                   # this shard saw nothing
        packed[1].mul_(torch.where(empty, 0.0, torch.exp(packed[0] - top)))
        sums = packed[1:].contiguous()                                       # one shard holds each target
        dist.all_reduce(sums, group=ring.group)
        packed[0], packed[1:] = top, sums
    return packed[0] + torch.log(packed[1]), packed[2]


def _gradient_round(ring: Ring, held, lse, w, lo, own_dx, dw, opts) -> None:
    """Step 3: g in place of the stored logits; dX accumulators round the ring into own_dx; dW_r += g^T X."""
    h = w.shape[1]
    works, acc, incoming = [], None, None   # incoming: the next owner's dX accumulator, from rank-1
    for step, (owner, chunk_x, chunk_t, z, _) in enumerate(held):
        m = chunk_x.shape[0]
        scale = (chunk_t != opts.ignore_index).float() * _owner_scale(opts, owner)  # [c_owner]; 0 if ignored
        block_grad_(z, chunk_t, lo, lse[owner, :m].contiguous(), scale, block_size=opts.block_size,
                    impl=opts.impl)
        g = z                                                                 # [c_owner, V_r]
        if opts.dx_ring:
            wait_all(works)                                                   # this owner's accumulator
            if step == 0:
                acc = own_dx if ring.size == 1 else torch.zeros(m, h, dtype=torch.float32, device=w.device)
            else:
                acc = incoming
            add_dx(acc, g, w, block_size=opts.block_size, impl=opts.impl)
            if ring.size > 1:  # on to rank+1, which serves this owner next; the last hop reaches the owner
                last = step == ring.size - 1
                incoming = own_dx if last else torch.empty(held[step + 1][1].shape[0], h, dtype=torch.float32,
                                                           device=w.device)
                works = ring.shift([acc], [incoming])
        if dw is not None:
            add_dw(dw, g, chunk_x, block_size=opts.block_size, impl=opts.impl)
        del g
    wait_all(works)


def grad_in_forward(ring: Ring, counts: list[int], x, w, targets, opts: GradInForwardOptions):
    """(per-token loss [N] fp32, dX [N, H] fp32 or None, dW_r [V_r, H] fp32 or None) for an upstream
    gradient of 1 on every rank's reduced loss."""
    n, h = x.shape
    c = opts.token_chunk
    lo = ring.shard_bounds(ring.rank)[0]
    loss = torch.zeros(n, dtype=torch.float32, device=x.device)
    dx = torch.zeros(n, h, dtype=torch.float32, device=x.device) if opts.want_dx else None
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if opts.want_dw else None
    for k in range(-(-max(counts) // c)):
        rows = [(min(k * c, m), min((k + 1) * c, m)) for m in counts]
        held = _forward_round(ring, x, w, targets, rows, lo, opts)
        lse, target_logit = _global_lse(ring, held, c, x.device)
        start, stop = rows[ring.rank]
        valid = targets[start:stop] != opts.ignore_index
        loss[start:stop] = torch.where(valid, lse[ring.rank, :stop - start] - target_logit[ring.rank, :stop - start],
                                       0.0)
        own_dx = None if not opts.dx_ring else (dx[start:stop] if dx is not None else   # else serve others only
                                                 torch.zeros(stop - start, h, dtype=torch.float32, device=x.device))
        _gradient_round(ring, held, lse, w, lo, own_dx, dw, opts)
        del held
    return loss, dx, dw


def _scaled(acc: torch.Tensor | None, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """acc * scale in `dtype`: in place when fp32 (no second copy), else written straight into the
    output dtype from fp32 (one rounding)."""
    if acc is None:
        return None
    if dtype == torch.float32:
        return acc.mul_(scale)
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    return torch.mul(acc, scale, out=out)


class RingDTPGradInForward(torch.autograd.Function):
    """Reduced loss (scalar fp32, "sum" or "mean"); dX, dW formed in forward and scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight_shard, targets, ring: Ring, counts: list[int], opts: GradInForwardOptions):
        x = hidden if hidden.dtype == opts.compute_dtype else hidden.to(opts.compute_dtype)
        w = weight_shard if weight_shard.dtype == opts.compute_dtype else weight_shard.to(opts.compute_dtype)
        loss, dx, dw = grad_in_forward(ring, counts, x, w, targets, opts)
        del x, w
        count = (targets != opts.ignore_index).sum()
        total = loss.sum()                                                    # fp32
        ctx.save_for_backward(dx, dw)
        ctx.dtypes, ctx.ring, ctx.used = (hidden.dtype, weight_shard.dtype), ring, False
        ctx.active = [q for q, v in enumerate(opts.valid_counts) if v > 0]  # ranks whose upstream matters
        return total / count if opts.mean else total

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("ring_dtp_cross_entropy(schedule='grad_in_forward') hands its stored gradients "
                               "out in the first backward; for a second backward through the same graph "
                               "(retain_graph=True) use schedule='recompute'")
        ctx.used = True
        dx, dw = ctx.saved_tensors
        with torch.autocast(grad_loss.device.type, enabled=False):
            scale = grad_loss.float().reshape(())
            dw_scale = _common_upstream(ctx.ring, ctx.active, scale)
            return _scaled(dx, scale, ctx.dtypes[0]), _scaled(dw, dw_scale, ctx.dtypes[1]), None, None, None, None


def _common_upstream(ring: Ring, active: list[int], scale: torch.Tensor) -> torch.Tensor:
    """dW_r's scale. dW_r holds every rank's tokens at unit upstream: exact only if the upstreams of
    all ranks with valid tokens agree (a rank without any contributes nothing, whatever its own
    upstream, so its dW_r takes the others'). One all-gather of P scalars and a host check (P > 1)."""
    if ring.size == 1:
        return scale
    seen = torch.empty(ring.size, dtype=torch.float32, device=scale.device)
    dist.all_gather(list(seen.chunk(ring.size)), scale.reshape(1), group=ring.group)
    values = [float(v) for q, v in enumerate(seen.tolist()) if q in active]
    if any(v != values[0] and not (v != v and values[0] != values[0]) for v in values):
        raise ValueError(f"ring_dtp_cross_entropy(schedule='grad_in_forward'): the loss's upstream gradient "
                         f"differs across the vocab group's ranks with valid tokens ({values}); dW_r sums every "
                         f"rank's tokens before backward, so it needs one upstream for all; scale every rank's "
                         f"loss alike (e.g. a sum divided by the global token count) or use schedule='recompute'")
    return seen[active[0]] if active else scale
