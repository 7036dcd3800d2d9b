"""The expert-dispatch seam: every MoE layer calls `moe_experts_forward`.

    y[n] = sum_j weights[n, j] * expert_{indices[n, j]}(x[n])

`dispatch` picks how routes reach their experts: "local" (all experts here, no communication) is
the reference schedule; the expert-parallel schedules ("ep", "llep", "pipelined_llep") take the
expert group and this rank's expert shard. The model never sees the difference.

Legend: N tokens, H hidden, I expert hidden width, E experts (global), E_l local experts, k top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from mop_train.ops.moe_dispatch.ep import DispatchStats, ep_experts_forward
from mop_train.ops.moe_dispatch.llep import llep_experts_forward
from mop_train.ops.moe_dispatch.local import grouped_swiglu, local_experts_forward
from mop_train.ops.moe_dispatch.pipelined_llep import max_received_bound, pipelined_llep_experts_forward
from mop_train.ops.moe_dispatch.reference import reference_experts_forward

DISPATCH_MODES = ("local", "ep", "llep", "pipelined_llep")
_LLEP_OPTIONS = ("alpha", "min_tokens_per_gemm", "imbalance_threshold", "stats")
_SCHEDULES = {  # dispatch -> (function, accepted options)
    "ep": (ep_experts_forward, ("stats",)),
    "llep": (llep_experts_forward, _LLEP_OPTIONS),
    "pipelined_llep": (pipelined_llep_experts_forward,
                       _LLEP_OPTIONS + ("token_budget", "max_chunks", "membership")),
}


def moe_experts_forward(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                        w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, *,
                        dispatch: str = "local", group=None, **options: Any) -> torch.Tensor:
    """Routed SwiGLU experts.

    Args:
        x: [N, H] this rank's tokens.
        indices: [N, k] global expert ids; weights: [N, k] routing weights (differentiable).
        w1, w3: [E_l, I, H]; w2: [E_l, H, I] — all E experts for "local", this rank's contiguous
            shard of E / group_size experts otherwise.
        dispatch: one of DISPATCH_MODES.
        group: the expert process group (ignored by "local").
        options: schedule options: none for "local"; "ep" takes stats (a DispatchStats to
            fill with per-call figures for metrics); "llep" takes alpha,
            min_tokens_per_gemm, imbalance_threshold and stats;
            "pipelined_llep" takes those plus token_budget, max_chunks, membership.
    Returns:
        y: [N, H]
    """
    if dispatch == "local":
        if options:
            raise ValueError(f"dispatch='local' takes no options, got {sorted(options)}")
        return local_experts_forward(x, indices, weights, w1, w2, w3)
    schedule = _SCHEDULES.get(dispatch)
    if schedule is None:
        raise ValueError(f"unknown dispatch {dispatch!r}; expected one of {DISPATCH_MODES}")
    fn, accepted = schedule
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"dispatch={dispatch!r} does not take options {unknown}; it takes {list(accepted)}")
    return fn(x, indices, weights, w1, w2, w3, group, **options)


__all__ = ["DISPATCH_MODES", "DispatchStats", "grouped_swiglu", "max_received_bound", "moe_experts_forward",
           "reference_experts_forward"]
