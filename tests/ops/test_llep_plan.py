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


@pytest.mark.parametrize("kwargs,message", [(dict(alpha=0.0), "alpha = 0.0 must be > 0"),
                                            (dict(min_tokens_per_gemm=0), "min_tokens_per_gemm = 0 must be >= 1"),
                                            (dict(imbalance_threshold=0.5), "imbalance_threshold = 0.5 must be >= 1.0")])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        llep_plan(counts([[1, 2]]), **kwargs)
    with pytest.raises(ValueError, match="3 experts over 2 ranks"):
        llep_plan(counts([[1, 2, 3], [1, 2, 3]]))


def test_no_routes_gives_an_empty_plan():
    C = counts([[0] * 4] * 2)
    plan = llep_plan(C, imbalance_threshold=1.0)
    assert plan.ranges == () and plan.transfers == () and plan.rank_load == (0, 0)
    assert plan.num_ranks == 2 and plan.experts_per_rank == 2
    assert torch.equal(plan.send_matrix(C), torch.zeros(2, 2, 4, dtype=torch.int64))
    for r in range(2):
        runs, lengths = plan.destination_runs(C, r)
        dest = plan.route_destinations(C, r)
        for t in (runs, lengths, dest):
            assert t.dtype == torch.int64 and t.shape == (0,)


def test_one_route_and_imbalance_exactly_at_the_threshold():
    # One route in all: max/mean = P >= lambda, cap = floor(1/3) = 0, so it goes to the least-loaded helper.
    plan = llep_plan(counts([[0, 1, 0], [0, 0, 0], [0, 0, 0]]), min_tokens_per_gemm=1)
    assert plan.ranges == ((1, 0, 0, 1),) and plan.transfers == ((1, 0),)
    # Native loads [3, 1]: max/mean = 1.5 relocates at lambda = 1.5 (the gate is >=), not above it.
    C = counts([[3, 1], [0, 0]])
    assert llep_plan(C, imbalance_threshold=1.5, min_tokens_per_gemm=1).ranges == ((0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 0, 1))
    assert llep_plan(C, imbalance_threshold=1.51, min_tokens_per_gemm=1).ranges == ((0, 0, 0, 3), (1, 1, 0, 1))


def test_owner_full_forced_remainder_goes_to_the_first_helper_of_the_pass():
    C = counts([[10, 9, 7, 0, 0, 0]] + [[0] * 6] * 2)                # native [19, 7, 0], cap 8, M = 2
    plan = llep_plan(C, min_tokens_per_gemm=4)
    # Expert 0: its owner is full (expert 1 pending, 9 > 8): one pass over the helpers in eff order
    # [2 (0), 1 (7)]; rank 2 takes 8, rank 1's spare 1 is below m and not final, so the remaining 2
    # go to the pass's first helper, rank 2 (not to rank 1, the least loaded after the pass).
    # Expert 1: the owner (now empty) takes 8, rank 1 the last route. Expert 2 stays home.
    assert plan.ranges == ((0, 2, 0, 8), (0, 2, 8, 10), (1, 0, 0, 8), (1, 1, 8, 9), (2, 1, 0, 7))
    assert plan.transfers == ((0, 2), (1, 1)) and plan.rank_load == (8, 8, 10)
    assert [plan.owner(e) for e in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [plan.foreign_experts(r) for r in range(3)] == [[], [1], [0]]


def rules_plan(C, alpha, m, lam):
    """LLEP.md step 5 written out again, independently: (e, rank, start, end) ranges, non-empty."""
    P, E = C.shape
    M = E // P
    load = C.sum(0).tolist()
    native = [sum(load[g * M:(g + 1) * M]) for g in range(P)]
    total = sum(load)
    if total == 0 or max(native) / (total / P) < lam:
        return sorted((e, e // M, 0, load[e]) for e in range(E) if load[e])
    cap, assigned, pending, out = int(alpha * total / P), [0] * P, list(native), []
    eff = lambda g: assigned[g] + pending[g]  # noqa: E731

    def give(e, g, s, t):
        out.append((e, g, s, t))
        assigned[g] += t - s

    for e in sorted(range(E), key=lambda e: (-load[e], e)):
        if not load[e]:
            continue
        g0 = e // M
        pending[g0] -= load[e]
        avail = cap - eff(g0)
        if avail >= load[e]:
            give(e, g0, 0, load[e])
            continue
        start = max(avail, 0)
        if avail > 0:
            give(e, g0, 0, avail)
        left, one_pass = load[e] - start, avail <= 0
        # The owner-full case is one pass over the helpers in their order before it; a forced
        # remainder then goes to the first of that order (llep_plan's reading of "least-loaded").
        first_order = sorted((g for g in range(P) if g != g0), key=eff)
        while left:
            placed = False
            for h in sorted((g for g in range(P) if g != g0), key=eff):
                spare = cap - eff(h)
                chunk = min(left, spare)
                if spare <= 0 or (chunk < m and chunk < left):
                    continue
                give(e, h, start, start + chunk)
                start, left, placed = start + chunk, left - chunk, True
                if not one_pass or not left:
                    break
            if not placed or one_pass:
                break
        if left:
            target = first_order[0] if one_pass else min((g for g in range(P) if g != g0), key=eff)
            give(e, target, start, start + left)
    return sorted(out, key=lambda r: (r[0], r[2]))


def fuzz_counts(gen, P):
    """[P, E] route counts: a random mix of uniform, Zipf-skewed, one-hot and empty experts."""
    E = P * int(torch.randint(1, 7, (1,), generator=gen))
    kind = int(torch.randint(0, 4, (1,), generator=gen))
    if kind == 0:
        C = torch.randint(0, 40, (P, E), generator=gen)
    else:
        rank = torch.randperm(E, generator=gen).float() + 1
        zipf = rank ** -(0.5 + kind * 0.5)                           # exponents 1.0, 1.5, 2.0
        C = (zipf / zipf.sum() * 400 * torch.rand(P, 1, generator=gen) * 2).round().long()
    C[:, torch.rand(E, generator=gen) < 0.2] = 0                    # some experts idle
    return C


def test_fuzz_no_weight_copy_without_routes():
    """Random loads, P in 2..8: every planned transfer carries routes, every range is what the
    LLEP rules give (so every route lands where LLEP says), and the capacity rules hold."""
    gen = torch.Generator().manual_seed(fresh_seed(17))
    transfers = 0
    for trial in range(600):
        P = 2 + trial % 7
        C = fuzz_counts(gen, P)
        alpha = (1.0, 1.1, 1.5)[trial % 3]
        m = (1, 4, 16, 1024)[trial % 4]
        lam = (1.0, 1.3)[trial % 2]
        plan = llep_plan(C, alpha=alpha, min_tokens_per_gemm=m, imbalance_threshold=lam)
        tag = f"trial {trial} P={P} alpha={alpha} m={m} lambda={lam}\n{C.tolist()}"
        assert plan.num_ranks == P and plan.experts_per_rank == C.shape[1] // P, tag
        assert list(plan.ranges) == rules_plan(C, alpha, m, lam), tag
        M, load = plan.experts_per_rank, C.sum(0)
        assert all(t > s for _, _, s, t in plan.ranges), tag                # no empty range
        carried = {(e, g) for e, g, s, t in plan.ranges if g != e // M}
        assert set(plan.transfers) == carried, tag                          # copies exactly where routes go
        transfers += len(plan.transfers)
        S = plan.send_matrix(C)
        assert torch.equal(S.sum(1), C), tag                                # every route sent once
        assert plan.rank_load == tuple(S.sum(0).sum(1).tolist()), tag
        cap = int(alpha * int(load.sum()) / P)
        for e in range(C.shape[1]):
            spans = [(g, s, t) for x, g, s, t in plan.ranges if x == e]
            if spans and spans[0][0] == e // M:                             # the owner holds the prefix
                assert spans[0][1] == 0, tag
            assert [s for _, s, _ in spans] == [0] + [t for _, _, t in spans[:-1]] if spans \
                else not load[e], tag                                       # ranges tile [0, l[e])
            assert (spans[-1][2] if spans else 0) == int(load[e]), tag
            assert sum(g == e // M for g, _, _ in spans) <= 1, tag
            for g, s, t in spans[:-1]:                                       # only the last may be < m
                assert g == e // M or t - s >= m, tag
        if plan.relocated_routes:
            # A rank is only over capacity through a forced remainder (the last range of an expert).
            over = [g for g in range(P) if plan.rank_load[g] > cap]
            last = {max((r for r in plan.ranges if r[0] == e), key=lambda r: r[2])[1]
                    for e in range(C.shape[1]) if load[e]}
            assert set(over) <= last, tag
    assert transfers > 100                                                   # the fuzz did relocate


def test_zipf_eight_ranks_every_copy_carries_routes():
    """The issue's case: Zipf-skewed load over 8 ranks, owners full -> no empty transfers."""
    rank = torch.arange(1, 65).float()
    load = (rank ** -1.2 / (rank ** -1.2).sum() * 8 * 4096 * 8).round().long()
    C = torch.stack([load // 8] * 8)                                         # [8, 64]
    plan = llep_plan(C, min_tokens_per_gemm=128)
    sizes = {}
    for e, g, s, t in plan.ranges:
        if g != e // plan.experts_per_rank:
            sizes[(e, g)] = sizes.get((e, g), 0) + t - s
    assert plan.transfers and all(sizes[tr] > 0 for tr in plan.transfers)
    assert set(sizes) == set(plan.transfers)


def test_helper_chunk_of_exactly_m_is_taken():
    """A helper whose spare capacity is exactly m (1 included) takes a chunk of exactly m (chunk >= m),
    on random loads built so the least-loaded helper has spare m and more than m routes remain."""
    gen = torch.Generator().manual_seed(fresh_seed(19))
    cases = 0
    while cases < 30:
        P = int(torch.randint(3, 7, (1,), generator=gen))
        # Every fifth case has m = 1: a helper with exactly one spare route must take it.
        m = 1 if cases % 5 == 0 else int(torch.randint(2, 30, (1,), generator=gen))
        others = torch.randint(0, 50, (P - 1,), generator=gen).tolist()   # experts 1..P-1, one per rank
        helper = 1 + min(range(P - 1), key=lambda g: (others[g], g))      # least eff, lowest rank on ties
        cap = others[helper - 1] + m
        hot = P * cap - sum(others) + int(torch.randint(0, P, (1,), generator=gen))   # floor(total / P) = cap
        if hot - cap <= m or hot <= max(others) or hot * P < 1.3 * (hot + sum(others)):
            continue                                                       # not the case under test
        C = torch.tensor([[hot] + others] + [[0] * P] * (P - 1))          # [P, E = P]
        plan = llep_plan(C, min_tokens_per_gemm=m)
        assert (0, 0, 0, cap) in plan.ranges, (C.tolist(), m, plan.ranges)   # the owner's prefix
        assert (0, helper, cap, cap + m) in plan.ranges, (C.tolist(), m, plan.ranges)
        assert list(plan.ranges) == rules_plan(C, 1.0, m, 1.3), (C.tolist(), m)
        cases += 1
