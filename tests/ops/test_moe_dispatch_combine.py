"""combine.CombineRows against plain `index_add_`: forward values and every gradient bit for bit, and what
autograd saves: the ids, not the rows (a whole layer saves exactly R*H*act bytes fewer, R its routes)."""

from __future__ import annotations

import random

import pytest
import torch

from mop_train.ops.moe_dispatch import PipelinedLLEPOptions, llep, local, moe_experts_forward
from mop_train.ops.moe_dispatch.combine import combine_rows
from tests.utils import assert_bitwise_equal, bf16_moe_layer, fresh_seed


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


def _layer(options, seed, monkeypatch, combine):
    """One MoE layer (group of one) forward+backward with the given combine: (y, grads, saved bytes
    of storages that are not the layer's inputs)."""
    monkeypatch.setattr(llep, "combine_rows", combine)
    monkeypatch.setattr(local, "combine_rows", combine)
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
    """The whole layer with CombineRows against the same layer with plain index_add_: y and the grads of
    x, w1, w2, w3 and the routing weights bitwise; autograd's saved bytes drop by exactly N*k*H*act
    (the term memory.device_bound no longer counts)."""
    seed = fresh_seed(7322 + (schedule == "local"))
    K = random.Random(seed).randint(2, 4)
    options = None if schedule == "local" else PipelinedLLEPOptions(token_budget=40 // K, max_chunks=K)
    y0, g0, saved0, rows_bytes = _layer(options, seed, monkeypatch, _plain)
    y1, g1, saved1, _ = _layer(options, seed, monkeypatch, combine_rows)
    assert_bitwise_equal(y1, y0, name="y")
    for name, a, b in zip(("x", "w1", "w2", "w3", "weights"), g1, g0):
        assert_bitwise_equal(a, b, name=f"grad of {name}")
    assert saved0 - saved1 == rows_bytes, (saved0, saved1, rows_bytes)
