"""The untiled stages that tiling replaces: the spec, the short-sequence path and the test oracle.

    swiglu(x, w1, w2, w3)            # the dense FFN / shared expert, as models.moe.FeedForward runs it
    untiled_rows(fn, rows, weights)  # a tile function over all positions at once, with the plain ops

Legend: N tokens, H hidden, F FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mop_train.ops.tiling.function import PLAIN, TileFn, TileOps


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x): x [..., H], w1/w3 [F, H], w2 [H, F] -> [..., H]."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def swiglu_stage(ops: TileOps, s: slice, rows: tuple, w: dict) -> tuple[torch.Tensor]:
    """SwiGLU as a tile function of `tiled_rows` (rows = (x,), w = {"w1", "w2", "w3"})."""
    (x,) = rows
    return (ops.linear(F.silu(ops.linear(x, w["w1"])) * ops.linear(x, w["w3"]), w["w2"]),)


def untiled_rows(fn: TileFn, rows: tuple[torch.Tensor, ...], weights: dict) -> tuple[torch.Tensor, ...]:
    """What `tiled_rows(fn, rows, weights, tile)` computes, in one piece with autograd's own graph."""
    return tuple(fn(PLAIN, slice(None), rows, weights))
