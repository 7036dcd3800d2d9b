"""The gathers, permutations and combines of every dispatch schedule, each saving only what its backward needs.

    rows = gather_token_rows(x, ids, slots)     # x [N, H] -> [R, H]: ids [R] the token of each route
    rows = permute_rows(rows, perm, inverse)    # rows in another order (send order, receive order)
    y = sum_token_rows(rows, slots, ids)        # [N, H]: each token's k rows summed (local, ep)
    y = add_token_rows(y, tokens, slots, rows)  # y[tokens] += that sum over one chunk (llep, pipelined_llep)

slots [N, k] = token_slots(order, k) is where each token's routes sit among rows laid out in `order`.

Why not autograd's own indexing. A plain `y.index_add_(0, ids, rows)` records IndexAddBackward0,
whose formula (torch's tools/autograd/derivatives.yaml, generated into
torch/csrc/autograd/generated/Functions.h, which declares its saved `index_` and `source_`) is

    self:   grad
    source: maybe_multiply(source.dim() > 0 ? grad.index_select(dim, index).expand_as(source)
                                            : grad.index_select(dim, index.squeeze(0)), alpha)

It saves `source` only for `expand_as` (its shape), yet autograd keeps the whole tensor alive: every
route's output rows [R, H], N*k*H elements per MoE layer (18 GiB at 1M tokens for `small`). At dim 0,
alpha 1 and a 2-D source, maybe_multiply(t, 1) is t and the `expand_as` a view, so the rows' gradient
is exactly grad.index_select(0, ids) and y's is grad: the backward of both combines here, which save
ids or slots, never rows. Their forward replaces index_add_'s per-element atomics on CUDA, which ran
at a tenth of the device's bandwidth (28.5 ms a step at 1 x 32K for `small`'s 11 MoE layers, RESULTS.md
2026-12-03; 604 MB of rows a layer) and made the sum order, and so its bf16 result, change from run to
run: each token's k rows are gathered by index_select and reduced over j by torch.sum (`sum_slots`), a
chunk of tokens at a time, deterministic, and in bf16 accumulated in fp32 and rounded once (index_add_
rounds after every row): the same sum, closer to the fp32 one. The gathered chunk is at most
COMBINE_CHUNK_BYTES and never more than the rows themselves, which the dispatch bound already counts in
backward (memory.py: R*H).

The segment sum is also the adjoint of the gather that feeds the experts: `x[ids]` records
IndexBackward0, whose index_put_(accumulate=True) sorts the ids and adds each token's k gradient rows
one at a time (`indexing_backward_kernel`, with the receive permutations below 28.8 ms a step at
1 x 32K on one H100, RESULTS.md 2026-12-07); `gather_token_rows` returns x's gradient as the segment
sum of its rows' instead. A permutation's IndexBackward0 runs the same kernel although every row
receives exactly one gradient row: `permute_rows` gathers the gradient by the inverse permutation
(autograd's values, a zero's sign aside). `add_token_rows` is PipelinedLLEP's combine of one chunk,
whose tokens are a slice of the layer's holding all k of their routes: y[tokens] += the segment sum,
its backward the rows' gradient gathered by the token of each row (the inverse of the slots).
Modelled on torch's IndexAddBackward0 and IndexBackward0 (same formulas, less saved); no other
tool's code used.

Legend: N tokens, H hidden, R = N*k routes (rows), k top-k, n tokens of one chunk.
"""

from __future__ import annotations

import torch


COMBINE_CHUNK_BYTES = 32 * 2**20
"""Bytes of gathered rows `sum_token_rows` holds at once: enough tokens per launch to run near the
device's bandwidth, few enough to stay out of the memory plan."""


def sum_slots(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, H]: row t the sum over j of rows[slots[t, j]] (rows [R, H], slots [n, k] int64), reduced by
    torch.sum over j in slot order (fp32 accumulation for bf16), at most COMBINE_CHUNK_BYTES gathered
    at once."""
    n, k = slots.shape
    H = rows.shape[1]
    y = rows.new_empty(n, H)
    step = max(1, COMBINE_CHUNK_BYTES // max(1, k * H * rows.element_size()))
    for start in range(0, n, step):
        part = slots[start:start + step]                                         # [n', k]
        torch.sum(rows.index_select(0, part.reshape(-1)).view(part.shape[0], k, H), dim=1,
                  out=y[start:start + step])
    return y


class SumTokenRows(torch.autograd.Function):
    """y[t] = sum_j rows[slots[t, j]], saving `ids` only: see the module docstring."""

    @staticmethod
    def forward(ctx, rows, slots, ids):
        if rows.dim() != 2 or slots.dim() != 2 or ids.dim() != 1 or ids.shape[0] != rows.shape[0] \
                or slots.numel() != rows.shape[0]:
            raise ValueError(f"sum_token_rows: rows must be [R, H] with ids [R] and slots [N, k], N * k = R; got "
                             f"rows {tuple(rows.shape)}, slots {tuple(slots.shape)}, ids {tuple(ids.shape)}")
        ctx.save_for_backward(ids)
        return sum_slots(rows, slots)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return (grad.index_select(0, ids) if ctx.needs_input_grad[0] else None), None, None


def sum_token_rows(rows: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, H]: row t the sum of rows[slots[t, j]] over j, where rows [R, H] hold exactly k = R / N rows
    per token, ids [R] the token of each row (ids[slots[t, j]] == t); backward keeps ids, not rows."""
    return SumTokenRows.apply(rows, slots, ids)


class GatherTokenRows(torch.autograd.Function):
    """x[ids] where every token is gathered exactly k times; backward is the segment sum over `slots`
    (see the module docstring), saving the slots only."""

    @staticmethod
    def forward(ctx, x, ids, slots):
        if x.dim() != 2 or ids.dim() != 1 or slots.dim() != 2 or slots.shape[0] != x.shape[0] \
                or slots.numel() != ids.shape[0]:
            raise ValueError(f"gather_token_rows: x must be [N, H] with slots [N, k] and ids [N * k]; got x "
                             f"{tuple(x.shape)}, slots {tuple(slots.shape)}, ids {tuple(ids.shape)}")
        ctx.save_for_backward(slots)
        return x.index_select(0, ids)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        return sum_slots(grad, slots), None, None


def gather_token_rows(x: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[R, H] = x[ids] for x [N, H], where ids [R] names every token k = R / N times and slots [N, k]
    is where (ids[slots[t, j]] == t, `token_slots`); x's gradient is the per-token sum of its rows'."""
    return GatherTokenRows.apply(x, ids, slots)


class PermuteRows(torch.autograd.Function):
    """x[perm] for a permutation `perm` of x's rows; backward gathers by `inverse` (saved, nothing else)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        if not (perm.dim() == inverse.dim() == 1 and perm.shape[0] == inverse.shape[0] == x.shape[0]):
            raise ValueError(f"permute_rows: perm and inverse must both hold one id per row of x; got x "
                             f"{tuple(x.shape)}, perm {tuple(perm.shape)}, inverse {tuple(inverse.shape)}")
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[perm] (rows of any tensor with a first dimension), `inverse` = inverse_permutation(perm)."""
    return PermuteRows.apply(x, perm, inverse)


class AddTokenRows(torch.autograd.Function):
    """y[tokens] += sum_j rows[slots[t, j]] for one chunk whose n tokens (a slice of y's rows) hold all
    of their k routes' rows [n * k, H]; saves the slots only."""

    @staticmethod
    def forward(ctx, y, tokens, slots, rows):
        target = y[tokens]                                                       # [n, H] view
        if rows.dim() != 2 or slots.dim() != 2 or slots.shape[0] != target.shape[0] \
                or slots.numel() != rows.shape[0]:
            raise ValueError(f"add_token_rows: the chunk's {target.shape[0]} tokens need slots [n, k] and rows "
                             f"[n * k, H]; got slots {tuple(slots.shape)}, rows {tuple(rows.shape)}")
        ctx.tokens = tokens
        ctx.save_for_backward(slots)
        ctx.mark_dirty(y)
        target.add_(sum_slots(rows, slots))
        return y

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        grad_rows = None
        if ctx.needs_input_grad[3]:
            row_token = inverse_permutation(slots.reshape(-1)) // slots.shape[1]  # [n * k] token of each row
            grad_rows = grad[ctx.tokens].index_select(0, row_token)
        return (grad if ctx.needs_input_grad[0] else None), None, None, grad_rows


def add_token_rows(y: torch.Tensor, tokens: slice, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y [N, H] (in place, returned) += at rows `tokens` (n of them) the sum over j of rows[slots[t, j]]:
    rows [n * k, H] are every route of those n tokens, slots [n, k] their positions in `rows`."""
    return AddTokenRows.apply(y, tokens, slots, rows)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def token_slots(order: torch.Tensor, k: int) -> torch.Tensor:
    """slots [N, k] for rows laid out in `order` (route ids t * k + j, e.g. sorted by expert): the row
    position of each token's j-th route."""
    return inverse_permutation(order).view(-1, k)


__all__ = ["COMBINE_CHUNK_BYTES", "AddTokenRows", "GatherTokenRows", "PermuteRows", "SumTokenRows", "add_token_rows",
           "gather_token_rows", "inverse_permutation", "permute_rows", "sum_slots", "sum_token_rows", "token_slots"]
