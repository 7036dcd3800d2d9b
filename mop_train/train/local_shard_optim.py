"""Adam and AdamW that step the local shards of DTensor parameters: the same kernels on the same
tensors as torch's optimizers, without DTensor's dispatch around them.

FSDP2 and our group-sharded weights (`mop_train.parallel.sharding`) make every parameter, gradient
and moment a DTensor, so torch.optim's fused (or foreach) AdamW goes through DTensor's operator
dispatch once per step with every one of them as an argument: unwrapping each, and placing each
scalar step count on the mesh. That is host time, the same at any world size, and the device waits
it out because the non-finite check reads the gradient norm just before the step: 3.7 ms of device
idle per step of `small` at 2 x 4K on one H100 (RESULTS.md 2026-12-07, `idle_causes`); 4.8 against
2.2 ms of host time per fused step over 160 small parameters on CPU (`benchmarks/optimizer_host_overhead.py`).

Adam's update is elementwise, so on shards whose gradient and moments carry the parameter's own
placements it is the same arithmetic on each rank's local tensors, which is what DTensor's dispatch
runs too. `_init_group` (torch's, unchanged: state creation, step counts, checks) fills the lists
that torch's functional `adam` receives; the lists' DTensors are then replaced by their local
tensors. The optimizer state stays DTensors, so `state_dict`, DCP checkpoints and resharded resumes
are unchanged. A group holding a gradient or moment whose placements differ from its parameter's
(a `Partial` gradient, say) is left to DTensor's dispatch, which knows how to handle it.

Taken as a model: torchtitan 0.2.2's `build_optimizers` (the optimizer kwargs, the container) and
torch.optim.Adam.step (the `_init_group` -> functional `adam` split this relies on).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local_when_aligned(params: list, others: list[list]) -> bool:
    """Replace every DTensor of `params` and `others` (lists parallel to params, or empty) by its
    local tensor, in place, if each one has its parameter's mesh and placements; else leave all."""
    for k, p in enumerate(params):
        if not isinstance(p, DTensor):
            continue
        for lst in others:
            t = lst[k] if lst else None
            if t is not None and (not isinstance(t, DTensor) or t.device_mesh != p.device_mesh
                                  or t.placements != p.placements):
                return False
    for lst in (params, *others):
        lst[:] = [t.to_local() if isinstance(t, DTensor) else t for t in lst]
    return True


class _LocalShards:
    """Mixin over torch.optim.Adam / AdamW (see the module docstring)."""

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        has_complex = super()._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs,
                                          max_exp_avg_sqs, state_steps)
        # the step counts are plain tensors (no placements); the rest run parallel to the parameters
        _local_when_aligned(params_with_grad, [grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs])
        return has_complex


class LocalShardAdam(_LocalShards, torch.optim.Adam):
    """torch.optim.Adam stepping DTensor parameters' local shards (module docstring)."""


class LocalShardAdamW(_LocalShards, torch.optim.AdamW):
    """torch.optim.AdamW stepping DTensor parameters' local shards (module docstring)."""


LOCAL_SHARD_OPTIMIZERS = {"Adam": LocalShardAdam, "AdamW": LocalShardAdamW}
