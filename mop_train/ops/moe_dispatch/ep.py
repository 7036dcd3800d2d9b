"""Standard expert parallelism: `dispatch="ep"`.

Rank r of the expert group owns experts [r*E_l, (r+1)*E_l). Each route travels to its owner and back:
  1. sort this rank's routes by expert (stable); count routes per expert;
  2. exchange the counts (all-to-all), which gives every receiver its split sizes and per-expert rows;
  3. dispatch rows and routing weights with one all-to-all of uneven splits;
  4. the receiver regroups rows by local expert, runs the grouped SwiGLU and scales by the weight;
  5. combine: the reverse all-to-all returns each route's output; sum over the k slots per token.
Backward is the same exchanges reversed (autograd). At group size 1 this is `dispatch="local"`.
`receive_order` and `weighted_experts` are shared with LLEP and PipelinedLLEP.
Paper: section 3.1 (the baseline PipelinedLLEP is measured against).

Legend: N tokens, H hidden, I expert hidden width, E experts, E_l = E / P local experts, k top-k,
R = N*k routes, P expert-group size, S expert slots on the receiver (E_l for EP).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from mop_train.ops.moe_dispatch.combine import (gather_token_rows, inverse_permutation, permute_rows, sum_token_rows,
                                                token_slots)
from mop_train.ops.moe_dispatch.comm import (all_to_all, exchange_counts, group_size, host_to_device,
                                             stands_for_identical_ranks)
from mop_train.ops.moe_dispatch.local import grouped_swiglu, local_experts_forward, route_counts
from mop_train.ops.moe_dispatch.stats import DispatchStats, record_stats


def receive_order(recv_counts: torch.Tensor, device, slot_of_col: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows arrive source-major and column-ascending within a source; regroup by slot.

    Args:
        recv_counts: [P, X] int64 (CPU): rows source s sends for column x (a local expert for EP,
            a global expert id for LLEP).
        slot_of_col: [X] int64 (CPU) slot each column maps to (identity if None); columns with
            rows must map to a slot in [0, S).
    Returns:
        perm [R'] on `device` (received row ids in slot-major order, stable in source),
        slot_counts [S] (CPU).
    """
    P, X = recv_counts.shape
    if slot_of_col is None:
        slot_of_col = torch.arange(X)
    used = recv_counts.sum(0) > 0                                           # [X]
    num_slots = int(slot_of_col.max()) + 1 if X else 0
    slot_counts = torch.zeros(num_slots, dtype=torch.int64).index_add_(
        0, slot_of_col[used], recv_counts.sum(0)[used])                     # [S]
    # Built on the device: R' is route-sized, the counts are not.
    slot_of_row = torch.repeat_interleave(host_to_device(slot_of_col.clamp(min=0).repeat(P), device),
                                          host_to_device(recv_counts.reshape(-1), device),
                                          output_size=int(recv_counts.sum()))  # [R']
    return torch.argsort(slot_of_row, stable=True), slot_counts


def weighted_experts(rows: torch.Tensor, route_w: torch.Tensor, slot_counts: torch.Tensor,
                     w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """rows [R', H] sorted by slot, route_w [R'], slot_counts [S] -> weighted outputs [R', H]."""
    out = grouped_swiglu(rows, slot_counts, w1, w2, w3)           # [R', H]
    return out * route_w.unsqueeze(1).to(out.dtype)


def exchange_and_compute(rows: torch.Tensor, route_w: torch.Tensor, send_splits: Sequence[int],
                         recv_counts: torch.Tensor, expert_fn: Callable, group,
                         slot_of_col: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch -> weighted experts on the receiver -> combine, all in one go.

    Args:
        rows: [R, H] ordered by (destination rank, column); route_w: [R] routing weights.
        send_splits: [P] rows for each destination.
        recv_counts, slot_of_col: what this rank receives, as in `receive_order`.
        expert_fn: (rows [R', H] sorted by slot, route_w [R'], slot_counts [S]) -> [R', H].
    Returns:
        [R, H] weighted expert output of every route, in the order of `rows`.
    """
    recv_splits = recv_counts.sum(1).tolist()
    recv_rows, recv_w = all_to_all((rows, route_w), send_splits, recv_splits, group)  # [R', H], [R']
    perm, slot_counts = receive_order(recv_counts, rows.device, slot_of_col)
    inverse = inverse_permutation(perm)
    out = expert_fn(permute_rows(recv_rows, perm, inverse), permute_rows(recv_w, perm, inverse),
                    slot_counts)                                   # [R', H] slot order
    out = permute_rows(out, inverse, perm)                         # back to arrival order
    (back,) = all_to_all((out,), recv_splits, send_splits, group)  # [R, H]
    return back


def ep_experts_forward(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                       w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, group, *,
                       stats: DispatchStats | None = None) -> torch.Tensor:
    """x [N, H]; indices, weights [N, k]; w1, w3 [E_l, I, H]; w2 [E_l, H, I] this rank's shard -> y [N, H]."""
    P = group_size(group)
    if P == 1:
        if stats is not None:
            record_stats(stats, [indices.numel()], group, x.device)
        return local_experts_forward(x, indices, weights, w1, w2, w3)
    N, k = indices.shape
    E_l = w1.shape[0]
    E = E_l * P
    flat = indices.reshape(-1)                                     # [R]
    order = torch.argsort(flat, stable=True)                       # [R] sorted by expert = by owner
    # Ids outside [0, E) are counted in a last column that travels with the counts to every rank, so
    # the whole group refuses them (one rank raising alone would leave the others in the exchange).
    bad = (flat < 0) | (flat >= E)
    counts = route_counts(torch.where(bad, E, flat), E + 1)       # [E + 1]: per expert, then bad ids
    send = torch.cat([counts[:E].view(P, E_l), counts[E:].expand(P, 1)], 1)   # [P, E_l + 1]
    received = exchange_counts(send, group).cpu()                  # [P, E_l + 1], row s from rank s
    if int(received[:, E_l].sum()):
        ranks = [s for s in range(P) if received[s, E_l]]
        raise ValueError(f"indices hold expert ids outside [0, {E}) on rank(s) {ranks} of the expert group, "
                         f"which has {P} ranks x {E_l} local experts = {E}; pass this rank's expert shard")
    recv_counts = received[:, :E_l].contiguous()                   # [P, E_l]
    send_splits = counts[:E].view(P, E_l).sum(1).tolist()
    token = order // k                                             # [R]
    if stats is not None:
        # A world of identical ranks: destination d receives send_splits[d] from each of the P sources.
        peak = [P * max(send_splits)] if stands_for_identical_ranks(group) else None
        record_stats(stats, [int(recv_counts.sum())], group, x.device, chunk_sent=[sum(send_splits)],
                     identical_world_peak=peak)
    expert_fn = functools.partial(weighted_experts, w1=w1, w2=w2, w3=w3)
    slots = token_slots(order, k)                                  # [N, k] row of each route
    out = exchange_and_compute(gather_token_rows(x, token, slots),
                               permute_rows(weights.reshape(-1), order, slots.reshape(-1)), send_splits,
                               recv_counts, expert_fn, group)      # [R, H]
    return sum_token_rows(out, slots, token)                       # [N, H]; `out` not saved


__all__ = ["ep_experts_forward", "exchange_and_compute", "receive_order",
           "weighted_experts"]
