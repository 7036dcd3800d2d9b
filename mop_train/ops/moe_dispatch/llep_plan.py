"""The LLEP relocation plan: which rank computes which slice of each expert's routes.

A pure, deterministic function of the global per-source count matrix C [P, E], so every rank of the
expert group (and every recompute) derives the same plan. Least-loaded expert parallelism
(arXiv 2601.17111; the paper's section 3.1) keeps every route's expert and moves the overflow of hot
experts onto ranks with spare capacity:
  1. gate: relocate only if max/mean of the ranks' native loads >= lambda (else standard EP);
  2. capacity per rank cap = floor(alpha * total / P); eff(g) = assigned[g] + pending native load;
  3. visit experts by descending load (ties by id): the owner takes what fits under cap as the prefix
     of the expert's route list, helpers (least eff first, each chunk >= m unless it is the last)
     take the rest; whatever no helper can take goes to the least-loaded helper; a range is only
     ever non-empty, so every weight copy (owner -> helper) carries at least one route;
  4. expert e's route list is the concatenation, in source-rank order, of each source's routes to e;
     a route goes to the rank whose range holds its position.
The imbalance gate is measured over ranks (the public reference code's choice), not over experts.

Legend: P expert-group size, E experts, M = E / P experts per rank (owner of e is e // M),
C[r, e] routes from source rank r to expert e, l[e] = sum_r C[r, e].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LLEPPlan:
    """ranges: (expert, rank, start, end) sorted by (expert, start), covering [0, l[e]) of every
    expert with routes; transfers: sorted unique (expert, helper) weight copies owner -> helper."""

    num_ranks: int
    experts_per_rank: int
    ranges: tuple[tuple[int, int, int, int], ...]
    transfers: tuple[tuple[int, int], ...]
    relocated_routes: int
    rank_load: tuple[int, ...]

    def owner(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def foreign_experts(self, rank: int) -> list[int]:
        """Experts `rank` computes as a helper, ascending: its slots after its native ones."""
        return [e for e, h in self.transfers if h == rank]

    def send_matrix(self, counts: torch.Tensor) -> torch.Tensor:
        """counts C [P, E] -> S [P(src), P(dst), E]: routes source r sends rank g for expert e."""
        P, E = counts.shape
        S = torch.zeros(P, P, E, dtype=torch.int64)
        if not self.ranges:
            return S
        q = torch.tensor(self.ranges, dtype=torch.int64)                    # [Q, 4]
        lo = torch.cumsum(counts, 0) - counts                                # [P, E] first position
        hi = lo + counts
        e, g, s, t = q.unbind(1)
        overlap = (torch.minimum(t, hi[:, e]) - torch.maximum(s, lo[:, e])).clamp(min=0)  # [P, Q]
        src = torch.arange(P).unsqueeze(1).expand_as(overlap)
        S.index_put_((src, g.expand_as(overlap), e.expand_as(overlap)), overlap, accumulate=True)
        return S

    def destination_runs(self, counts: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`rank`'s routes in expert-sorted (stable) order form runs: (rank of each run [Q], length
        of each run [Q]); expanding them gives every route's destination."""
        if not self.ranges:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        q = torch.tensor(self.ranges, dtype=torch.int64)
        lo = (torch.cumsum(counts, 0) - counts)[rank]                        # [E]
        hi = lo + counts[rank]
        e, g, s, t = q.unbind(1)
        return g, (torch.minimum(t, hi[e]) - torch.maximum(s, lo[e])).clamp(min=0)

    def route_destinations(self, counts: torch.Tensor, rank: int) -> torch.Tensor:
        """Destination rank of each of `rank`'s routes in expert-sorted (stable) order -> [R]."""
        return torch.repeat_interleave(*self.destination_runs(counts, rank))


def _fill_helpers(e, remaining, offset, others, eff, cap, m, assign, resort):
    """Hand `remaining` routes of expert e (from position `offset`) to helpers; see the module doc."""
    order = sorted(others, key=lambda h: eff(h))
    while remaining > 0:
        if resort:
            order = sorted(others, key=lambda h: eff(h))
        placed = False
        for h in order:
            if remaining == 0:        # a zero-length range would still cost a weight copy
                break
            spare = cap - eff(h)
            if spare <= 0:
                continue
            chunk = min(remaining, spare)
            if chunk < m and chunk < remaining:
                continue
            assign(e, h, offset, offset + chunk)
            offset, remaining, placed = offset + chunk, remaining - chunk, True
            if resort:
                break
        if not placed or not resort:
            break
    if remaining > 0:
        assign(e, order[0], offset, offset + remaining)


def llep_plan(counts: torch.Tensor, *, alpha: float = 1.0, min_tokens_per_gemm: int = 1024,
              imbalance_threshold: float = 1.3) -> LLEPPlan:
    """Build the LLEP plan from the global count matrix.

    Args:
        counts: [P, E] int64 routes from each source rank to each expert (E divisible by P).
        alpha: capacity factor; min_tokens_per_gemm: m; imbalance_threshold: lambda.
    """
    if alpha <= 0:
        raise ValueError(f"alpha = {alpha} must be > 0 (1.0 gives each rank the mean load as capacity)")
    if min_tokens_per_gemm < 1:
        raise ValueError(f"min_tokens_per_gemm = {min_tokens_per_gemm} must be >= 1")
    if imbalance_threshold < 1.0:
        raise ValueError(f"imbalance_threshold = {imbalance_threshold} must be >= 1.0 "
                         "(max/mean load is never below 1; 1.0 always relocates)")
    P, E = counts.shape
    if E % P:
        raise ValueError(f"counts has {E} experts over {P} ranks; the expert count must divide evenly")
    M = E // P
    load = counts.sum(0).tolist()                                           # l[e]
    native = [sum(load[g * M:(g + 1) * M]) for g in range(P)]
    total = sum(load)
    ranges, transfers = [], set()
    assigned = [0] * P
    mean = total / P
    relocate = total > 0 and max(native) / mean >= imbalance_threshold

    def assign(e, g, start, end):
        if end <= start:
            raise AssertionError(f"empty range for expert {e} on rank {g}")  # would ship weights for nothing
        ranges.append((e, g, start, end))
        assigned[g] += end - start
        if g != e // M:
            transfers.add((e, g))

    if not relocate:
        for e in range(E):
            if load[e]:
                assign(e, e // M, 0, load[e])
    else:
        cap = int(alpha * (total / P))
        pending = list(native)

        def eff(g):
            return assigned[g] + pending[g]

        for e in sorted(range(E), key=lambda e: (-load[e], e)):
            if load[e] == 0:
                continue
            owner = e // M
            pending[owner] -= load[e]
            avail = cap - eff(owner)
            others = [g for g in range(P) if g != owner]
            if avail >= load[e] or not others:
                assign(e, owner, 0, load[e])
            elif avail > 0:
                assign(e, owner, 0, avail)
                _fill_helpers(e, load[e] - avail, avail, others, eff, cap, min_tokens_per_gemm,
                              assign, resort=True)
            else:
                _fill_helpers(e, load[e], 0, others, eff, cap, min_tokens_per_gemm, assign,
                              resort=False)
    ranges.sort(key=lambda r: (r[0], r[2]))
    relocated = sum(end - start for e, g, start, end in ranges if g != e // M)
    return LLEPPlan(P, M, tuple(ranges), tuple(sorted(transfers)), relocated, tuple(assigned))
