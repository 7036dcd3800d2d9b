"""Least-loaded expert parallelism: `dispatch="llep"`, and the chunk engine PipelinedLLEP reuses.

Every route keeps its expert; only the rank that computes it may change:
  1. count routes per expert, all-gather the [P, E] count matrix, build the LLEP plan (`llep_plan`);
  2. migrate each relocated expert's w1/w2/w3 owner -> helper by point-to-point, once per layer;
     backward returns each copy's gradient to its owner once per layer, where it adds to the
     owner's own gradient (a zero "anchor" added to the output makes every rank run that backward);
  3. send every route to the rank whose plan range holds its position (all-to-all, uneven splits);
     the receiver runs its native experts and the migrated copies (two grouped matmuls, no stacking
     of native weights), scales by the routing weight, and the reverse all-to-all brings outputs back.
`run_chunks` does step 3 over K chunks of the token axis with the exchanges of neighbouring chunks
in flight during a chunk's expert matmul; LLEP is the K = 1 case. PipelinedLLEP's chunks add their
weight gradients into per-layer sums that step 2's backward returns (chunked_experts.py).
Paper: section 3.1, Appendix B.

Legend: N tokens, H hidden, I expert hidden width, E experts, M = E / P native experts per rank,
F foreign (migrated) experts on this rank, S = M + F slots, k top-k, R = N*k routes, P group size,
K chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mop_train.ops.moe_dispatch.chunked_experts import (ChunkExperts, ExpertGradSum, GatherTokens,
                                                        TokenGradSum, TokenSource, in_backward,
                                                        slot_swiglu)
from mop_train.ops.moe_dispatch.combine import add_token_rows, gather_token_rows, inverse_permutation, permute_rows
from mop_train.ops.moe_dispatch.comm import (AllToAllStart, AllToAllWait, Ticket, all_gather_counts,
                                             exchange_counts, group_rank, group_size, host_to_device,
                                             stands_for_identical_ranks)
from mop_train.ops.moe_dispatch.ep import receive_order
from mop_train.ops.moe_dispatch.llep_plan import LLEPPlan, llep_plan
from mop_train.ops.moe_dispatch.local import local_experts_forward, route_counts
from mop_train.ops.moe_dispatch.options import LLEPOptions
from mop_train.ops.moe_dispatch.stats import DispatchStats, record_stats


class MigrateExperts(torch.autograd.Function):
    """Copy relocated experts owner -> helper; backward sends the copies' grads back to the owner.

    Returns (f1, f2, f3, anchor): [F, ...] foreign copies in this rank's slot order (filled once
    `ticket` has been waited on), and a zero scalar to add to the layer output so this backward
    runs on every rank. `chunk_sums` is None when the experts run under plain autograd (LLEP), or
    the (native, foreign) ExpertGradSum that PipelinedLLEP's chunks add into: each chunk takes
    `anchor` as input, so this backward runs after the last chunk and returns those sums, once."""

    @staticmethod
    def forward(ctx, ticket, transfers, rank, experts_per_rank, group, chunk_sums, w1, w2, w3):
        ctx.transfers, ctx.rank, ctx.M, ctx.group = transfers, rank, experts_per_rank, group
        ctx.chunk_sums = chunk_sums
        ctx.set_materialize_grads(False)
        foreign = [e for e, h in transfers if h == rank]
        outs = [w.new_empty((len(foreign),) + tuple(w.shape[1:])) for w in (w1, w2, w3)]
        ops = []
        for e, h in transfers:
            owner = e // experts_per_rank
            if owner == rank:
                ops += [dist.P2POp(dist.isend, w[e - owner * experts_per_rank].contiguous(),
                                   dist.get_global_rank(group, h), group) for w in (w1, w2, w3)]
            elif h == rank:
                slot = foreign.index(e)
                ops += [dist.P2POp(dist.irecv, o[slot], dist.get_global_rank(group, owner), group)
                        for o in outs]
        if ops:
            ticket.works += dist.batch_isend_irecv(ops)
        ctx.weight_meta = [(w.shape, w.dtype, w.device) for w in (w1, w2, w3)]
        return (*outs, w1.new_zeros(()))

    @staticmethod
    def backward(ctx, g1, g2, g3, g_anchor):
        rank, M, group = ctx.rank, ctx.M, ctx.group
        foreign = [e for e, h in ctx.transfers if h == rank]
        if ctx.chunk_sums is not None:
            native_sums, foreign_sums = (s.take() for s in ctx.chunk_sums)
            grads = [f if g is None else f + g for f, g in zip(foreign_sums, (g1, g2, g3))]
        else:
            native_sums = None
            grads = [g if g is not None else torch.zeros((len(foreign),) + tuple(shape[1:]),
                                                         dtype=dtype, device=device)
                     for g, (shape, dtype, device) in zip((g1, g2, g3), ctx.weight_meta)]
        sent = [(e, h) for e, h in ctx.transfers if e // M == rank]
        bufs = [torch.empty((len(sent),) + tuple(s[1:]), dtype=d, device=dev)
                for s, d, dev in ctx.weight_meta]
        ops = []
        for e, h in ctx.transfers:
            owner = e // M
            if owner == rank:
                j = sent.index((e, h))
                ops += [dist.P2POp(dist.irecv, b[j], dist.get_global_rank(group, h), group) for b in bufs]
            elif h == rank:
                slot = foreign.index(e)
                ops += [dist.P2POp(dist.isend, g[slot].contiguous(), dist.get_global_rank(group, owner),
                                   group) for g in grads]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if not sent and native_sums is None:
            return (None,) * 9
        if native_sums is None:
            native_sums = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.weight_meta]
        if sent:
            local = host_to_device(torch.tensor([e - rank * M for e, _ in sent]), bufs[0].device)
            for dw, b in zip(native_sums, bufs):
                dw.index_add_(0, local, b)
        return (None,) * 6 + tuple(native_sums)


def slot_of_expert(plan: LLEPPlan, rank: int) -> torch.Tensor:
    """[E] slot of each global expert on `rank` (native e -> e - rank*M, foreign -> M + j), else -1."""
    M = plan.experts_per_rank
    slots = torch.full((plan.num_ranks * M,), -1, dtype=torch.int64)
    slots[rank * M:(rank + 1) * M] = torch.arange(M)
    for j, e in enumerate(plan.foreign_experts(rank)):
        slots[e] = M + j
    return slots


def gather_counts(indices: torch.Tensor, num_experts: int, group) -> tuple[torch.Tensor, int]:
    """The count matrix C [P, E] on the CPU and the largest token count N in the group: one
    all-gather and one device-to-host copy (the layer's first host sync; counting does not sync)."""
    N = indices.shape[0]
    flat = indices.reshape(-1)                                                # [R]
    col = torch.where((flat < 0) | (flat >= num_experts), num_experts, flat)  # bad ids -> column E
    local = torch.zeros(num_experts + 2, dtype=torch.int64, device=indices.device)
    local.index_add_(0, col, torch.ones_like(col, dtype=torch.int64))         # [E] counts, [1] bad ids; int32 ids too
    local[num_experts + 1] = N                                                # [1] tokens
    G = all_gather_counts(local, group).cpu()                                 # [P, E + 2]
    if int(G[:, num_experts].sum()):
        ranks = [s for s in range(G.shape[0]) if G[s, num_experts]]
        raise ValueError(f"indices hold expert ids outside [0, {num_experts}) on rank(s) {ranks} of the expert "
                         f"group, which holds {num_experts} experts; pass this rank's expert shard as w1/w2/w3")
    return G[:, :num_experts].contiguous(), int(G[:, num_experts + 1].max())


def build_plan(indices: torch.Tensor, num_experts: int, group, options: LLEPOptions):
    """All-gather the count matrix and build the plan. Returns (plan, C [P, E] on CPU, max N)."""
    C, n_max = gather_counts(indices, num_experts, group)
    plan = llep_plan(C, alpha=options.alpha, min_tokens_per_gemm=options.min_tokens_per_gemm,
                     imbalance_threshold=options.imbalance_threshold)
    return plan, C, n_max


@dataclass
class _Chunk:
    tokens: slice                # its token positions (every one with all k of its routes)
    start: int                   # its first row in the layer's send order
    ids: torch.Tensor            # [R_i] route ids (token * k + slot) in send order
    slots: torch.Tensor          # [n_i, k] row (in `ids`) of each of its tokens' routes
    send_splits: list[int]       # [P] rows to each destination
    recv_splits: list[int]       # [P] rows from each source
    perm: torch.Tensor | None    # [R'_i] arrival order -> slot order (None: they are the same)
    inv_perm: torch.Tensor | None  # [R'_i] slot order -> arrival order
    slot_counts: torch.Tensor    # [S] rows per slot (CPU; on the device at group size one)
    identical_world_peak: int | None = None  # a fake world: the most routes any destination receives


def _route_keys(flat, order, plan, C, chunk, source: int, P: int) -> torch.Tensor:
    """[R] key (chunk * P + destination) * E + expert of each route, were these routes (expert-sorted
    `order`) those of group rank `source`: the plan sends a route by its position in its expert's
    source-major route list, so the destination depends on the source."""
    E, device = C.shape[1], flat.device
    dest = torch.empty(flat.shape, dtype=torch.int64, device=device)       # (int64 whatever the ids' dtype)
    ranks, runs = plan.destination_runs(C, source)
    dest[order] = torch.repeat_interleave(host_to_device(ranks, device), host_to_device(runs, device),
                                          output_size=flat.numel())       # [R] plan destination
    return (chunk * P + dest) * E + flat


def _identical_ranks_recv_counts(flat, order, plan, C, chunk, num_chunks, P, rank):
    """([P(src), K, E] what every source's plan sends `rank`, [K, P(dst)] routes every destination
    receives) when every source holds these routes (a fake world, `stands_for_identical_ranks`): the
    count exchange there returns only our own row, and the stats' max all-reduce our own receipts."""
    E = C.shape[1]
    rows, totals = [], torch.zeros(num_chunks * P, dtype=torch.int64, device=flat.device)
    for source in range(P):
        key = _route_keys(flat, order, plan, C, chunk, source, P)               # (chunk, dest, expert)
        counts = torch.zeros(num_chunks * P * E, dtype=torch.int64, device=flat.device).index_add_(
            0, key, torch.ones_like(key)).view(num_chunks, P, E)                # no host sync
        rows.append(counts[:, rank])                                             # [K, E]
        totals += counts.sum(2).view(-1)
    return torch.stack(rows), totals.view(num_chunks, P)


def chunk_of_token(chunk_tokens: list[slice], num_tokens: int, device) -> torch.Tensor:
    """[N] chunk id of each token position, from each chunk's slice of them (which must partition them)."""
    sizes = [len(range(num_tokens)[s]) for s in chunk_tokens]
    if sum(sizes) != num_tokens:
        raise ValueError(f"chunk token slices {chunk_tokens} hold {sum(sizes)} positions, not the {num_tokens} "
                         f"tokens once each")
    chunk = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    for i, s in enumerate(chunk_tokens):
        chunk[s] = i
    return chunk


def _plan_chunks(indices, plan, C, chunk_tokens: list[slice], group):
    """Route ids, split sizes, receive order and token slots of every chunk (one count exchange per layer),
    and the layer's send order with its inverse ([R] each)."""
    N, k = indices.shape
    num_chunks = len(chunk_tokens)
    P, rank = group_size(group), group_rank(group)
    E, device = C.shape[1], indices.device
    flat = indices.reshape(-1)                                               # [R]
    order = torch.argsort(flat, stable=True)                                 # expert-sorted routes
    chunk = chunk_of_token(chunk_tokens, N, device).repeat_interleave(k)     # [R]
    key = _route_keys(flat, order, plan, C, chunk, rank, P)                  # (chunk, dest, expert)
    send_order = torch.argsort(key, stable=True)                             # [R]
    send_counts = torch.zeros(num_chunks * P * E, dtype=torch.int64, device=device)
    send_counts = send_counts.index_add_(0, key, torch.ones_like(key)).view(num_chunks, P, E)
    send_counts = send_counts.permute(1, 0, 2).contiguous()                 # [P(dst), K, E]
    peaks = None
    if stands_for_identical_ranks(group):
        recv_counts, received = _identical_ranks_recv_counts(flat, order, plan, C, chunk, num_chunks, P, rank)
        peaks = received.max(1).values                                       # [K]
    else:
        recv_counts = exchange_counts(send_counts, group)                    # [P(src), K, E]
    both = torch.stack([send_counts, recv_counts]).cpu()                     # the layer's second sync
    if peaks is not None:
        peaks = peaks.tolist()                                               # (computed by now)
    send_counts, recv_counts = both[0].permute(1, 0, 2), both[1]             # [K, P, E], [P, K, E]
    expert_slots = slot_of_expert(plan, rank)
    send_position = inverse_permutation(send_order).view(N, k)               # [N, k] row of each route
    chunks, start = [], 0
    for i, tokens in enumerate(chunk_tokens):
        n = int(send_counts[i].sum())
        perm, slot_counts = receive_order(recv_counts[:, i, :], device, expert_slots)
        chunks.append(_Chunk(tokens, start, send_order[start:start + n], send_position[tokens] - start,
                             send_counts[i].sum(1).tolist(), recv_counts[:, i, :].sum(1).tolist(), perm,
                             inverse_permutation(perm), slot_counts, None if peaks is None else peaks[i]))
        start += n
    return chunks, send_order, send_position.view(-1)


def _plan_local_chunks(indices, chunk_tokens: list[slice], num_experts: int):
    """What `_plan_chunks` returns at group size one, without reading anything back to the host: nothing
    is relocated, sent or received out of order, so a chunk's rows are its routes sorted by expert (the
    send order `_plan_chunks` builds, key = chunk * E + expert), arrival order is slot order, and the
    slot counts stay on the device (grouped GEMMs take device offsets); every size the host needs is
    n_i * k. Expert ids outside [0, E) are refused as `gather_counts` refuses them (on CUDA by a
    device-side assert, which costs no host wait)."""
    N, k = indices.shape
    flat, device = indices.reshape(-1), indices.device                     # [R]
    bad = ((flat < 0) | (flat >= num_experts)).any()
    message = (f"indices hold expert ids outside [0, {num_experts}), but the group holds {num_experts} experts; "
               f"pass this rank's expert shard as w1/w2/w3")
    if device.type == "cuda":
        torch._assert_async(~bad, message)
    elif bool(bad):
        raise ValueError(message)
    key = chunk_of_token(chunk_tokens, N, device).repeat_interleave(k) * num_experts + flat   # [R]
    send_order = torch.argsort(key, stable=True)                             # [R]
    counts = route_counts(key, len(chunk_tokens) * num_experts).view(-1, num_experts)  # [K, E], no sync
    send_position = inverse_permutation(send_order).view(N, k)               # [N, k] row of each route
    chunks, start = [], 0
    for i, tokens in enumerate(chunk_tokens):
        n = len(range(N)[tokens]) * k
        chunks.append(_Chunk(tokens, start, send_order[start:start + n], send_position[tokens] - start, [n], [n],
                             None, None, counts[i]))
        start += n
    return chunks, send_order, send_position.view(-1)


def run_chunks(x, indices, weights, w1, w2, w3, group, plan: LLEPPlan, C: torch.Tensor,
               chunk_tokens: list[slice], *, recompute_experts: bool,
               stats: DispatchStats | None = None, received_bound: int = 0) -> torch.Tensor:
    """Execute `plan` over K chunks: dispatch(i+1) and combine(i-1) are in flight during compute(i).

    Args:
        x [N, H]; indices, weights [N, k]; w1, w3 [M, I, H]; w2 [M, H, I] this rank's experts.
        plan, C: the layer's LLEP plan and the count matrix [P, E] it was built from (unused, and C may be
            None, at group size one: `_plan_local_chunks` plans on the device).
        chunk_tokens: K slices of the token positions [0, N), each position in exactly one.
        recompute_experts: run each chunk's expert matmul as ChunkExperts (recomputed in backward,
            weight grads summed in place once per layer) instead of plain autograd.
    Returns:
        y [N, H]
    """
    k, M = indices.shape[1], w1.shape[0]
    rank = group_rank(group)
    if group_size(group) == 1:
        chunks, send_order, send_inverse = _plan_local_chunks(indices, chunk_tokens, w1.shape[0])
    else:
        chunks, send_order, send_inverse = _plan_chunks(indices, plan, C, chunk_tokens, group)
    migration = Ticket()          # the weight copies travel while the first dispatch is issued
    sums = None
    if recompute_experts:
        num_foreign = len(plan.foreign_experts(rank))
        sums = (ExpertGradSum(M, w1, w2, w3), ExpertGradSum(num_foreign, w1, w2, w3))
    f1, f2, f3, anchor = MigrateExperts.apply(migration, plan.transfers, rank, M, group, sums, w1, w2, w3)
    w_sent = permute_rows(weights.reshape(-1), send_order, send_inverse)    # [R] in send order
    token_sums = token_anchor = None
    if recompute_experts and torch.is_grad_enabled() and x.requires_grad:
        token_sums = TokenGradSum(x)
        token_anchor = TokenSource.apply(token_sums, x)

    def launch_dispatch(c: _Chunk):
        ticket = Ticket()
        ids = c.ids // k                                                     # [R_i] token of each route
        if token_sums is not None:
            rows = GatherTokens.apply(token_sums, token_anchor, x, ids, c.tokens, c.slots)
        elif torch.is_grad_enabled() and x.requires_grad:                    # LLEP: plain autograd
            first, step = range(x.shape[0])[c.tokens].start, range(x.shape[0])[c.tokens].step
            rows = gather_token_rows(x[c.tokens], (ids - first) // step, c.slots)
        else:
            rows = x.index_select(0, ids)
        route_w = w_sent[c.start:c.start + c.ids.shape[0]]                   # [R_i]
        return ticket, AllToAllStart.apply(ticket, c.send_splits, c.recv_splits, group, rows, route_w)

    def expert_matmul(rows, route_w, slot_counts):
        migration.wait()                                                     # no-op after the first
        args = (rows, route_w, w1, w2, w3, f1, f2, f3)
        if recompute_experts and torch.is_grad_enabled() and any(t.requires_grad for t in args):
            return ChunkExperts.apply(sums, slot_counts, M, anchor, *args)
        return slot_swiglu(*args[:2], slot_counts, *args[2:], M)

    def finish_combine(y, pending):
        ticket, bufs, c = pending
        (back,) = AllToAllWait.apply(ticket, *bufs)                          # [R_i, H] in send order
        return add_token_rows(y, c.tokens, c.slots, back)  # in place: no [N, H] per chunk, `back` not saved

    y = torch.zeros_like(x)
    dispatch, combine = launch_dispatch(chunks[0]), None
    for i, c in enumerate(chunks):
        ticket, bufs = dispatch
        if i + 1 < len(chunks):
            dispatch = launch_dispatch(chunks[i + 1])
        rows, route_w = AllToAllWait.apply(ticket, *bufs)                    # [R'_i, H], [R'_i]
        if c.perm is not None:                                               # to slot order
            rows, route_w = permute_rows(rows, c.perm, c.inv_perm), permute_rows(route_w, c.perm, c.inv_perm)
        out = expert_matmul(rows, route_w, c.slot_counts)                    # [R'_i, H] slot order
        if c.perm is not None:
            out = permute_rows(out, c.inv_perm, c.perm)                      # arrival order
        back_ticket = Ticket()
        back = AllToAllStart.apply(back_ticket, c.recv_splits, c.send_splits, group, out)
        if combine is not None:
            y = finish_combine(y, combine)
        combine = (back_ticket, back, c)
    y = finish_combine(y, combine)
    if stats is not None and not in_backward():      # a checkpoint's recompute has nothing new
        copy_bytes = sum(w[0].numel() * w.element_size() for w in (w1, w2, w3))
        record_stats(stats, [sum(c.recv_splits) for c in chunks], group, x.device,
                     relocated_routes=plan.relocated_routes, migrated_experts=len(plan.transfers),
                     weight_transfer_bytes=len(plan.transfers) * copy_bytes,
                     received_bound=received_bound, chunk_sent=[sum(c.send_splits) for c in chunks],
                     identical_world_peak=None if chunks[0].identical_world_peak is None
                     else [c.identical_world_peak for c in chunks])
    if token_anchor is not None:
        y = y + token_anchor.to(y.dtype)
    return y + anchor.to(y.dtype)


def llep_experts_forward(x, indices, weights, w1, w2, w3, group, options: LLEPOptions, *,
                         stats: DispatchStats | None = None) -> torch.Tensor:
    """x [N, H]; indices, weights [N, k]; w1, w3 [M, I, H]; w2 [M, H, I] this rank's shard -> y [N, H]."""
    P = group_size(group)
    if P == 1:
        if stats is not None:
            record_stats(stats, [indices.numel()], group, x.device)
        return local_experts_forward(x, indices, weights, w1, w2, w3)
    plan, C, _ = build_plan(indices, w1.shape[0] * P, group, options)
    return run_chunks(x, indices, weights, w1, w2, w3, group, plan, C, [slice(0, x.shape[0])],
                      recompute_experts=False, stats=stats)
