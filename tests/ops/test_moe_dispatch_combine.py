"""combine.SumTokenRows (the local and expert-parallel combine) and AddTokenRows (PipelinedLLEP's, per
chunk) against the float64 sum: within one rounding of the result, the rows' gradients bit for bit
autograd's IndexAddBackward0 (a plain index_add_), the ids or slots alone saved (not the rows), any
chunking. GatherTokenRows (its
gradient the per-token sum) and PermuteRows against autograd's indexing, and a whole layer with all of
them against the same layer with autograd's indexing and index_add_."""

from __future__ import annotations

import random

import pytest
import torch

from mop_train.ops.moe_dispatch import PipelinedLLEPOptions, ep, llep, local, moe_experts_forward
from mop_train.ops.moe_dispatch import combine as combine_module
from mop_train.ops.moe_dispatch.combine import (add_token_rows, gather_token_rows, inverse_permutation, permute_rows,
                                                sum_token_rows, token_slots)
from mop_train.ops.moe_dispatch.pipelined_llep import chunk_membership
from tests.utils import AllocatedBytes, assert_bitwise_equal, assert_no_worse_than_torch, bf16_moe_layer, fresh_seed


def _saved_storages():
    """A pack hook recording every saved tensor's storage (pointer -> bytes), and the record."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    return pack, seen


def _token_rows_case(rng, dtype, gen):
    """rows [R, H] laid out in a random route order (as a dispatch returns them), its slots and ids."""
    N, H, k = rng.randint(0, 60), rng.randint(1, 24), rng.randint(1, 6)
    order = torch.randperm(N * k, generator=gen)
    rows = (torch.randn(N * k, H, generator=gen) * torch.rand(N * k, 1, generator=gen) * 8).to(dtype)
    return rows.requires_grad_(), token_slots(order, k), order // k, N, H


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_token_rows_is_the_sum_within_one_rounding_and_backward_is_index_adds(dtype, monkeypatch):
    """Random route orders, k and H, N = 0 included, chunks of every size (the chunk cap drawn down to one
    token): y within one rounding of the float64 sum (fp32: a few ulps of the terms' magnitude; bf16: the
    k rows are summed in fp32 and rounded once), the rows' gradient bitwise autograd's IndexAddBackward0
    (a plain index_add), ids alone saved."""
    rng = random.Random(fresh_seed(7330 + (dtype == torch.bfloat16)))
    for _ in range(8):
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        rows, slots, ids, N, H = _token_rows_case(rng, dtype, gen)
        k = slots.shape[1] if N else 1
        monkeypatch.setattr(combine_module, "COMBINE_CHUNK_BYTES", rng.choice([1, 7 * H * k, 32 * 2**20]))
        exact = torch.zeros(N, H, dtype=torch.float64).index_add_(0, ids, rows.detach().double())
        magnitude = torch.zeros(N, H, dtype=torch.float64).index_add_(0, ids, rows.detach().double().abs())
        pack, seen = _saved_storages()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = sum_token_rows(rows, slots, ids)
        assert y.dtype == dtype and y.shape == (N, H)
        fp32_error = 4 * k * torch.finfo(torch.float32).eps * magnitude
        rounding = 0 if dtype == torch.float32 else (exact.abs() + fp32_error) * 2.0 ** -8   # half a bf16 ulp
        assert ((y.double() - exact).abs() <= fp32_error + rounding).all(), (y.double() - exact).abs().max()
        assert seen == {ids.untyped_storage().data_ptr(): ids.untyped_storage().nbytes()}, "ids alone are saved"
        grad = torch.randn(N, H, generator=gen).to(dtype)
        y.backward(grad)
        plain_rows = rows.detach().clone().requires_grad_()
        torch.zeros(N, H, dtype=dtype).index_add(0, ids, plain_rows).backward(grad)   # IndexAddBackward0
        assert_bitwise_equal(rows.grad, plain_rows.grad, name="grad of rows")


def test_sum_token_rows_gathers_no_more_than_its_chunk(monkeypatch):
    """The gathered rows it holds at once stay under COMBINE_CHUNK_BYTES (beside y and the slots)."""
    N, H, k = 3000, 64, 6
    chunk = 100 * k * H * 4 + 123
    monkeypatch.setattr(combine_module, "COMBINE_CHUNK_BYTES", chunk)
    order = torch.randperm(N * k)
    rows, slots, ids = torch.randn(N * k, H), token_slots(order, k), order // k
    with AllocatedBytes() as mode:
        y = sum_token_rows(rows, slots, ids)
    assert mode.largest == y.untyped_storage().nbytes() == N * H * 4
    assert mode.peak <= N * H * 4 + chunk + 100 * k * 8, mode.peak   # y, one gathered chunk, its flat slots


def test_sum_token_rows_rejects_rows_without_k_per_token():
    rows = torch.randn(7, 3)
    with pytest.raises(ValueError, match="N \\* k = R"):
        sum_token_rows(rows, torch.zeros(3, 2, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))


def _plain_token_rows(rows, slots, ids):
    return torch.zeros(slots.shape[0], rows.shape[1], dtype=rows.dtype).index_add_(0, ids, rows)


def _plain_add_token_rows(y, tokens, slots, rows):
    row_token = torch.arange(y.shape[0])[tokens][inverse_permutation(slots.reshape(-1)) // max(1, slots.shape[1])]
    return y.index_add_(0, row_token, rows)


class _PlainGatherTokens:
    """PipelinedLLEP's token gather as autograd's own indexing (x's gradient through IndexBackward0)."""

    @staticmethod
    def apply(sums, anchor, x, ids, tokens, slots):
        return x[ids]


def _plain_layer(monkeypatch):
    """Every gather, permutation and combine of the schedules as plain autograd indexing / index_add_,
    which is what the layer ran before combine.py's functions."""
    for module in (local, ep, llep):
        if hasattr(module, "gather_token_rows"):
            monkeypatch.setattr(module, "gather_token_rows", lambda x, ids, slots: x[ids])
        monkeypatch.setattr(module, "permute_rows", lambda x, perm, inverse: x[perm])
    monkeypatch.setattr(local, "sum_token_rows", _plain_token_rows)
    monkeypatch.setattr(llep, "add_token_rows", _plain_add_token_rows)
    monkeypatch.setattr(llep, "GatherTokens", _PlainGatherTokens)


def _layer(options, seed, dtype=torch.bfloat16):
    """One MoE layer (group of one) forward+backward: (y, grads of x, w1, w2, w3, routing weights)."""
    rng = random.Random(seed)
    N, H, I, E = rng.randint(40, 120), 8 * rng.randint(1, 6), 8 * rng.randint(1, 4), rng.randint(2, 6)
    k = rng.randint(1, min(3, E))
    gen = torch.Generator().manual_seed(seed)
    x, w1, w2, w3, weights, indices = bf16_moe_layer(gen, N, H, I, E, k)
    leaves = [t.detach().to(dtype if t.dtype == torch.bfloat16 else t.dtype).requires_grad_()
              for t in (x, w1, w2, w3, weights)]
    y = moe_experts_forward(*leaves[:1], indices, *leaves[4:], *leaves[1:4], options)
    y.backward(torch.randn(N, H, generator=gen).to(dtype))
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("schedule", ["local", "pipelined_llep", "pipelined_llep_contiguous"])
def test_layer_matches_autograd_indexing(schedule, monkeypatch):
    """The whole layer with combine.py's gathers, permutations and combines against the same layer with
    autograd's own indexing and index_add_: the grads of w1, w2, w3 and the routing weights bitwise
    (the same values reach them), y and the grad of x within one bf16 rounding (each token's k rows are
    now summed in fp32 and rounded once, where index_add_ and index_put_ round after every row)."""
    seed = fresh_seed(7322 + ("local", "pipelined_llep", "pipelined_llep_contiguous").index(schedule))
    K = random.Random(seed).randint(2, 4)
    options = None if schedule == "local" else PipelinedLLEPOptions(
        token_budget=40 // K, max_chunks=K, membership="contiguous" if "contiguous" in schedule else "strided")
    with monkeypatch.context() as plain:
        _plain_layer(plain)
        y0, g0 = _layer(options, seed)
    y1, g1 = _layer(options, seed)
    for name, a, b in (("y", y1, y0), ("grad of x", g1[0], g0[0])):
        torch.testing.assert_close(a.float(), b.float(), rtol=2.0 ** -7, atol=2.0 ** -7 * b.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")
    for name, a, b in zip(("w1", "w2", "w3", "weights"), g1[1:], g0[1:]):
        assert_bitwise_equal(a, b, name=f"grad of {name}")
    # fp32: the same layer's y and grad of x agree with autograd's indexing to a few ulps of the k-row sums
    with monkeypatch.context() as plain:
        _plain_layer(plain)
        y0, g0 = _layer(options, seed, torch.float32)
    y1, g1 = _layer(options, seed, torch.float32)
    for name, a, b in (("y", y1, y0), ("grad of x", g1[0], g0[0])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())


def _routes(rng, gen, dtype):
    """x [N, H], a random expert-sorted route order's token ids [R] and slots [N, k]."""
    N, H, k = rng.randint(0, 50), rng.randint(1, 20), rng.randint(1, 6)
    order = torch.argsort(torch.randint(0, 7, (N * k,), generator=gen), stable=True)
    x = (torch.randn(N, H, generator=gen) * 4).to(dtype).requires_grad_()
    return x, order // k, token_slots(order, k), order, N, H, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_token_rows_is_x_of_ids_and_its_gradient_the_per_token_sum(dtype):
    """Forward bitwise x[ids]; x's gradient within one rounding of the float64 per-token sum of its rows'
    gradients (and no worse than autograd's index_put_ against it in bf16); only the slots are saved."""
    rng = random.Random(fresh_seed(7334 + (dtype == torch.bfloat16)))
    for _ in range(8):
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        x, ids, slots, _, N, H, k = _routes(rng, gen, dtype)
        pack, seen = _saved_storages()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rows = gather_token_rows(x, ids, slots)
        plain = x.detach().clone().requires_grad_()
        assert_bitwise_equal(rows, plain[ids], name="rows")
        assert seen == {slots.untyped_storage().data_ptr(): slots.untyped_storage().nbytes()}, "slots alone"
        grad = (torch.randn(N * k, H, generator=gen) * torch.rand(N * k, 1, generator=gen) * 8).to(dtype)
        rows.backward(grad)
        plain[ids].backward(grad)
        exact = torch.zeros(N, H, dtype=torch.float64).index_add_(0, ids, grad.double())
        magnitude = torch.zeros(N, H, dtype=torch.float64).index_add_(0, ids, grad.double().abs())
        fp32_error = 4 * k * torch.finfo(torch.float32).eps * magnitude
        rounding = 0 if dtype == torch.float32 else (exact.abs() + fp32_error) * 2.0 ** -8
        assert ((x.grad.double() - exact).abs() <= fp32_error + rounding).all()
        if dtype == torch.bfloat16:
            assert_no_worse_than_torch(x.grad, plain.grad, exact.float(), name="grad of x")


def test_permute_rows_is_autograd_indexing_bit_for_bit():
    """Rows of 1-D and 2-D tensors: forward and gradient equal x[perm]'s under autograd, the inverse
    alone saved; a perm or inverse not one id per row is refused."""
    rng = random.Random(fresh_seed(7336))
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((rng.randint(0, 40),), (rng.randint(1, 40), rng.randint(1, 9))):
            gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
            x = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
            perm = torch.randperm(shape[0], generator=gen)
            inverse = inverse_permutation(perm)
            pack, seen = _saved_storages()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = permute_rows(x, perm, inverse)
            plain = x.detach().clone().requires_grad_()
            assert_bitwise_equal(out, plain[perm], name="permuted")
            assert seen == {inverse.untyped_storage().data_ptr(): inverse.untyped_storage().nbytes()}
            grad = torch.randn(shape, generator=gen).to(dtype)
            out.backward(grad)
            plain[perm].backward(grad)
            assert_bitwise_equal(x.grad, plain.grad, name="grad")
    with pytest.raises(ValueError, match="one id per row"):
        permute_rows(torch.randn(5, 2), torch.arange(4), torch.arange(4))


@pytest.mark.parametrize("membership", ["strided", "contiguous"])
def test_add_token_rows_adds_each_chunks_token_sums(membership):
    """A layer's combine over K chunks of slices (PipelinedLLEP's memberships, empty chunks included):
    y within one rounding of the float64 per-token sums, every chunk's rows' gradient bitwise
    autograd's IndexAddBackward0 (grad of y at each row's token), y's input gradient passed through, the slots saved."""
    rng = random.Random(fresh_seed(7337 + (membership == "contiguous")))
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(5):
            gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
            N, H, k, K = rng.randint(1, 40), rng.randint(1, 12), rng.randint(1, 5), rng.randint(1, 6)
            base = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
            y, chunks = base * 1, []
            exact, magnitude = base.detach().double(), base.detach().double().abs()
            for tokens in chunk_membership(N, K, membership):
                n = len(range(N)[tokens])
                order = torch.randperm(n * k, generator=gen)          # the chunk's rows in a send order
                rows = torch.randn(n * k, H, generator=gen).to(dtype).requires_grad_()
                slots = token_slots(order, k)
                row_token = torch.arange(N)[tokens][order // k]
                y = add_token_rows(y, tokens, slots, rows)
                exact = exact.index_add_(0, row_token, rows.detach().double())
                magnitude = magnitude.index_add_(0, row_token, rows.detach().double().abs())
                chunks.append((rows, row_token))
            assert y.dtype == dtype
            # bf16: the chunk's sum rounded once, then its add to y's row once (half an ulp each)
            ulps = 2.0 ** -7 if dtype == torch.bfloat16 else 4 * (k + 1) * torch.finfo(torch.float32).eps
            assert ((y.double() - exact).abs() <= ulps * magnitude).all(), (y.double() - exact).abs().max()
            grad = torch.randn(N, H, generator=gen).to(dtype)
            y.backward(grad)
            assert_bitwise_equal(base.grad, grad, name="grad of y's input")
            for rows, row_token in chunks:
                assert_bitwise_equal(rows.grad, grad.index_select(0, row_token), name="grad of a chunk's rows")
    with pytest.raises(ValueError, match="add_token_rows"):
        add_token_rows(torch.zeros(4, 2), slice(0, 3), torch.zeros(3, 2, dtype=torch.int64), torch.randn(5, 2))
