"""A parameter's working weight as a differentiable function of the parameter.

With weights = "bf16" / "stream" a parameter kept out of FSDP2 (an expert or vocab shard: an fp32
DTensor whose local tensor is OffloadStreamAdamW's master) is computed with through a separate
working tensor (bf16(master), on the device or in a window slot). `WorkingWeight.apply(param,
working, dtype)` returns it in `dtype` and hands backward's gradient to the parameter as an fp32
DTensor, which is exactly what the device path's `param.to_local().to(dtype)` does (its backward casts
the gradient to fp32), so gradients are bitwise the same.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def in_backward() -> bool:
    """True while autograd runs a backward pass (where checkpoints recompute)."""
    return torch._C._current_graph_task_id() != -1


class WorkingWeight(torch.autograd.Function):
    """forward(param DTensor, working tensor of param's local shape, dtype, on_backward) -> working
    in `dtype` (a view when the dtype is the working tensor's); backward -> the gradient cast to the
    parameter's dtype, as a DTensor of the parameter's sharding; `on_backward()` is called then."""

    @staticmethod
    def forward(ctx, param, working, dtype, on_backward):
        if not isinstance(param, DTensor):
            raise ValueError(f"WorkingWeight expects a DTensor parameter, got {type(param).__name__}")
        spec = param._spec
        ctx.spec = DTensorSpec(spec.mesh, spec.placements,
                               tensor_meta=TensorMeta(param.shape, param.stride(), param.dtype))
        ctx.on_backward = on_backward
        return working.view_as(working) if working.dtype == dtype else working.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_backward is not None:
            ctx.on_backward()
        local = grad.to(ctx.spec.tensor_meta.dtype)
        return DTensor(local, ctx.spec, requires_grad=False), None, None, None
