"""The LLEP plan on hand-built count matrices (worked out by hand from the rules in llep_plan.py)."""

from __future__ import annotations

import pytest
import torch

from mop_train.ops.moe_dispatch.llep_plan import llep_plan
from tests.utils import fresh_seed


def counts(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_balanced_load_stays_with_owners():
    plan = llep_plan(counts([[5, 5, 5, 5], [5, 5, 5, 5]]))          # imbalance 1.0 < 1.3
    assert plan.ranges == ((0, 0, 0, 10), (1, 0, 0, 10), (2, 1, 0, 10), (3, 1, 0, 10))
    assert plan.transfers == () and plan.relocated_routes == 0


def test_owner_prefix_and_route_destinations():
    C = counts([[4, 0, 0], [4, 0, 0], [4, 0, 0]])                   # l = [12, 0, 0], cap 4
    plan = llep_plan(C, min_tokens_per_gemm=1)
    # The owner keeps the prefix; helpers tie at eff 0 -> lower rank first, then re-sorted.
    assert plan.ranges == ((0, 0, 0, 4), (0, 1, 4, 8), (0, 2, 8, 12))
    assert plan.transfers == ((0, 1), (0, 2)) and plan.relocated_routes == 8
    S = plan.send_matrix(C)
    assert torch.equal(S[:, :, 0], 4 * torch.eye(3, dtype=torch.int64))
    for r in range(3):                                              # source r holds positions [4r, 4r+4)
        assert plan.route_destinations(C, r).tolist() == [r] * 4


def test_helpers_ordered_by_effective_load():
    plan = llep_plan(counts([[10, 4, 1]] + [[0, 0, 0]] * 2), min_tokens_per_gemm=1)
    # cap 5. Expert 0: owner prefix 5; rank 2 (eff 1) before rank 1 (eff 4, its own expert pending)
    # takes 4; re-sorted, rank 1 (eff 4 < 5) takes the last route. Experts 1 and 2 stay home.
    assert plan.ranges == ((0, 0, 0, 5), (0, 2, 5, 9), (0, 1, 9, 10), (1, 1, 0, 4), (2, 2, 0, 1))
    assert plan.rank_load == (5, 5, 5)
    assert plan.transfers == ((0, 1), (0, 2)) and plan.relocated_routes == 5


def test_min_chunk_forced_remainder_and_full_spill():
    plan = llep_plan(counts([[10, 3, 2], [0, 0, 0], [0, 0, 0]]), min_tokens_per_gemm=4)
    # Expert 0: owner prefix 5; helper chunks of 3 and 2 are below m and not final -> forced to the
    # least-loaded helper (rank 2). Expert 2: its owner is full (avail 0), so it spills whole to
    # rank 1, a chunk below m accepted because it is the final remainder.
    assert plan.ranges == ((0, 0, 0, 5), (0, 2, 5, 10), (1, 1, 0, 3), (2, 1, 0, 2))
    assert plan.transfers == ((0, 2), (2, 1)) and plan.relocated_routes == 7


def test_repeated_helper_is_one_transfer():
    plan = llep_plan(counts([[14, 0, 0], [0, 0, 0], [0, 0, 0]]), min_tokens_per_gemm=1)
    # cap 4: owner 4, rank 1 gets 4, rank 2 gets 4, all full -> remainder 2 forced onto rank 1 again.
    assert plan.ranges == ((0, 0, 0, 4), (0, 1, 4, 8), (0, 2, 8, 12), (0, 1, 12, 14))
    assert plan.transfers == ((0, 1), (0, 2))


def test_alpha_raises_capacity():
    C = counts([[4, 0, 0], [4, 0, 0], [4, 0, 0]])
    plan = llep_plan(C, alpha=2.0, min_tokens_per_gemm=1)           # cap 8
    assert plan.ranges == ((0, 0, 0, 8), (0, 1, 8, 12))


def test_deterministic_and_covering():
    gen = torch.Generator().manual_seed(fresh_seed(3))
    C = torch.randint(0, 50, (4, 16), generator=gen)
    C[:, 5] += 400                                                  # one hot expert
    a = llep_plan(C, min_tokens_per_gemm=8, imbalance_threshold=1.0)
    assert a == llep_plan(C.clone(), min_tokens_per_gemm=8, imbalance_threshold=1.0)
    load = C.sum(0)
    S = a.send_matrix(C)
    assert torch.equal(S.sum(1), C)                                 # every route sent exactly once
    assert torch.equal(S.sum(0).sum(0), load)
    for e in range(16):                                             # ranges tile [0, l[e])
        spans = [(s, t) for x, _, s, t in a.ranges if x == e]
        assert [s for s, _ in spans] == [0] + [t for _, t in spans[:-1]]
        assert (spans[-1][1] if spans else 0) == int(load[e])
    for r in range(4):
        dest = a.route_destinations(C, r)
        assert torch.equal(torch.bincount(dest, minlength=4), S[r].sum(1))


@pytest.mark.parametrize("kwargs", [dict(alpha=0.0), dict(min_tokens_per_gemm=0),
                                    dict(imbalance_threshold=0.5)])
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        llep_plan(counts([[1, 2]]), **kwargs)
