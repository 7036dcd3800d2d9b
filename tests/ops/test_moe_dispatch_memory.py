"""The planner's bound on the bytes the routed experts hold for backward, per dispatch schedule,
against the per-route counts of the memory module's docstring worked out by hand."""

from __future__ import annotations

import math
import random

import torch

from mop_train.ops.moe_dispatch import EPOptions, LLEPOptions, PipelinedLLEPOptions, moe_experts_forward
from mop_train.ops.moe_dispatch.memory import ROUTE_INDEX_BYTES, RoutedShapes, device_bound, route_index_bytes
from tests.utils import bf16_moe_layer, fresh_seed


def routed_activation_bytes(options, **shapes):
    """The dispatch bound's (saved, working, how) as a tuple."""
    bound = device_bound(options, RoutedShapes(**shapes))
    return bound.saved, bound.working, bound.how


def _shape(rng):
    return dict(hidden=rng.randint(8, 64), inter=rng.randint(8, 64), top_k=rng.randint(1, 4),
                group_size=rng.randint(2, 8), local_experts=rng.randint(1, 8), act_bytes=rng.choice((2, 4)))


def test_whole_layer_schedules_save_every_route():
    """local / ep / llep: x_r and the expert output (2H; the combine keeps ids, not the weighted output),
    h1, h3, silu(h1) and their product (4I) per route saved; the combine's gradient (H) per route in
    backward."""
    rng = random.Random(fresh_seed(7310))
    for _ in range(10):
        s = _shape(rng)
        H, I, k, b = s["hidden"], s["inter"], s["top_k"], s["act_bytes"]
        N = rng.randint(1, 5000)
        for options, name in ((None, "local"), (EPOptions(), "ep")):
            saved, transient, how = routed_activation_bytes(options, tokens=N, **s)
            per_route_saved = H + H + I + I + I + I
            assert (saved, transient) == (N * k * per_route_saved * b, N * k * H * b)
            assert how.startswith(f"{name}: {N * k:,} routes")
            # Only "ep" warns that hot experts can multiply its routes by E_p.
            assert ("hot experts" in how) == (name == "ep") and how.endswith("experts)" if name == "ep" else
                                                                          "H in backward")
        alpha, threshold, m = rng.uniform(1.0, 3.0), rng.uniform(1.0, 3.0), rng.randint(1, 64)
        options = LLEPOptions(alpha=alpha, imbalance_threshold=threshold, min_tokens_per_gemm=m)
        saved, transient, how = routed_activation_bytes(options, tokens=N, **s)
        # A receiver holds at most max(alpha, threshold) x the mean (never more than the whole group), + m.
        routes = int(min(s["group_size"], max(alpha, threshold)) * N * k) + m
        assert (saved, transient) == (routes * (2 * H + 4 * I) * b, routes * H * b)
        assert how.startswith(f"llep: {routes:,} routes")


def test_pipelined_llep_saves_rows_and_recomputes_one_chunk():
    """Saved: every received row (N k H; the combine keeps ids, not rows) and the per-route index
    bookkeeping (ROUTE_INDEX_BYTES at group sizes above one). Backward: one chunk's recompute, (2H + 7I) per route of the
    largest chunk a destination receives, plus one weight-sized (E_l I H) temporary."""
    rng = random.Random(fresh_seed(7311))
    for _ in range(10):
        s = _shape(rng)
        H, I, k, G, E_l, b = (s["hidden"], s["inter"], s["top_k"], s["group_size"], s["local_experts"],
                              s["act_bytes"])
        N, c, K_max = rng.randint(1, 5000), rng.randint(16, 512), rng.randint(1, 12)
        alpha, threshold, m = rng.uniform(1.0, 2.0), rng.uniform(1.0, 2.0), rng.randint(1, 32)
        options = PipelinedLLEPOptions(alpha=alpha, imbalance_threshold=threshold, min_tokens_per_gemm=m,
                                       token_budget=c, max_chunks=K_max)
        saved, transient, how = routed_activation_bytes(options, tokens=N, **s)
        K = min(math.ceil(N / c), K_max)
        c_eff = math.ceil(N / K)                  # tokens per chunk
        chunk = min(G * k * c_eff, int(max(alpha, threshold) * k * c_eff) + m)
        assert saved == N * k * (H * b + ROUTE_INDEX_BYTES)          # G >= 2 here
        assert transient == (chunk * (2 * H + 7 * I) + E_l * I * H) * b
        assert f"K={K} chunks" in how and f"c_eff={c_eff:,}" in how


def test_pipelined_llep_with_one_token_plans_a_chunk_of_one():
    """A rank with a single token (c >= 2): one chunk of one token, so the budget's bound is E_p * k."""
    rng = random.Random(fresh_seed(7312))
    s = _shape(rng)
    H, I, k, G, E_l, b = s["hidden"], s["inter"], s["top_k"], s["group_size"], s["local_experts"], s["act_bytes"]
    # m above the bound: the budget's E_p * k * c_eff is the figure planned.
    options = PipelinedLLEPOptions(token_budget=rng.randint(2, 64), min_tokens_per_gemm=10 * G * k)
    _, transient, how = routed_activation_bytes(options, tokens=1, **s)
    assert transient == (G * k * (2 * H + 7 * I) + E_l * I * H) * b
    assert "K=1 chunks" in how and "c_eff=1)" in how


def _saved_by_layer(N, H, I, E, k, K, seed):
    """Bytes of distinct storages a pipelined_llep layer (group of one) saves for backward, its inputs
    excluded, counted by autograd's own pack hook, and the routing weights' dtype."""
    gen = torch.Generator().manual_seed(seed)
    x, w1, w2, w3, weights, indices = bf16_moe_layer(gen, N, H, I, E, k)
    inputs = {t.untyped_storage().data_ptr() for t in (x, w1, w2, w3, weights, indices)}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe_experts_forward(x, indices, weights, w1, w2, w3,
                                PipelinedLLEPOptions(token_budget=-(-N // K), max_chunks=K))
    y.float().pow(2).sum().backward()          # the graph it saved runs (nothing dropped by mistake)
    return sum(seen.values())


def test_pipelined_llep_saved_bytes_are_what_autograd_packs():
    """The bound's `saved` against what autograd actually packs for a layer at group size one (bf16 rows,
    fp32 routing weights; rows arrive in slot order there, so no receive permutation is saved), at two
    token counts: a factor off in the rows, the combine (slots only, tests/ops/test_moe_dispatch_combine.py)
    or the index bookkeeping fails."""
    rng = random.Random(fresh_seed(7313))
    H, I, E, K = 8 * rng.randint(2, 8), 8 * rng.randint(1, 4), rng.randint(2, 8), rng.randint(2, 4)
    k = rng.randint(1, min(3, E))
    for N in (K * rng.randint(50, 100), K * rng.randint(150, 300)):
        bound = device_bound(PipelinedLLEPOptions(token_budget=-(-N // K), max_chunks=K),
                             RoutedShapes(tokens=N, hidden=H, inter=I, top_k=k, group_size=1, local_experts=E,
                                          act_bytes=2))
        assert bound.saved == N * k * (2 * H + route_index_bytes(1)) and route_index_bytes(1) == ROUTE_INDEX_BYTES - 16
        assert _saved_by_layer(N, H, I, E, k, K, rng.randint(0, 2**31)) == bound.saved, (N, H, I, E, k, K)
