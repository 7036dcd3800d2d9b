"""Sequence tiling (mop_train.ops.tiling) against its untiled reference, on random inputs.

Forward values and the gradients of the rows (the stage's inputs) must be bitwise the untiled ones:
every op is row-wise, and the kernels give a row the same bits whatever rows surround it, which on
this CPU (measured, torch 2.13, 1 and 2 threads) holds for MKL's fp32 GEMM at >= 12 rows with an
output width that is a multiple of 8 (width 10 already breaks it), and for ATen's vectorized SiLU when
a tensor's elements per thread are a multiple of 16 (its scalar tail loop rounds differently): the
tiles here have >= 12 rows, every width is a multiple of 8 and the SiLU widths of 32, as every zoo
model's are. A weight gradient is a sum over the N tokens that
tiling reorders, in fp32: elementwise

    |tiled - untiled| <= 2 gamma_N S + r,   gamma_N = N u / (1 - N u), u = 2^-24,

where S = sum over tokens of |each product| (taken from the untiled backward's own GEMMs and sums,
`MagnitudeSums`) and r = 0 for fp32 weights; for bf16 both sides round an fp32 sum once, r = one bf16
ulp of the larger (2^-7 |v|). Memory: what the CPU path keeps alive against memory.py's bounds.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mop_train.ops.tiling import TilingOptions, swiglu, tile_bounds, tiled_rows, tiled_swiglu, untiled_rows
from mop_train.ops.tiling.memory import auto_tile_tokens, largest_tile, swiglu_working_bytes
from tests.utils import AllocatedBytes, assert_bitwise_equal, assert_no_worse_than_torch, fresh_seed

U_FP32 = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U_FP32 / (1 - n * U_FP32)


class MagnitudeSums(TorchDispatchMode):
    """For every mm and dim-sum the wrapped code runs, the same reduction over magnitudes in fp64,
    kept per result shape (squeezed) as the elementwise max: S for a weight of that shape."""

    def __init__(self):
        super().__init__()
        self.sums: dict[tuple, torch.Tensor] = {}

    def _keep(self, out: torch.Tensor, mags: torch.Tensor) -> None:
        key = tuple(s for s in out.shape if s != 1)
        mags = mags.reshape(key)
        self.sums[key] = mags if key not in self.sums else torch.maximum(self.sums[key], mags)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            self._keep(out, torch.mm(args[0].abs().double(), args[1].abs().double()))
        elif func is torch.ops.aten.sum.dim_IntList:
            self._keep(out, torch.sum(args[0].abs().double(), dim=args[1], keepdim=len(args) > 2 and args[2]))
        return out


def assert_weight_grad_within(tiled: torch.Tensor, untiled: torch.Tensor, sums: dict, tokens: int,
                              name: str) -> None:
    """The bound of the module docstring, elementwise."""
    key = tuple(s for s in untiled.shape if s != 1)
    assert key in sums, f"{name}: no untiled reduction of shape {key} was seen"
    bound = 2 * gamma(tokens) * sums[key].reshape(untiled.shape)
    if untiled.dtype != torch.float32:
        bound = bound + 2.0 ** -7 * torch.maximum(tiled.double().abs(), untiled.double().abs())
    err = (tiled.double() - untiled.double()).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, (f"{name}: max |tiled - untiled| {err.max().item():.3e} exceeds the summation bound "
                        f"by {worst:.3e} (max bound {bound.max().item():.3e}, N = {tokens})")


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _run_swiglu(x, ws, g, tile):
    xl, wl = _leaves([x])[0], _leaves(ws)
    y = swiglu(xl, *wl) if tile is None else tiled_swiglu(xl, *wl, tile)
    y.backward(g)
    return [y.detach(), xl.grad] + [w.grad for w in wl]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_swiglu_equals_untiled(dtype):
    gen = torch.Generator().manual_seed(fresh_seed(3601))
    for case in range(2):
        B, S = 2, int(torch.randint(40, 90, (1,), generator=gen)) | 1           # odd positions
        H, Fw = 8 * int(torch.randint(1, 6, (1,), generator=gen)), 32 * int(torch.randint(1, 4, (1,), generator=gen))
        N = B * S
        x = torch.randn(B, S, H, generator=gen).to(dtype)
        ws = [(torch.randn(*shape, generator=gen) / shape[1] ** 0.5).to(dtype) for shape in ((Fw, H), (H, Fw), (Fw, H))]
        g = torch.randn(B, S, H, generator=gen).to(dtype)
        with MagnitudeSums() as mags:
            want = _run_swiglu(x, ws, g, None)
        truth = _run_swiglu(x.double(), [w.double() for w in ws], g.double(), None)
        for tile in (24, int(torch.randint(24, N, (1,), generator=gen)), N + 7):   # tile > tokens: one tile
            assert min(hi - lo for lo, hi in tile_bounds(N, tile)) >= 12
            got = _run_swiglu(x, ws, g, tile)
            tag = f"case {case} N={N} H={H} F={Fw} tile={tile} {dtype}"
            assert_bitwise_equal(got[0], want[0], name=f"{tag} forward")
            assert_bitwise_equal(got[1], want[1], name=f"{tag} grad x")
            for name, a, b, t in zip(("w1", "w2", "w3"), got[2:], want[2:], truth[2:]):
                assert_weight_grad_within(a, b, mags.sums, N, f"{tag} grad {name}")
                if dtype == torch.bfloat16:
                    assert_no_worse_than_torch(a, b, t, name=f"{tag} grad {name} vs fp64")


def _stage(table):
    """A row-wise stage with two row inputs, two outputs, a norm and a per-position table."""
    def fn(ops, s, rows, w):
        a, b = rows
        z = ops.linear(ops.rms_norm(a, w["g"], 1e-5), w["p"]) * table[s][None, :, None].to(a.dtype)
        out = ops.linear(torch.tanh(z) + b, w["q"])
        return out, F.silu(z)[..., :3] * 2
    return fn


def _run_rows(fn, rows, weights, grads, tile):
    rl, wl = _leaves(rows), dict(zip(weights, _leaves(weights.values())))
    outs = untiled_rows(fn, tuple(rl), wl) if tile is None else tiled_rows(fn, tuple(rl), wl, tile)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [r.grad for r in rl], {k: w.grad for k, w in wl.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_rows_equal_untiled(dtype):
    gen = torch.Generator().manual_seed(fresh_seed(3602))
    B, S, H, Fw = 3, 47, 24, 32                                    # N = 141 tokens, no width equals N
    table = torch.rand(S, generator=gen) + 0.5
    rows = (torch.randn(B, S, H, generator=gen).to(dtype), torch.randn(B, S, Fw, generator=gen).to(dtype))
    weights = {"g": (1 + 0.1 * torch.randn(H, generator=gen)).to(dtype),
               "p": (torch.randn(Fw, H, generator=gen) / H ** 0.5).to(dtype),
               "q": (torch.randn(H, Fw, generator=gen) / Fw ** 0.5).to(dtype)}
    grads = (torch.randn(B, S, H, generator=gen).to(dtype), torch.randn(B, S, 3, generator=gen).to(dtype))
    fn = _stage(table)
    with MagnitudeSums() as mags:
        want, want_w = _run_rows(fn, rows, weights, grads, None)
    for tile in (5 * B, 13 * B, B * S + 1):                        # balanced tiles of >= 4 positions: >= 12 rows
        assert B * min(hi - lo for lo, hi in tile_bounds(S, tile // B)) >= 12
        got, got_w = _run_rows(fn, rows, weights, grads, tile)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_bitwise_equal(a, b, name=f"tile={tile} {dtype} output/row-grad {i}")
        for name in weights:
            assert_weight_grad_within(got_w[name], want_w[name], mags.sums, B * S, f"tile={tile} {dtype} grad {name}")


def test_fp64_weight_gradients_sum_in_fp64():
    """fp64 weights: the tile sums accumulate in fp64 (not fp32), so tiled and untiled agree to fp64
    rounding on odd shapes and tiles of one token (before: errors of fp32 size, ~1e-6 relative)."""
    gen = torch.Generator().manual_seed(fresh_seed(61))
    for H, F_, lead, tile in ((17, 33, (4, 7), 1), (3, 5, (3, 5), 4), (8, 1, (2,), 3)):
        x = torch.randn(*lead, H, generator=gen, dtype=torch.float64, requires_grad=True)
        w1, w3 = (torch.randn(F_, H, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
        w2 = torch.randn(H, F_, generator=gen, dtype=torch.float64, requires_grad=True)
        g = torch.randn(*lead, H, generator=gen, dtype=torch.float64)
        got, want = (torch.autograd.grad(tiled_swiglu(x, w1, w2, w3, tile, impl=impl), (x, w1, w2, w3), g)
                     for impl in ("tiled", "reference"))
        n = x.numel() // H
        for name, a, b in zip(("x", "w1", "w2", "w3"), got, want):
            assert a.dtype == torch.float64
            bound = 4 * n * 2.0 ** -53 * float(b.abs().max()) * max(H, F_)
            assert float((a - b).abs().max()) <= bound, (name, H, F_, lead, tile, float((a - b).abs().max()), bound)


def test_only_what_needs_a_gradient_gets_one():
    """Rows or weights that do not require grad get none; an output without a gradient is skipped."""
    gen = torch.Generator().manual_seed(fresh_seed(3603))
    table = torch.rand(13, generator=gen) + 0.5
    a, b = torch.randn(2, 13, 8, generator=gen), torch.randn(2, 13, 32, generator=gen)
    w = {"g": torch.rand(8, generator=gen) + 0.5, "p": torch.randn(32, 8, generator=gen),
         "q": torch.randn(8, 32, generator=gen).requires_grad_()}
    out, _ = tiled_rows(_stage(table), (a, b.requires_grad_()), w, 16)         # 2 tiles of 6-7 positions
    out.backward(torch.randn(out.shape, generator=gen))
    assert a.grad is None and w["g"].grad is None and w["p"].grad is None
    assert b.grad is not None and w["q"].grad is not None
    want = untiled_rows(_stage(table), (a, b.detach().requires_grad_()), {**w, "q": w["q"].detach().requires_grad_()})
    assert_bitwise_equal(out.detach(), want[0].detach(), name="forward with frozen rows")


def test_tile_bounds_are_balanced_and_cover():
    gen = torch.Generator().manual_seed(fresh_seed(3604))
    for _ in range(50):
        n, tile = int(torch.randint(1, 500, (1,), generator=gen)), int(torch.randint(1, 80, (1,), generator=gen))
        bounds = tile_bounds(n, tile)
        sizes = [hi - lo for lo, hi in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == n and all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
        assert len(bounds) == -(-n // tile) and max(sizes) <= tile and max(sizes) - min(sizes) <= 1
        assert largest_tile(n, tile) == (max(sizes) if n > tile else n)
    with pytest.raises(ValueError, match="tile = 0 must be >= 1"):
        tile_bounds(5, 0)
    with pytest.raises(ValueError, match="0 means untiled"):
        tiled_swiglu(torch.randn(2, 3), torch.randn(4, 3), torch.randn(3, 4), torch.randn(4, 3), 0)


def test_auto_tile_and_options():
    assert auto_tile_tokens(1000, 1000, budget=10**6) == 0            # all tokens fit one tile: untiled
    assert auto_tile_tokens(1000, 1001, budget=10**6, multiple=64) == 960
    assert auto_tile_tokens(10**7, 50, budget=10**6, multiple=64) == 64  # at least one multiple
    opts = TilingOptions.resolve("auto", 512, tokens=4096, ffn_token_bytes=1 << 20, block_token_bytes=0)
    assert opts == TilingOptions(ffn_tokens=2048, block_tokens=512) and "FFN 2,048 tokens" in opts.label()
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="must be 0 \\(untiled\\), a token count"):
            TilingOptions(ffn_tokens=bad)
    with pytest.raises(ValueError, match="expected 0, a token count or \"auto\""):
        TilingOptions.resolve("sometimes", 0, tokens=1, ffn_token_bytes=1, block_token_bytes=1)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_memory_within_its_bound(dtype):
    """Forward + backward beyond the inputs: the output, then memory.swiglu_working_bytes (which must
    cover the measured peak and stay within 1.5x of it, so a term that grows or vanishes shows); at a
    fixed tile, doubling N adds only the whole [N, H] tensors, while untiled it adds N x F ones."""
    gen = torch.Generator().manual_seed(fresh_seed(3605))
    H, Fw, act = 16, 128, torch.empty((), dtype=dtype).element_size()
    peaks = {}
    for N, tile in ((1024, 128), (2048, 128), (2048, 256), (1024, None), (2048, None)):
        x = torch.randn(1, N, H, generator=gen).to(dtype).requires_grad_()
        ws = [torch.randn(*s, generator=gen).to(dtype).requires_grad_() for s in ((Fw, H), (H, Fw), (Fw, H))]
        g = torch.randn(1, N, H, generator=gen).to(dtype)
        with AllocatedBytes() as seen:
            y = swiglu(x, *ws) if tile is None else tiled_swiglu(x, *ws, tile)
            y.backward(g)
            del y
        peaks[N, tile] = seen.peak
        if tile is not None:
            bound = N * H * act + swiglu_working_bytes(N, tile, H, Fw, act, cpu_upcast=True)
            assert seen.peak <= bound <= 1.5 * seen.peak, (N, tile, dtype, seen.peak, bound)
    whole = 1024 * H * act
    assert peaks[2048, 128] - peaks[1024, 128] <= 2 * whole             # output and input gradient
    assert peaks[2048, None] - peaks[1024, None] >= 1024 * 4 * Fw * act  # untiled: h1, h3, silu, product


@pytest.mark.gpu
def test_cuda_bf16_tiled_swiglu_within_bf16_noise_and_smaller():
    """`small`'s dense FFN at 64K tokens, bf16 on CUDA: outputs and gradients no worse against fp32
    than the untiled bf16 path's (cuBLAS picks GEMMs by row count: not bitwise there), weight gradients
    through the fp32-output GEMM, and the tiled peak below the untiled one by the F-wide intermediates."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed(3606))
    N, H, Fw, tile = 65536, 1536, 6144, 8192
    x = torch.randn(1, N, H, device="cuda", generator=gen).bfloat16()
    ws = [(torch.randn(*s, device="cuda", generator=gen) / s[1] ** 0.5).bfloat16() for s in ((Fw, H), (H, Fw), (Fw, H))]
    g = torch.randn(1, N, H, device="cuda", generator=gen).bfloat16()
    peaks, runs = {}, {}
    for name, t in (("untiled", None), ("tiled", tile)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        runs[name] = _run_swiglu(x, ws, g, t)
        peaks[name] = torch.cuda.max_memory_allocated() - base
    truth = _run_swiglu(x.float(), [w.float() for w in ws], g.float(), None)
    for i, name in enumerate(("y", "dx", "dw1", "dw2", "dw3")):
        assert_no_worse_than_torch(runs["tiled"][i], runs["untiled"][i], truth[i], name=f"cuda bf16 {name}")
    assert peaks["untiled"] - peaks["tiled"] >= 3 * (N - tile) * Fw * 2, peaks
