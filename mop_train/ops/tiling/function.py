"""The tiled row-wise compute: one autograd.Function that runs a per-token stage over token tiles.

    outs = tiled_rows(fn, rows, weights, tile_tokens)        # == fn(PLAIN, slice(None), rows, weights)

`fn(ops, s, rows_t, w) -> tuple of tensors` is a stage of a block that is row-wise: output position p
depends only on input position p (projections, norms, RoPE at position p, SwiGLU). `rows` are its
inputs [B, S, ...] (tiled along S, positions s = slice(lo, hi)); `w` maps names to the weights it uses,
through `ops.linear(x, w[name])` and `ops.rms_norm(x, w[name], eps)` only.

  forward    for each tile: fn on the tile's rows (no graph), written into whole outputs [B, S, ...];
             only the rows and the weights are saved.
  backward   for each tile: run fn again with a graph on the tile's rows (weights detached: autograd
             computes no weight gradient), take the rows' gradients and the gradient arriving at each
             linear's and norm's output from one `torch.autograd.grad`, then add that tile's weight
             gradients into fp32 accumulators (fp64 for fp64 weights): linear dW += dZ^T X (an
             fp32-output GEMM: cuBLAS's out_dtype on CUDA; exact fp32 products of upcast operands on
             CPU), norm dw += sum dY * x_hat in fp32. The tile's graph and intermediates are freed
             before the next tile starts.
  result     the rows' gradients, written tile by tile into whole tensors; each weight's fp32 sum,
             rounded once to the weight's dtype.

Exactness. The rows' gradients are autograd's own, computed by the same ops on the same rows, so
they and the forward are bitwise the untiled ones wherever the kernels give a row the same bits
whatever rows surround it: on CPU (measured, torch 2.13) bf16 GEMMs always, MKL's fp32 GEMM at >= 12
rows and output widths that are multiples of 8, ATen's SiLU when each thread's elements are a multiple
of 16 (tests/ops/test_tiling.py). `tile_bounds` balances the tiles, so none is below half the tile
size. On CUDA the GEMMs choose kernels by row count: equal within rounding, not bitwise. A weight gradient is a sum over the N tokens; the tiled sum
adds the same products in another order, in fp32, so |tiled - untiled| <= 2 gamma_N sum|terms|
(gamma_N = N u / (1 - N u), u = 2^-24) before the final rounding to the weight dtype. Under FSDP2's
mixed precision (bf16 weights at compute, fp32 reduction) the untiled GEMM also sums in fp32 and
rounds once to bf16: the tiled result is one rounding of an fp32 sum too, never a sum of rounded
per-tile bf16 partials (which is what accumulating into a bf16 `.grad` tile by tile would give).

Modelled on DeepSpeed's TiledMLP / SequenceTiledCompute (ALST, deepspeed/runtime/sequence_parallel/
ulysses_sp.py): forward over shards without a graph, backward recomputing each shard. Differences:
weights are inputs of the Function, so their gradients reach FSDP2's unsharded parameters through
autograd (TiledMLP calls autograd.backward inside backward and flags ZeRO's `ds_grad_is_ready`), and
are summed in fp32 rather than into the parameter dtype's `.grad`; tiles are balanced; several
outputs and several row inputs. Liger's LigerTiledMLP (liger_kernel/ops/tiled_mlp.py) is the same
scheme as DeepSpeed's.

Legend: B batch, S positions, N = B*S tokens, T tiles, n tokens per tile.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch
import torch.nn.functional as F

TileFn = Callable[..., tuple]


def tile_bounds(positions: int, tile: int) -> list[tuple[int, int]]:
    """[(lo, hi)]: ceil(positions / tile) tiles whose sizes differ by at most one (none above `tile`)."""
    if positions <= 0:
        return []
    if tile < 1:
        raise ValueError(f"tile = {tile} must be >= 1 position")
    count = -(-positions // tile)
    base, extra = divmod(positions, count)
    bounds, lo = [], 0
    for i in range(count):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class TileOps:
    """The ops a tile function may run with weights: what the untiled module code runs."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (weight.shape[-1],), weight, eps)


PLAIN = TileOps()
"""The untiled path's ops (nn.Linear's and nn.RMSNorm's own calls)."""


class _Recorder(TileOps):
    """The same ops in a tile's recompute, each call remembered as (kind, weight, input, output, eps)."""

    def __init__(self):
        self.records: list[tuple] = []

    def linear(self, x, weight):
        z = F.linear(x, weight)
        self.records.append(("linear", weight, x, z, None))
        return z

    def rms_norm(self, x, weight, eps):
        if eps is None:
            raise ValueError("tiled rms_norm needs an explicit eps (nn.RMSNorm(..., eps=...)); got None")
        y = F.rms_norm(x, (weight.shape[-1],), weight, eps)
        self.records.append(("rms_norm", weight, x, y, eps))
        return y


def mm_fp32(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b summed and returned in `dtype` (fp32, or fp64 for fp64 operands: `accumulation_dtype`):
    cuBLAS's fp32-output GEMM for bf16/fp16 on CUDA; on CPU the operands upcast (bf16 x bf16 products
    are exact in fp32), so both sum exact products in fp32."""
    if a.dtype == dtype:
        return torch.mm(a, b)
    if dtype == torch.float32 and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.to(dtype), b.to(dtype))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where a weight's tile sums accumulate: fp32, or the weight's own dtype when it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _add_weight_grad(acc: torch.Tensor, kind: str, x: torch.Tensor, dz: torch.Tensor, eps) -> None:
    """acc (`accumulation_dtype`, the weight's shape) += this call's weight gradient."""
    if kind == "linear":                                                   # z = x W^T: dW = dZ^T X
        acc.add_(mm_fp32(dz.reshape(-1, dz.shape[-1]).t(), x.reshape(-1, x.shape[-1]), acc.dtype))
        return
    xf = x.to(acc.dtype)                                                   # y = x_hat * w: dw = sum dY x_hat
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    acc.add_((dz.to(acc.dtype) * x_hat).reshape(-1, x.shape[-1]).sum(0))


class _TiledRows(torch.autograd.Function):
    """See the module docstring. Inputs: fn, names (of the weights), tile positions, the number of
    row tensors, then the rows and the weights; outputs: fn's outputs, whole."""

    @staticmethod
    def forward(ctx, fn, names, tile, n_rows, *tensors):
        rows, weights = tensors[:n_rows], dict(zip(names, tensors[n_rows:]))
        ctx.fn, ctx.names, ctx.tile, ctx.n_rows = fn, names, tile, n_rows
        ctx.save_for_backward(*tensors)
        S = rows[0].shape[1]
        if S == 0:   # no tile: fn's own (empty) outputs; the backward then sums no tile (zero weight grads)
            return tuple(g.clone() for g in fn(PLAIN, slice(0, 0), rows, weights))
        outs = None
        for lo, hi in tile_bounds(S, tile):
            got = fn(PLAIN, slice(lo, hi), tuple(r[:, lo:hi] for r in rows), weights)
            if outs is None:
                outs = [g.new_empty((g.shape[0], S, *g.shape[2:])) for g in got]
            for out, g in zip(outs, got):
                out[:, lo:hi].copy_(g)
            del got
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        n_rows, names = ctx.n_rows, ctx.names
        rows, weights = tensors[:n_rows], tensors[n_rows:]
        need = ctx.needs_input_grad[4:]
        d_rows = [torch.empty(r.shape, dtype=r.dtype, device=r.device) if need[i] else None
                  for i, r in enumerate(rows)]
        detached = [w.detach() for w in weights]
        index = {id(w): i for i, w in enumerate(detached)}
        acc = [torch.zeros(w.shape, dtype=accumulation_dtype(w.dtype), device=w.device) if need[n_rows + i]
               else None for i, w in enumerate(weights)]
        for lo, hi in tile_bounds(rows[0].shape[1], ctx.tile):
            _backward_tile(ctx.fn, slice(lo, hi), rows, dict(zip(names, detached)), grads, d_rows, acc, index)
        weight_grads = [None if a is None else a.to(w.dtype) for a, w in zip(acc, weights)]
        return (None, None, None, None, *d_rows, *weight_grads)


def _backward_tile(fn, s, rows, weights, grads, d_rows, acc, index) -> None:
    """One tile of the backward (module docstring): recompute, one autograd.grad, add weight grads."""
    row_t = tuple(r[:, s].detach().requires_grad_(True) for r in rows)   # True: linears' dZ needs a graph
    ops = _Recorder()
    with torch.enable_grad():
        outs = fn(ops, s, row_t, weights)
    pairs = [(o, g[:, s]) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    records = [r for r in ops.records if acc[index[id(r[1])]] is not None]
    got = (torch.autograd.grad([o for o, _ in pairs], [*row_t, *(r[3] for r in records)],
                               [g for _, g in pairs], allow_unused=True)
           if pairs else [None] * (len(row_t) + len(records)))
    del outs, pairs
    for d_row, g in zip(d_rows, got[:len(row_t)]):
        if d_row is None:
            continue
        if g is None:
            d_row[:, s].zero_()
        else:
            d_row[:, s].copy_(g)
    for (kind, weight, x, _, eps), dz in zip(records, got[len(row_t):]):
        if dz is not None:
            _add_weight_grad(acc[index[id(weight)]], kind, x, dz, eps)


@torch.compiler.disable
def tiled_rows(fn: TileFn, rows: tuple[torch.Tensor, ...], weights: dict[str, torch.Tensor],
               tile_tokens: int) -> tuple[torch.Tensor, ...]:
    """Run the row-wise stage `fn` over tiles of about `tile_tokens` tokens (module docstring).
    Under torch.compile it is a graph break: the tile loop and its backward run eagerly.

    Args:
        fn: `fn(ops, s, rows_t, w) -> tuple of [B, len(s), ...] tensors`; uses weights only through
            `ops.linear(x, w[name])` and `ops.rms_norm(x, w[name], eps)`, slices any per-position
            table it closes over with `s`.
        rows: the stage's inputs, each [B, S, ...] (the same B and S).
        weights: name -> weight tensor (nn.Linear [out, in], RMSNorm [dim]); they get gradients.
        tile_tokens: tokens per tile, >= 1 (B * positions per tile; at least one position).
    Returns:
        fn's outputs over all S positions, as `fn(PLAIN, slice(None), rows, weights)` returns them.
    """
    if not rows:
        raise ValueError("tiled_rows needs at least one row tensor [B, S, ...]")
    B, S = rows[0].shape[:2]
    for r in rows[1:]:
        if r.shape[:2] != (B, S):
            raise ValueError(f"tiled_rows: every row tensor must be [B, S, ...] = [{B}, {S}, ...], got "
                             f"{tuple(r.shape)}")
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, numbers.Integral):
        raise ValueError(f"tile_tokens = {tile_tokens!r} must be an int >= 1 (tokens per tile)")
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens = {tile_tokens} must be >= 1; 0 means untiled: call fn directly")
    names = tuple(weights)
    return _TiledRows.apply(fn, names, max(1, tile_tokens // max(B, 1)), len(rows), *rows,
                            *(weights[n] for n in names))
