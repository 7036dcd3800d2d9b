"""The combine every dispatch schedule ends with: y[ids[r]] += rows[r], saving only what backward needs.

    y = combine_rows(y, ids, rows)        # y [N, H] (updated in place), ids [R] int64, rows [R, H]

Plain `y.index_add_(0, ids, rows)` (and `index_add`) records IndexAddBackward0, whose formula
(torch's tools/autograd/derivatives.yaml, generated into torch/csrc/autograd/generated/Functions.h,
which declares its saved `index_` and `source_`) is

    self:   grad
    source: maybe_multiply(source.dim() > 0 ? grad.index_select(dim, index).expand_as(source)
                                            : grad.index_select(dim, index.squeeze(0)), alpha)

It saves `source` only for `expand_as` (its shape), yet autograd keeps the whole tensor alive: every
route's output rows [R, H], N*k*H elements per MoE layer (18 GiB at 1M tokens for `small`).
`CombineRows` saves the ids alone. Its backward is that formula at dim 0, alpha 1 and a 2-D source:
maybe_multiply(t, 1) returns t itself and `expand_as` to the shape the selection already has is a
view, so the source's gradient is exactly `grad.index_select(0, ids)` and y's is `grad` unchanged:
bit for bit what autograd computes (tests/ops/test_moe_dispatch_combine.py checks both on random
fp32/bf16 inputs with repeated ids). The forward is the same `index_add_` into y, marked dirty.
Modelled on torch's own IndexAddBackward0 (same formula, minus the saved source); no other tool's
code used.

Legend: N tokens, H hidden, R routes (rows added), k top-k.
"""

from __future__ import annotations

import torch


class CombineRows(torch.autograd.Function):
    """y.index_add_(0, ids, rows) saving `ids` only (not `rows`): see the module docstring."""

    @staticmethod
    def forward(ctx, y, ids, rows):
        if rows.dim() != 2 or ids.dim() != 1 or rows.shape[0] != ids.shape[0]:
            raise ValueError(f"combine_rows: rows must be [R, H] with ids [R], got rows {tuple(rows.shape)} and "
                             f"ids {tuple(ids.shape)}; pass one id per row")
        ctx.save_for_backward(ids)
        ctx.mark_dirty(y)
        return y.index_add_(0, ids, rows)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad_rows = grad.index_select(0, ids) if ctx.needs_input_grad[2] else None
        return (grad if ctx.needs_input_grad[0] else None), None, grad_rows


def combine_rows(y: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y [N, H] += rows [R, H] at token ids [R] (in place, returned); backward keeps ids, not rows."""
    return CombineRows.apply(y, ids, rows)


__all__ = ["CombineRows", "combine_rows"]
