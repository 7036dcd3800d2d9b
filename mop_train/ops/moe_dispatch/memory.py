"""Device bytes the routed experts hold for backward, per dispatch schedule, for the planner.

A route is one (token, expert) pair; a rank's experts receive R routes. What is alive while the
layer runs backward:
  - "local", "ep", "llep": every received route's rows x_r [R, H], h1, h3, silu(h1), their product
    [R, I] and the expert output [R, H] (saved by the weighting), so (2H + 4I) per route, plus the
    combine's gradient per route (H) while the weighting runs backward. The combine (combine.py's
    SumTokenRows, AddTokenRows) saves token ids or slots, not the rows it adds (a plain index_add would: H more).
    R is N*k under balanced routing ("ep" can receive up to E_p * N * k routes when one rank's
    experts are hot; "llep" holds a receiver to max(alpha, imbalance_threshold) x the mean).
  - "pipelined_llep": each chunk saves its received rows (PipelinedLLEP recomputes the [R', I]
    activations in its backward, chunked_experts.ChunkExperts), so N*k*H over the layer, plus
    `route_index_bytes` of index bookkeeping per route (counted by tests/ops/test_moe_dispatch_memory.py);
    the combine saves its token slots only (combine.AddTokenRows; autograd's IndexAddBackward0 of a
    plain `index_add_` would keep the rows it adds, N*k*H more, for `expand_as` alone); the
    backward recomputes one chunk at a time: the token budget guarantees a destination at most
    `max_received_bound` (E_p * k * c_eff) routes of it, and LLEP's relocation holds it to
    max(alpha, threshold) x the mean k * c_eff (+ one GEMM's minimum), the figure planned here, with
    (2H + 7I) of recomputed activations and gradients per route.
  - The grouped weight-gradient GEMM on CUDA makes one weight-sized temporary per chunk (E_l I H).

Legend: N tokens of this rank, k top-k, H hidden, I expert width, E_p expert-group size,
E_l experts on this rank, c_eff tokens per chunk = ceil(N / K), K = min(ceil(N / c), K_max).
"""

from __future__ import annotations

from dataclasses import dataclass

from mop_train.ops.bound import DeviceBound
from mop_train.ops.moe_dispatch.options import DispatchOptions, LLEPOptions, PipelinedLLEPOptions
from mop_train.ops.moe_dispatch.pipelined_llep import max_received_bound, num_chunks

ROUTE_INDEX_BYTES = 4 * 8 + 4
"""What llep.run_chunks saves per route besides rows: four int64 index vectors (the inverse of the
layer's send order, saved by the routing weights' permutation; each chunk's token slots, saved by both
its token gather and its combine, combine.py; the receive permutation and its inverse, each saved by
the permutations the other undoes) and the permuted fp32 routing weight."""

LOCAL_ROUTE_INDEX_BYTES = ROUTE_INDEX_BYTES - 2 * 8
"""The same at group size one, where rows arrive in slot order: no receive permutation, no inverse."""


def route_index_bytes(group_size: int) -> int:
    """Index bytes run_chunks saves per route in an expert group of `group_size` ranks."""
    return LOCAL_ROUTE_INDEX_BYTES if group_size == 1 else ROUTE_INDEX_BYTES


@dataclass(frozen=True)
class RoutedShapes:
    """One MoE layer's sizes on this rank, as the dispatch bound needs them."""
    tokens: int             # N, this rank's token positions
    hidden: int             # H
    inter: int              # I, one expert's width
    top_k: int              # k
    group_size: int         # E_p (1 for "local")
    local_experts: int      # E_l = E / E_p
    act_bytes: int          # bytes per activation element (2 for bf16)


def device_bound(options: DispatchOptions | None, shapes: RoutedShapes) -> DeviceBound:
    """The bytes one MoE layer's routed experts save for backward on this rank (`saved`), the most
    they add while their backward runs (`working`), and the formula. `options`: the layer's dispatch
    options (None: "local"), whose settings (c, K_max, alpha, threshold, m) size the bound."""
    saved, transient, how = _routed_bytes(options, shapes)
    return DeviceBound(saved, transient, how)


def _routed_bytes(options: DispatchOptions | None, shapes: RoutedShapes) -> tuple[int, int, str]:
    tokens, group_size, local_experts, act_bytes = (shapes.tokens, shapes.group_size, shapes.local_experts,
                                                    shapes.act_bytes)
    H, I, k = shapes.hidden, shapes.inter, shapes.top_k
    name = "local" if options is None else options.name
    if isinstance(options, LLEPOptions):
        # LLEP relocates above threshold x the mean load, up to alpha x the mean per rank.
        balance = max(options.alpha, options.imbalance_threshold)
    if not isinstance(options, PipelinedLLEPOptions):
        routes = tokens * k
        if isinstance(options, LLEPOptions):
            routes = int(min(group_size, balance) * routes) + options.min_tokens_per_gemm
        # The combine's gradient gathered per route: H per route while the weighting runs backward. Its
        # forward (combine.sum_token_rows) gathers at most min(COMBINE_CHUNK_BYTES, these R*H) at once.
        saved, transient = routes * (2 * H + 4 * I), routes * H
        return (saved * act_bytes, transient * act_bytes,
                f"{name}: {routes:,} routes x (2H + 4I) saved, H in backward"
                + (" (balanced routing; up to E_p x with hot experts)" if name == "ep" else ""))
    K, c_eff = num_chunks(max(tokens, 1), options.token_budget, options.max_chunks)
    # The budget guarantees E_p * k * c_eff; LLEP's plan then holds a destination to max(alpha,
    # threshold) x the mean k * c_eff (one GEMM's worth of helper rows over it at most).
    guaranteed = max_received_bound(group_size, k, c_eff)
    chunk_routes = min(guaranteed, int(balance * k * c_eff) + options.min_tokens_per_gemm)
    # Every chunk's received rows and their index bookkeeping (the combine keeps ids, not rows).
    saved = tokens * k * H * act_bytes + tokens * k * route_index_bytes(group_size)
    # One chunk in backward: its recomputed h1, h3, a, their grads and silu'(h1) (7I), the rows'
    # and output's grads (2H); one weight-sized temporary of the grouped dW (CUDA).
    transient = chunk_routes * (2 * H + 7 * I) + local_experts * I * H
    return (saved, transient * act_bytes,
            f"pipelined_llep: N*k*H received rows + {route_index_bytes(group_size)} B of indices per route over K={K} "
            f"chunks, "
            f"one chunk of {chunk_routes:,} routes "
            f"(LLEP-balanced; the budget alone guarantees E_p*k*c_eff = {guaranteed:,}, c_eff={c_eff:,}) "
            f"recomputed in backward + a dW temporary")
