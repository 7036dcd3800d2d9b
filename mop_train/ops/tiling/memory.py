"""Device bytes of a tiled stage, and the "auto" tile size.

A tiled stage saves nothing beyond its inputs (they are saved by reference). In its backward it holds:

  whole     the gradient of each row input, [N, width_in] in the activation dtype (written tile by tile);
  tile      one tile's recomputed intermediates, their gradients and the gradients it captures, for the
            largest tile: n = ceil(N / ceil(N / T)) tokens (tiles are balanced, function.tile_bounds);
  weights   per weight: an fp32 accumulator, one fp32 GEMM result, and the final cast to the weight dtype.

For SwiGLU (x [n, H] -> h1, h3, silu(h1), their product [n, F] -> y [n, H]) one tile's backward holds at
most the four F-wide intermediates, the output gradient's F-wide image and the two captured F-wide
gradients with one more transient, and two H-wide rows: (8F + 2H) per token (measured on CPU, 7.5F + 2H,
tests/ops/test_tiling.py). On CPU a bf16 weight gradient's GEMM upcasts its two operands (F + H per token
in fp32); on CUDA the GEMM writes fp32 itself.

"auto" (`auto_tile_tokens`): the largest multiple of 1024 tokens whose tile bytes stay within
AUTO_TILE_BYTES; untiled (0) when all of a rank's tokens fit in that. Large tiles keep the GEMMs as
efficient as untiled ones and the tile loop short; the bound is then a small fraction of a GPU.

Legend: N tokens, T tile tokens, n largest tile, H hidden, F FFN width, act bytes per activation.
"""

from __future__ import annotations

from dataclasses import dataclass

from mop_train.ops.bound import DeviceBound
from mop_train.ops.tiling.function import tile_bounds

AUTO_TILE_BYTES = 2 << 30
"""Bytes one tile's backward may hold when the tile size is "auto" (2 GiB: about 1.4% of an H200)."""

AUTO_TILE_MULTIPLE = 1024
""""auto" tiles are multiples of this many tokens (GEMM-friendly row counts)."""


def auto_tile_tokens(token_bytes: int, tokens: int, *, budget: int = AUTO_TILE_BYTES,
                     multiple: int = AUTO_TILE_MULTIPLE) -> int:
    """Tile tokens for "auto": 0 (untiled) when tokens * token_bytes <= budget, else the largest multiple
    of `multiple` (at least one) whose tile bytes fit `budget`."""
    if token_bytes < 0 or tokens < 0 or budget < 1:
        raise ValueError(f"auto_tile_tokens: token_bytes = {token_bytes}, tokens = {tokens} must be >= 0 and "
                         f"budget = {budget} >= 1")
    if tokens * token_bytes <= budget:
        return 0
    return max(multiple, budget // token_bytes // multiple * multiple)


def largest_tile(tokens: int, tile: int) -> int:
    """Tokens of the largest tile when `tokens` are split into tiles of at most `tile` (0: untiled)."""
    if tile <= 0 or tokens <= tile:
        return tokens
    return max(hi - lo for lo, hi in tile_bounds(tokens, tile))


def weight_grad_bytes(weight_elements: list[int], act_bytes: int) -> int:
    """fp32 accumulators, the largest fp32 GEMM result, and the casts to the weight dtype."""
    if not weight_elements:
        return 0
    cast = 0 if act_bytes == 4 else sum(weight_elements) * act_bytes
    return 4 * sum(weight_elements) + 4 * max(weight_elements) + cast


def swiglu_token_bytes(hidden: int, width: int, act_bytes: int, *, cpu_upcast: bool = False) -> int:
    """One tile token's bytes in the tiled SwiGLU's backward (module docstring)."""
    upcast = 4 * (width + hidden) if cpu_upcast and act_bytes != 4 else 0
    return (8 * width + 2 * hidden) * act_bytes + upcast


def swiglu_working_bytes(tokens: int, tile: int, hidden: int, width: int, act_bytes: int, *,
                         cpu_upcast: bool = False) -> int:
    """Bytes the tiled SwiGLU holds beyond its inputs and output in its backward: the input gradient
    [N, H], one tile, the weight gradients. With tile 0 (untiled) the tile is all N tokens."""
    n = largest_tile(tokens, tile)
    return (tokens * hidden * act_bytes + n * swiglu_token_bytes(hidden, width, act_bytes, cpu_upcast=cpu_upcast)
            + weight_grad_bytes([width * hidden] * 3, act_bytes))


def stage_working_bytes(tokens: int, tile: int, *, in_elements: int, tile_elements: int,
                        weight_elements: list[int], act_bytes: int, fp32_tile_elements: int = 0) -> int:
    """A tiled stage's backward: its input gradient (`in_elements` per token, whole), one tile of
    `tile_elements` activation-dtype plus `fp32_tile_elements` fp32 elements per token, its weights."""
    n = largest_tile(tokens, tile)
    return (tokens * in_elements * act_bytes + n * (tile_elements * act_bytes + 4 * fp32_tile_elements)
            + weight_grad_bytes(weight_elements, act_bytes))


@dataclass(frozen=True)
class SwiGLUShapes:
    """The sizes a SwiGLU FFN runs at on this rank."""

    tokens: int
    hidden: int
    width: int
    act_bytes: int


def device_bound(tile_tokens: int, shapes: SwiGLUShapes) -> DeviceBound:
    """One SwiGLU FFN (dense or shared expert), beyond its input and output. Untiled (tile 0, or a tile
    of all the tokens): it saves h1, h3, silu(h1) and their product (4F per token) and its backward adds
    the product's gradient, then h1's and h3's (2F). Tiled: it saves nothing (its input by reference)
    and its backward holds `swiglu_working_bytes`."""
    N, H, Fw, act = shapes.tokens, shapes.hidden, shapes.width, shapes.act_bytes
    if not tile_tokens or N <= tile_tokens:
        return DeviceBound(N * 4 * Fw * act, N * 2 * Fw * act, f"SwiGLU F={Fw:,} untiled: 4F saved, 2F in backward")
    n = largest_tile(N, tile_tokens)
    return DeviceBound(0, swiglu_working_bytes(N, tile_tokens, H, Fw, act),
                       f"SwiGLU F={Fw:,} tiled by {tile_tokens:,} tokens: nothing saved; in backward dx [N, H] + "
                       f"one tile of {n:,} x (8F + 2H) + fp32 weight grads")
