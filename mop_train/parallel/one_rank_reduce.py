"""FSDP2's gradient reduction at world size 1, without its device-to-device copy.

At one rank FSDP2 has nothing to reduce, yet torch 2.11-2.14's `foreach_reduce`
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) still moves every unit's gradients twice each
backward: it allocates the reduce-scatter input through the unit's reduce-scatter comm, copies the
unsharded gradients into it (the cast to `reduce_dtype`), allocates the output through the same comm and,
having no peer, copies input to output (`reduce_output.copy_(reduce_scatter_input)`): a copy of the whole
unit's fp32 gradients, 13.4 ms of a 289 ms `small` 2 x 4K step on one H100 (2026-12-06 profile).

`OneRankReduce` is FSDP2's own extension point for that comm (`FSDPModule.set_custom_reduce_scatter`,
the `ReduceScatter` protocol of `_fsdp_api.py`): asked for the output, it returns the input FSDP2 has just
filled, so the copy is a copy of a tensor onto itself, which ATen skips. The sharded gradients FSDP2 then
views out of the output are the same values in the same buffer, which lives as long as they do; the
reduction's transient memory halves too. It finds that input as `foreach_reduce`'s own local
`reduce_scatter_input` in the calling frame of that name, checked by size, dtype and device: stateless, so a reduction
that failed halfway cannot pair the next one's buffers wrongly, and where a torch version named it
otherwise it allocates a fresh output, torch's own behaviour (the copy stays; the tests would show it).
It is never called as a collective at world size 1; if it were, it raises rather than reduce wrongly.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class OneRankReduce(ReduceScatter):
    """A unit's reduce-scatter comm at world size 1: the output is the input's buffer (no copy)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        shape = tuple(int(s) for s in size)
        filled = _reduction_input()
        if (isinstance(filled, torch.Tensor) and tuple(filled.shape) == shape and filled.dtype == dtype
                and filled.device == torch.device(device)):
            return filled
        return torch.empty(shape, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        raise RuntimeError(f"OneRankReduce was asked to reduce over a group of {group.size()} ranks; it serves only "
                           "a world of one, where FSDP2 reduces without a collective")


def _reduction_input(max_depth: int = 8) -> torch.Tensor | None:
    """The calling `foreach_reduce`'s `reduce_scatter_input` (None until it is bound: the input's own allocation),
    found by the function's name within `max_depth` frames up, so a wrapper around `allocate` (a profiler's,
    a test's) does not hide it."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "foreach_reduce":
            return frame.f_locals.get("reduce_scatter_input")
        frame = frame.f_back
    return None
