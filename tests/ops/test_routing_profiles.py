"""The routing profiles of the paper's Appendix B.2, checked against their definition."""

from __future__ import annotations

import pytest
import torch

from mop_train.ops.routing_profiles import PROFILES, routing_profile


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


def test_all_profiles_listed():
    assert PROFILES == ("balanced", "30/16", "50/16", "80/16", "95/16", "30/4", "50/4")
    for name in PROFILES:
        idx, _ = routing_profile(name, 10, 32, 4)
        assert int(idx.max()) < 32


@pytest.mark.parametrize("name", ["hot", "30/64", "120/4", "30/0"])
def test_bad_profiles(name):
    with pytest.raises(ValueError):
        routing_profile(name, 10, 64, 4)
