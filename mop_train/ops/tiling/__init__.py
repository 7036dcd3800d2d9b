"""Sequence tiling of a block's per-token stages (ALST's TiledMLP): bounded working sets at long context.

    y = tiled_swiglu(x, w1, w2, w3, tile_tokens)            # dense FFN / shared expert, [..., H]
    q, k, v = tiled_rows(fn, (x,), weights, tile_tokens)     # any row-wise stage (attention's projections)
    tiling = TilingOptions.resolve(ffn_tokens="auto", block_tokens=0, model_args=a, tokens=N)

A stage that maps each token position on its own (projections, norms, RoPE, SwiGLU) holds
intermediates of N x width. Tiled, its forward runs tile by tile without a graph and saves only its
inputs; its backward recomputes one tile at a time, so the intermediates alive at once are one tile's,
whatever N is. Weight gradients are summed over tiles in fp32 (function.py says how exactly).
What is not row-wise stays whole: the attention core (q, k, v, its output and log-sum-exp) and the
routed experts (their own chunked schedule, ops.moe_dispatch). The bound of each tiled stage and the
"auto" tile size are in memory.py.

Legend: B batch, S positions, N = B*S/D tokens on a rank, H hidden, F FFN width.
"""

from __future__ import annotations

import torch

from mop_train.ops.tiling.function import PLAIN, TileOps, mm_fp32, tile_bounds, tiled_rows
from mop_train.ops.tiling.options import TilingOptions
from mop_train.ops.tiling.reference import swiglu, swiglu_stage, untiled_rows


def tiled_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                 tile_tokens: int, *, impl: str = "tiled") -> torch.Tensor:
    """SwiGLU w2(silu(w1 x) * w3 x) over tiles of `tile_tokens` tokens of x [..., H] -> [..., H].

    impl: "tiled" (the autograd.Function of function.py; one tile when tile_tokens >= N) or
    "reference" (reference.swiglu, untiled)."""
    if impl == "reference":
        return swiglu(x, w1, w2, w3)
    if impl != "tiled":
        raise ValueError(f"impl = {impl!r}; expected 'tiled' or 'reference'")
    lead = x.shape[:-1]
    (y,) = tiled_rows(swiglu_stage, (x.reshape(1, -1, x.shape[-1]),), {"w1": w1, "w2": w2, "w3": w3},
                      tile_tokens)
    return y.view(*lead, y.shape[-1])


__all__ = ["PLAIN", "TileOps", "TilingOptions", "mm_fp32", "swiglu", "swiglu_stage", "tile_bounds",
           "tiled_rows", "tiled_swiglu", "untiled_rows"]
