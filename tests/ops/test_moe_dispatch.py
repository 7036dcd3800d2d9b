"""Expert-parallel dispatch schedules against `dispatch="local"` on the full expert weights.

Every rank builds the whole problem (all ranks' tokens and the full weights) from one seed, runs the
local schedule for each rank as the oracle, then runs the schedule under test on its own tokens and
its own expert shard. Checked: outputs, grads of x and routing weights, and this rank's expert-shard
grads against its slice of the summed full-weight grads — plain and under an outer non-reentrant
checkpoint (the decoder's). All cases run inside one spawn per world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from mop_train.ops.moe_dispatch import moe_experts_forward
from mop_train.ops.moe_dispatch.local import local_experts_forward
from mop_train.ops.moe_dispatch.reference import reference_experts_forward
from tests.dist_utils import run_distributed
from tests.utils import assert_close

H, I, E, K_TOP = 8, 12, 12, 3


def make_routing(kind: str, n: int, rank: int, world: int, gen: torch.Generator):
    """[n, k] expert ids for one source rank; ids are distinct per token except in 'one_expert'."""
    M = E // world
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(n)]) \
            if n else torch.zeros(0, K_TOP, dtype=torch.long)
    if kind == "one_expert":        # everything to expert 0 (rank 0)
        return torch.zeros(n, K_TOP, dtype=torch.long)
    if kind == "skip_last_rank":    # no route reaches the last rank's experts
        pool = E - M
        return torch.stack([torch.randperm(pool, generator=gen)[:K_TOP] for _ in range(n)]) \
            if n else torch.zeros(0, K_TOP, dtype=torch.long)
    raise ValueError(kind)


def build_case(seed: int, tokens: list[int], kind: str, world: int):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    w3 = torch.randn(E, I, H, generator=gen) / H ** 0.5
    per_rank = []
    for r, n in enumerate(tokens):
        x = torch.randn(n, H, generator=gen)
        idx = make_routing(kind, n, r, world, gen)
        wts = torch.rand(n, K_TOP, generator=gen) + 0.1
        g = torch.randn(n, H, generator=gen)
        per_rank.append((x, idx, wts, g))
    return (w1, w2, w3), per_rank


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def grad_of(t):
    """The gradient of a leaf; None (no path from the loss, e.g. zero tokens) reads as zeros."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def oracle(weights_full, per_rank):
    """Local schedule per rank on the full weights: outputs, x/weight grads, summed expert grads."""
    ws = [leaf(w) for w in weights_full]
    results = []
    for x, idx, wts, g in per_rank:
        xl, wl = leaf(x), leaf(wts)
        y = local_experts_forward(xl, idx, wl, *ws)
        (y * g).sum().backward()
        results.append((y.detach(), grad_of(xl), grad_of(wl)))
    return results, [grad_of(w) for w in ws]


def run_schedule(dispatch, options, x, idx, wts, g, shards, group, outer_checkpoint):
    xl, wl = leaf(x), leaf(wts)
    ws = [leaf(w) for w in shards]

    def layer(x_, w_, a, b, c):
        return moe_experts_forward(x_, idx, w_, a, b, c, dispatch=dispatch, group=group, **options)

    if outer_checkpoint:
        y = checkpoint(layer, xl, wl, *ws, use_reentrant=False)
    else:
        y = layer(xl, wl, *ws)
    (y * g).sum().backward()
    return y.detach(), grad_of(xl), grad_of(wl), [grad_of(w) for w in ws]


def check_case(rank, world, dispatch, options, seed, tokens, kind, outer_checkpoint):
    weights_full, per_rank = build_case(seed, tokens, kind, world)
    expected, full_grads = oracle(weights_full, per_rank)
    M = E // world
    shards = [w[rank * M:(rank + 1) * M] for w in weights_full]
    x, idx, wts, g = per_rank[rank]
    y, gx, gw, gshards = run_schedule(dispatch, options, x, idx, wts, g, shards, dist.group.WORLD,
                                      outer_checkpoint)
    tag = f"[{dispatch} {options} {kind} tokens={tokens} ckpt={outer_checkpoint} rank={rank}]"
    ey, egx, egw = expected[rank]
    assert_close(y, ey, name=f"y {tag}")
    assert_close(gx, egx, name=f"grad x {tag}")
    assert_close(gw, egw, name=f"grad routing weights {tag}")
    for name, got, full in zip(("w1", "w2", "w3"), gshards, full_grads):
        assert_close(got, full[rank * M:(rank + 1) * M], name=f"grad {name} {tag}")


def ep_cases(world):
    n = [7 + 3 * r for r in range(world)]
    cases = [("random", n), ("one_expert", n), ("skip_last_rank", n),
             ("random", [0] + n[1:])]                     # rank 0 has no tokens: it only receives
    return cases


def _ep_worker(rank, world):
    torch.manual_seed(0)
    for i, (kind, tokens) in enumerate(ep_cases(world)):
        for ckpt in (False, True):
            check_case(rank, world, "ep", {}, 100 + i, tokens, kind, ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_matches_local(world):
    run_distributed(_ep_worker, world)


def _single_rank_worker(rank, world):
    weights_full, per_rank = build_case(7, [9], "random", 1)
    x, idx, wts, g = per_rank[0]
    y, *_ = run_schedule("ep", {}, x, idx, wts, g, weights_full, None, False)
    assert_close(y, reference_experts_forward(x, idx, wts, *weights_full), name="ep at size 1")


def test_ep_single_rank_is_local():
    _single_rank_worker(0, 1)
