"""PipelinedLLEP: LLEP delivered in K chunks so a receiver's buffers follow a per-source token budget.

  1. K = min(ceil(N / c), K_max), N the largest token count in the expert group (it travels with
     the plan's count all-gather, before any chunk collective), so every rank runs the same K;
  2. chunk i holds local token positions {i, i+K, i+2K, ...} ("strided", the default: it spreads each
     chunk's routes over the plan's destinations) or the i-th block of ceil(N/K) ("contiguous");
     both are functions of N and K only, so a recompute cuts the token axis identically;
  3. the LLEP plan and the weight migration happen once per layer over all chunks; each route goes
     to the same destination as in LLEP;
  4. per chunk: dispatch -> expert matmul (`ChunkExperts`: only its inputs are saved, so under the
     decoder's non-reentrant checkpoint they are packed by its hooks, and a chunk's [R', I]
     intermediates exist only while it computes; backward recomputes them and adds each expert's
     weight gradient in place into one per-layer sum, returned once) -> combine; dispatch(i+1) and
     combine(i-1) are in flight while chunk i computes (async collectives; on gloo they run on its
     worker threads).
Bound: a destination receives at most E_p * k * c_eff routes per chunk, c_eff = ceil(N / K) <= c
unless K_max binds. Paper: section 3.1, Appendix B.1.

Legend: N tokens, H hidden, I expert hidden width, E experts, M = E / P native experts per rank,
k top-k, P = E_p expert-group size, K chunks, c token budget per source and chunk.
"""

from __future__ import annotations

import math

import torch

from mop_train.ops.moe_dispatch.comm import group_size
from mop_train.ops.moe_dispatch.llep import build_plan, run_chunks
from mop_train.ops.moe_dispatch.llep_plan import llep_plan
from mop_train.ops.moe_dispatch.options import PipelinedLLEPOptions
from mop_train.ops.moe_dispatch.stats import DispatchStats


def max_received_bound(group_size_: int, top_k: int, chunk_tokens: int) -> int:
    """The most routes one destination can receive in one chunk: E_p * k * c_eff."""
    return group_size_ * top_k * chunk_tokens


def num_chunks(n_max: int, token_budget: int, max_chunks: int) -> tuple[int, int]:
    """(K, c_eff) from the largest token count in the group: K = min(ceil(N/c), K_max) >= 1."""
    K = max(1, min(math.ceil(n_max / token_budget), max_chunks))
    return K, math.ceil(n_max / K)


def chunk_membership(num_tokens: int, K: int, membership: str) -> list[slice]:
    """The local token positions of each of the K chunks, as slices of [0, N) (every position in one)."""
    if membership == "strided":
        return [slice(i, num_tokens, K) for i in range(K)]
    size = max(1, math.ceil(num_tokens / K))
    return [slice(min(i * size, num_tokens), min((i + 1) * size, num_tokens)) for i in range(K)]


def pipelined_llep_experts_forward(x, indices, weights, w1, w2, w3, group, options: PipelinedLLEPOptions, *,
                                   stats: DispatchStats | None = None) -> torch.Tensor:
    """x [N, H]; indices, weights [N, k]; w1, w3 [M, I, H]; w2 [M, H, I] this rank's shard -> y [N, H].

    At group size 1 there is nothing to relocate or send; the chunked expert compute remains, planned on
    the device without reading a count back (llep._plan_local_chunks), so the layer never makes the host
    wait."""
    N, k = indices.shape
    P = group_size(group)
    if P == 1:   # nothing to count across ranks: no host read (run_chunks plans one rank on the device)
        plan, C, n_max = llep_plan(torch.zeros(1, w1.shape[0], dtype=torch.int64)), None, N
    else:
        plan, C, n_max = build_plan(indices, w1.shape[0] * P, group, options)
    K, c_eff = num_chunks(n_max, options.token_budget, options.max_chunks)
    return run_chunks(x, indices, weights, w1, w2, w3, group, plan, C, chunk_membership(N, K, options.membership),
                      recompute_experts=True, stats=stats, received_bound=max_received_bound(P, k, c_eff))
