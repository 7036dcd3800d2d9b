"""The combine every dispatch schedule ends with: y[ids[r]] += rows[r], saving only what backward needs.

    y = combine_rows(y, ids, rows)        # y [N, H] (updated in place), ids [R] int64, rows [R, H]
    y = sum_token_rows(rows, slots, ids)  # every token has exactly k rows: slots [N, k] (local, ep)

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

`sum_token_rows` is the combine where every token receives exactly k rows (the local and
expert-parallel schedules, whose rows come back one per route): y[t] = sum_j rows[slots[t, j]],
gathered by index_select and reduced over j by torch.sum, a chunk of tokens at a time. It replaces
index_add_'s per-element atomics on CUDA, which ran at a tenth of the device's bandwidth (28.5 ms a
step at 1 x 32K for `small`'s 11 MoE layers, RESULTS.md 2026-12-03; 604 MB of rows a layer) and
made the step's sum order, and so its bf16 result, change from run to run. The reduction is
deterministic, and in bf16 it accumulates the k rows in fp32 and rounds once (index_add_ rounds
after every row): the same sum, closer to the fp32 one. Its backward is CombineRows': the rows'
gradient is grad.index_select(0, ids), so for the same incoming gradient every gradient of the layer
is bit for bit what CombineRows gives (y itself differs from index_add_'s by the sum's rounding).
The gathered chunk is at most COMBINE_CHUNK_BYTES, and never more than the rows themselves, which
the dispatch bound already counts in backward (memory.py: R*H).

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


COMBINE_CHUNK_BYTES = 32 * 2**20
"""Bytes of gathered rows `sum_token_rows` holds at once: enough tokens per launch to run near the
device's bandwidth, few enough to stay out of the memory plan."""


class SumTokenRows(torch.autograd.Function):
    """y[t] = sum_j rows[slots[t, j]], saving `ids` only: see the module docstring."""

    @staticmethod
    def forward(ctx, rows, slots, ids):
        if rows.dim() != 2 or slots.dim() != 2 or ids.dim() != 1 or ids.shape[0] != rows.shape[0] \
                or slots.numel() != rows.shape[0]:
            raise ValueError(f"sum_token_rows: rows must be [R, H] with ids [R] and slots [N, k], N * k = R; got "
                             f"rows {tuple(rows.shape)}, slots {tuple(slots.shape)}, ids {tuple(ids.shape)}")
        N, k = slots.shape
        H = rows.shape[1]
        y = rows.new_empty(N, H)
        step = max(1, COMBINE_CHUNK_BYTES // max(1, k * H * rows.element_size()))
        for start in range(0, N, step):
            part = slots[start:start + step]                                     # [n, k]
            torch.sum(rows.index_select(0, part.reshape(-1)).view(part.shape[0], k, H), dim=1,
                      out=y[start:start + step])
        ctx.save_for_backward(ids)
        return y

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return (grad.index_select(0, ids) if ctx.needs_input_grad[0] else None), None, None


def sum_token_rows(rows: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, H]: row t the sum of rows[slots[t, j]] over j, where rows [R, H] hold exactly k = R / N rows
    per token, ids [R] the token of each row (ids[slots[t, j]] == t); backward keeps ids, not rows."""
    return SumTokenRows.apply(rows, slots, ids)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def token_slots(order: torch.Tensor, k: int) -> torch.Tensor:
    """slots [N, k] for rows laid out in `order` (route ids t * k + j, e.g. sorted by expert): the row
    position of each token's j-th route."""
    return inverse_permutation(order).view(-1, k)


__all__ = ["COMBINE_CHUNK_BYTES", "CombineRows", "SumTokenRows", "combine_rows", "inverse_permutation",
           "sum_token_rows", "token_slots"]
