"""The expert-dispatch seam: every MoE layer calls `moe_experts_forward`.

    y[n] = sum_j weights[n, j] * expert_{indices[n, j]}(x[n])

    y = moe_experts_forward(x, indices, weights, w1, w2, w3)                   # "local"
    stats = DispatchStats()
    y = moe_experts_forward(x, indices, weights, w1_shard, w2_shard, w3_shard,
                            PipelinedLLEPOptions(token_budget=2048), group=expert_group, stats=stats)

How routes reach their experts is picked by the options' type (options.py): None runs every expert
here with no communication, the reference schedule; EPOptions, LLEPOptions and
PipelinedLLEPOptions take the expert group and this rank's expert shard. The model never sees the
difference: parallelization binds an `ExpertDispatch` (options, group, and the `DispatchStats` of
its last call) to each MoE layer, which calls the seam through it.

Legend: N tokens, H hidden, I expert hidden width, E experts (global), E_l local experts, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mop_train.ops.moe_dispatch.ep import ep_experts_forward
from mop_train.ops.moe_dispatch.llep import llep_experts_forward
from mop_train.ops.moe_dispatch.local import grouped_swiglu, local_experts_forward
from mop_train.ops.moe_dispatch.options import (DISPATCH_MODES, DispatchOptions, EPOptions, LLEPOptions,
                                                PipelinedLLEPOptions, dispatch_options)
from mop_train.ops.moe_dispatch.pipelined_llep import max_received_bound, pipelined_llep_experts_forward
from mop_train.ops.moe_dispatch.reference import reference_experts_forward
from mop_train.ops.moe_dispatch.stats import DispatchStats


def moe_experts_forward(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                        w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                        options: DispatchOptions | None = None, *, group=None,
                        stats: DispatchStats | None = None) -> torch.Tensor:
    """Routed SwiGLU experts.

    Args:
        x: [N, H] this rank's tokens.
        indices: [N, k] global expert ids; weights: [N, k] routing weights (differentiable).
        w1, w3: [E_l, I, H]; w2: [E_l, H, I] — all E experts for "local", this rank's contiguous
            shard of E / group_size experts otherwise.
        options: None ("local"), or the schedule's options: EPOptions(), LLEPOptions(...),
            PipelinedLLEPOptions(...).
        group: the expert process group (not used by "local").
        stats: a DispatchStats the expert-parallel schedule fills with this call's figures
            (chunks, relocated routes, routes received per chunk); "local" records none.
    Returns:
        y: [N, H]
    """
    kind = type(options)
    if options is None:
        if stats is not None:
            raise ValueError("dispatch \"local\" (options None) records no DispatchStats; pass stats only "
                             "with EPOptions, LLEPOptions or PipelinedLLEPOptions")
        return local_experts_forward(x, indices, weights, w1, w2, w3)
    if kind is EPOptions:
        return ep_experts_forward(x, indices, weights, w1, w2, w3, group, stats=stats)
    if kind is LLEPOptions:
        return llep_experts_forward(x, indices, weights, w1, w2, w3, group, options, stats=stats)
    if kind is PipelinedLLEPOptions:
        return pipelined_llep_experts_forward(x, indices, weights, w1, w2, w3, group, options, stats=stats)
    raise ValueError(f"options = {options!r} is not a dispatch schedule's options; pass None (local), "
                     f"EPOptions(), LLEPOptions(...) or PipelinedLLEPOptions(...) (a schedule named in a "
                     f"config, one of {DISPATCH_MODES}, is built by dispatch_options(name, settings))")


@dataclass
class ExpertDispatch:
    """One MoE layer's expert-parallel dispatch, bound when parallelism is applied: the schedule's
    options, the expert group, and the figures of the layer's last forward (`stats`, filled by
    the schedule through `moe_experts_forward`, read by the loop at logging time)."""

    options: DispatchOptions
    group: object = None                 # torch.distributed ProcessGroup; None is a group of one
    stats: DispatchStats = field(default_factory=DispatchStats)

    def __call__(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        """`moe_experts_forward` with this binding's options, group and stats: x [N, H] -> y [N, H]."""
        return moe_experts_forward(x, indices, weights, w1, w2, w3, self.options, group=self.group,
                                   stats=self.stats)


__all__ = ["DISPATCH_MODES", "DispatchOptions", "DispatchStats", "EPOptions", "ExpertDispatch", "LLEPOptions",
           "PipelinedLLEPOptions", "dispatch_options", "grouped_swiglu", "max_received_bound",
           "moe_experts_forward", "reference_experts_forward"]
