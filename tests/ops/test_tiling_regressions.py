"""Regressions found by an adversarial probe of sequence tiling (mop_train.ops.tiling, models.model.tile_blocks).

1. A tiled stage over zero positions (x [B, 0, H], or tiled_swiglu of no tokens) raised a bare
   TypeError ('NoneType' object is not iterable): the forward built its outputs from the first tile's
   and there was none. It now returns fn's (empty) outputs and zero weight gradients, as untiled.
2. `tile_blocks` took any value int() accepts: "auto" failed with int()'s message, -5 was set and the
   next forward failed inside tiled_rows ("call fn directly"), 2.7 became 2 and True became 1. It now
   refuses them up front, naming the key and saying to resolve "auto" first.
"""

from __future__ import annotations

import pytest
import torch

from mop_train.models import zoo
from mop_train.models.model import model_tiles, tile_blocks
from mop_train.ops.tiling import TilingOptions, swiglu, tiled_rows, tiled_swiglu, untiled_rows
from tests.utils import assert_bitwise_equal, fresh_seed


def _stage(ops, s, rows, w):
    return (ops.linear(ops.rms_norm(rows[0], w["g"], 1e-6), w["p"]),)


@pytest.mark.parametrize("B", [0, 1, 3])
def test_zero_positions_match_untiled(B):
    gen = torch.Generator().manual_seed(fresh_seed(3901))
    x = torch.randn(B, 0, 8, generator=gen).requires_grad_()
    w = {"g": (torch.rand(8, generator=gen) + 0.5).requires_grad_(),
         "p": torch.randn(16, 8, generator=gen).requires_grad_()}
    (y,) = tiled_rows(_stage, (x,), w, 3)
    (want,) = untiled_rows(_stage, (x,), w)
    assert y.shape == want.shape == (B, 0, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for name, weight in w.items():
        assert_bitwise_equal(weight.grad, torch.zeros_like(weight), name=f"grad {name}")


def test_tiled_swiglu_of_no_tokens():
    gen = torch.Generator().manual_seed(fresh_seed(3902))
    x = torch.randn(0, 8, generator=gen).requires_grad_()
    ws = [torch.randn(*s, generator=gen).requires_grad_() for s in ((32, 8), (8, 32), (32, 8))]
    y = tiled_swiglu(x, *ws, 5)
    assert y.shape == swiglu(x, *ws).shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8) and all(torch.equal(w.grad, torch.zeros_like(w)) for w in ws)


@pytest.mark.parametrize("ffn,block", [("auto", 0), (-5, 0), (0, -1), (2.7, 0), (True, 0), (None, 0), (0, "64")])
def test_tile_blocks_refuses_what_is_not_a_token_count(ffn, block):
    model = zoo.build_model("debug", device="meta")
    with pytest.raises(ValueError, match=r"must be 0 \(untiled\) or a token count >= 1.*resolve"):
        tile_blocks(model, ffn, block)
    assert model_tiles(model) == TilingOptions(0, 0)            # nothing was set


def test_tile_blocks_takes_integral_counts():
    model = zoo.build_model("debug", device="meta")
    tile_blocks(model, torch.tensor(64).item(), 0)
    assert model_tiles(model) == TilingOptions(64, 0)


@pytest.mark.parametrize("tile", [2.5, True, "8"])
def test_tiled_rows_refuses_a_tile_that_is_not_an_int(tile):
    x = torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match="tile_tokens"):
        tiled_rows(_stage, (x,), {"g": torch.ones(8), "p": torch.randn(4, 8)}, tile)
