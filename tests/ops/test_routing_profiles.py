"""The routing profiles of the paper's Appendix B.2, checked against their definition."""

from __future__ import annotations

import pytest
import torch

from mop_train.ops.routing_profiles import PROFILES, routing_profile
from tests.utils import fresh_seed


def test_balanced():
    idx, w = routing_profile("balanced", 6, 5, 3)
    assert idx.tolist() == [[(i + j) % 5 for j in range(3)] for i in range(6)]
    assert torch.equal(w, torch.full((6, 3), 1 / 3))
    idx, _ = routing_profile("balanced", 64, 16, 4)                 # E | N: every expert equal load
    assert torch.bincount(idx.reshape(-1), minlength=16).tolist() == [16] * 16


@pytest.mark.parametrize("name,hot_tokens,h", [("30/16", 30, 16), ("50/16", 50, 16), ("80/16", 80, 16),
                                               ("95/16", 95, 16), ("30/4", 30, 4), ("50/4", 50, 4)])
def test_hot_profiles(name, hot_tokens, h):
    N, E, k = 100, 64, 8
    idx, w = routing_profile(name, N, E, k)
    assert idx.shape == (N, k) and idx.dtype == torch.int64
    assert torch.equal(w, torch.full((N, k), 1 / k))
    for i in range(N):
        want = [j % h for j in range(k)] if i < hot_tokens else [h + (i + j) % (E - h) for j in range(k)]
        assert idx[i].tolist() == want, (name, i)
    assert len(set(idx[0].tolist())) == min(k, h)


def test_floor_of_hot_tokens():
    idx, _ = routing_profile("95/16", 19, 64, 2)                    # floor(0.95 * 19) = 18 hot tokens
    assert (idx[:18] < 16).all() and (idx[18] >= 16).all()


@pytest.mark.parametrize("name", PROFILES)
def test_each_profile_is_what_its_name_says(name):
    """Over random sizes: "r/h" sends exactly the first floor(r% N) tokens to the h hot experts
    (each to min(k, h) distinct ones), every other token to min(k, E - h) distinct cold experts;
    "balanced" gives each token k distinct experts (k <= E) and every expert a load within k of
    every other's. Weights are 1/k, summing to one per token."""
    gen = torch.Generator().manual_seed(fresh_seed(sum(map(ord, name))))
    pct, hot = (None, 0) if name == "balanced" else (int(part) for part in name.split("/"))
    for _ in range(20):
        N = int(torch.randint(1, 300, (1,), generator=gen))
        E = int(torch.randint(hot + 1, hot + 80, (1,), generator=gen))
        k = int(torch.randint(1, min(E, 9) + 1, (1,), generator=gen))
        idx, w = routing_profile(name, N, E, k)
        tag = f"{name} N={N} E={E} k={k}"
        assert idx.shape == (N, k) and w.shape == (N, k), tag
        assert 0 <= int(idx.min()) and int(idx.max()) < E, tag
        assert torch.allclose(w.sum(1), torch.ones(N)), tag
        distinct = [len(set(row)) for row in idx.tolist()]
        if name == "balanced":
            assert distinct == [k] * N, tag
            load = torch.bincount(idx.reshape(-1), minlength=E)
            assert int(load.max() - load.min()) <= k, tag
            continue
        is_hot = (idx < hot).all(1)                                  # [N]
        num_hot = int(is_hot.sum())
        assert num_hot == pct * N // 100, tag                        # the name's r, floored
        assert is_hot[:num_hot].all() and not (idx[num_hot:] < hot).any(), tag   # hot first, cold never hot
        assert distinct == [min(k, hot)] * num_hot + [min(k, E - hot)] * (N - num_hot), tag


@pytest.mark.parametrize("name,message", [("hot", "expected 'balanced' or 'r/h'"), ("30/64", "need 0 <= r <= 100"),
                                          ("101/4", "need 0 <= r <= 100"), ("-1/4", "need 0 <= r <= 100"),
                                          ("30/0", "1 <= h < 64")])
def test_bad_profiles(name, message):
    with pytest.raises(ValueError, match=message):
        routing_profile(name, 10, 64, 4)


def test_edge_profiles_device_and_dtype():
    """r = 0 and r = 100, one hot expert, h = E - 1: valid; the tensors on the device and in the dtype asked."""
    assert not (routing_profile("0/4", 10, 8, 2)[0] < 4).any()
    assert (routing_profile("100/4", 10, 8, 2)[0] < 4).all()
    assert routing_profile("50/1", 10, 8, 2)[0][:5].eq(0).all()
    assert (routing_profile("50/7", 10, 8, 2)[0][5:] == 7).all()
    for name in ("balanced", "30/4"):
        idx, w = routing_profile(name, 6, 8, 2, device="meta", dtype=torch.float64)
        assert idx.is_meta and w.is_meta and w.dtype == torch.float64 and idx.dtype == torch.int64
