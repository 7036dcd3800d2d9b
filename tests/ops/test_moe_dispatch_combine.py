"""combine.CombineRows against plain `index_add_`: forward values and every gradient bit for bit, and what
autograd saves: the ids, not the rows (a whole layer saves exactly R*H*act bytes fewer, R its routes).
combine.SumTokenRows (the local and expert-parallel combine) against the float64 sum: within one
rounding of the result, gradients bit for bit CombineRows', the ids alone saved, any chunking."""

from __future__ import annotations

import random

import pytest
import torch

from mop_train.ops.moe_dispatch import PipelinedLLEPOptions, llep, local, moe_experts_forward
from mop_train.ops.moe_dispatch import combine as combine_module
from mop_train.ops.moe_dispatch.combine import combine_rows, sum_token_rows, token_slots
from tests.utils import AllocatedBytes, assert_bitwise_equal, bf16_moe_layer, fresh_seed


def _plain(y, ids, rows):
    return y.index_add_(0, ids, rows)


def _saved_storages():
    """A pack hook recording every saved tensor's storage (pointer -> bytes), and the record."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    return pack, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rows_is_index_add_bit_for_bit(dtype):
    """Chains of combines into one y (as run_chunks does), repeated ids: y, grad of y's input, of every
    chunk's rows bitwise as autograd's IndexAddBackward0 gives them; only the ids are saved."""
    rng = random.Random(fresh_seed(7320 + (dtype == torch.bfloat16)))
    for _ in range(5):
        N, H, chunks = rng.randint(1, 40), rng.randint(1, 24), rng.randint(1, 4)
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        base = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
        ids = [torch.randint(0, N, (rng.randint(0, 3 * N),), generator=gen) for _ in range(chunks)]
        rows = [torch.randn(len(i), H, generator=gen).to(dtype).requires_grad_() for i in ids]
        grad = torch.randn(N, H, generator=gen).to(dtype)
        results = []
        for combine in (_plain, combine_rows):
            pack, seen = _saved_storages()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = base * 1                                  # a non-leaf y, as the layer's is after chunk 0
                for i, r in zip(ids, rows):
                    y = combine(y, i, r)
            y.backward(grad)
            results.append((y.detach(), base.grad, [r.grad for r in rows], seen))
            base.grad = None
            for r in rows:
                r.grad = None
        (y0, gb0, gr0, seen0), (y1, gb1, gr1, seen1) = results
        assert_bitwise_equal(y1, y0, name="y")
        assert_bitwise_equal(gb1, gb0, name="grad of y's input")
        for j, (a, b) in enumerate(zip(gr1, gr0)):
            assert_bitwise_equal(a, b, name=f"grad of rows {j}")
        id_bytes = {i.untyped_storage().data_ptr(): i.untyped_storage().nbytes() for i in ids}
        row_bytes = {r.untyped_storage().data_ptr(): r.untyped_storage().nbytes() for r in rows}
        assert seen1 == id_bytes, "CombineRows must save the ids alone"
        assert {**id_bytes, **row_bytes}.items() <= seen0.items(), "plain index_add_ saves ids and rows"


def test_combine_rows_rejects_rows_without_one_id_each():
    y, rows = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="one id per row"):
        combine_rows(y, torch.zeros(4, dtype=torch.int64), rows)


def _token_rows_case(rng, dtype, gen):
    """rows [R, H] laid out in a random route order (as a dispatch returns them), its slots and ids."""
    N, H, k = rng.randint(0, 60), rng.randint(1, 24), rng.randint(1, 6)
    order = torch.randperm(N * k, generator=gen)
    rows = (torch.randn(N * k, H, generator=gen) * torch.rand(N * k, 1, generator=gen) * 8).to(dtype)
    return rows.requires_grad_(), token_slots(order, k), order // k, N, H


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_token_rows_is_the_sum_within_one_rounding_and_backward_is_combine_rows(dtype, monkeypatch):
    """Random route orders, k and H, N = 0 included, chunks of every size (the chunk cap drawn down to one
    token): y within one rounding of the float64 sum (fp32: a few ulps of the terms' magnitude; bf16: the
    k rows are summed in fp32 and rounded once), the rows' gradient bitwise CombineRows', ids alone saved."""
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
        combine_rows(torch.zeros(N, H, dtype=dtype), ids, plain_rows).backward(grad)
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


def _layer(options, seed, monkeypatch, combine):
    """One MoE layer (group of one) forward+backward with the given combine: (y, grads, saved bytes
    of storages that are not the layer's inputs). The local schedule's combine is sum_token_rows, or
    the plain index_add_ when `combine` is the plain one."""
    monkeypatch.setattr(llep, "combine_rows", combine)
    if combine is _plain:
        monkeypatch.setattr(local, "sum_token_rows", _plain_token_rows)
    rng = random.Random(seed)
    N, H, I, E = rng.randint(40, 120), 8 * rng.randint(1, 6), 8 * rng.randint(1, 4), rng.randint(2, 6)
    k = rng.randint(1, min(3, E))
    gen = torch.Generator().manual_seed(seed)
    x, w1, w2, w3, weights, indices = bf16_moe_layer(gen, N, H, I, E, k)
    leaves = (x, w1, w2, w3, weights)
    inputs = {t.untyped_storage().data_ptr() for t in leaves + (indices,)}
    pack, seen = _saved_storages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe_experts_forward(x, indices, weights, w1, w2, w3, options)
    y.backward(torch.randn(N, H, generator=gen).bfloat16())
    saved = sum(b for p, b in seen.items() if p not in inputs)
    return y.detach(), [t.grad for t in leaves], saved, N * k * H * 2


@pytest.mark.parametrize("schedule", ["local", "pipelined_llep"])
def test_layer_is_unchanged_bit_for_bit_and_saves_its_rows_less(schedule, monkeypatch):
    """The whole layer with its combine (CombineRows, or SumTokenRows for local) against the same layer
    with plain index_add_: the grads of x, w1, w2, w3 and the routing weights bitwise (y too for
    CombineRows; SumTokenRows' y sums in another order, within a bf16 rounding of it); autograd's
    saved bytes drop by exactly N*k*H*act (the term memory.device_bound no longer counts)."""
    seed = fresh_seed(7322 + (schedule == "local"))
    K = random.Random(seed).randint(2, 4)
    options = None if schedule == "local" else PipelinedLLEPOptions(token_budget=40 // K, max_chunks=K)
    y0, g0, saved0, rows_bytes = _layer(options, seed, monkeypatch, _plain)
    monkeypatch.undo()
    y1, g1, saved1, _ = _layer(options, seed, monkeypatch, combine_rows)
    if schedule == "local":
        torch.testing.assert_close(y1.float(), y0.float(), rtol=2.0 ** -7, atol=2.0 ** -7 * y0.abs().max().item())
    else:
        assert_bitwise_equal(y1, y0, name="y")
    for name, a, b in zip(("x", "w1", "w2", "w3", "weights"), g1, g0):
        assert_bitwise_equal(a, b, name=f"grad of {name}")
    assert saved0 - saved1 == rows_bytes, (saved0, saved1, rows_bytes)
