"""Layout plan properties over every divisor combination, and real gloo groups."""

import itertools
import random
import re

import pytest
import torch
import torch.distributed as dist

from mop_train.layout import KINDS, RankLayout, plan_layout
from tests.dist_utils import run_distributed, worker_device
from tests.utils import fresh_seed

WORLDS = (1, 2, 4, 6, 8, 12, 16, 64)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_plan(plan):
    W = plan.world_size
    for kind in KINDS:
        groups = plan.groups(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(W)), f"{kind} groups do not partition range({W})"
        assert all(len(g) == plan.degree(kind) for g in groups)
        for g in groups:
            assert list(g) == list(range(g[0], g[0] + len(g))), f"{kind} group {g} not contiguous"
        for r in range(W):
            g = plan.group_of(kind, r)
            assert r in g and g.index(r) == plan.group_rank(kind, r)
            assert groups[plan.group_index(kind, r)] is g or groups[plan.group_index(kind, r)] == g
    for kind in ("expert", "vocab"):
        replicas = getattr(plan, f"{kind}_replica_groups")
        assert sorted(r for g in replicas for r in g) == list(range(W))
        for g in replicas:
            assert len({plan.group_rank(kind, r) for r in g}) == 1, "replicas must hold the same shard"
            assert len(g) == W // plan.degree(kind)


@pytest.mark.parametrize("world", WORLDS)
def test_every_divisor_combination(world):
    divs = _divisors(world)
    combos = list(itertools.product(divs, divs, divs))
    for d, e, p in combos:
        _check_plan(plan_layout(world, d, e, p))


@pytest.mark.parametrize("bad", [0, -2, 3, 5])
def test_bad_degree_names_value_world_and_divisors(bad):
    for kind, args in (("seq", (bad, 1, 1)), ("expert", (1, bad, 1)), ("vocab", (1, 1, bad))):
        with pytest.raises(ValueError) as info:
            plan_layout(8, *args)
        msg = str(info.value)
        assert f"{kind}_degree ({bad})" in msg and "(8)" in msg and "[1, 2, 4, 8]" in msg


def _random_plan(offset):
    """A plan with a random world size (1..64) and random valid degrees."""
    rng = random.Random(fresh_seed(offset))
    world = rng.randint(1, 64)
    divs = _divisors(world)
    return plan_layout(world, rng.choice(divs), rng.choice(divs), rng.choice(divs))


def test_world_size_alone_gives_singleton_groups():
    # Degrees left out mean no sequence, expert or vocab parallelism: every rank is its own group.
    world = random.Random(fresh_seed(9101)).randint(1, 64)
    plan = plan_layout(world)
    for kind in KINDS:
        assert plan.groups(kind) == tuple((r,) for r in range(world)), kind


@pytest.mark.parametrize("bad", [0, -3, 4.0, "4"])
def test_bad_world_size_rejected(bad):
    with pytest.raises(ValueError, match=re.escape(f"world_size ({bad!r}) must be an integer")):
        plan_layout(bad)


def test_rank_outside_world_rejected():
    plan = _random_plan(9102)
    W = plan.world_size
    for rank in (-1, W):
        for kind in KINDS:
            for lookup in (plan.group_index, plan.group_rank, plan.group_of):
                with pytest.raises(ValueError, match=re.escape(f"rank ({rank}) must be in [0, {W})")):
                    lookup(kind, rank)


def test_unknown_group_kind_rejected():
    with pytest.raises(ValueError, match="unknown group kind 'data'"):
        _random_plan(9103).groups("data")


def test_build_needs_an_initialised_process_group():
    assert not dist.is_initialized(), "fast tests run without a default process group"
    with pytest.raises(RuntimeError, match="RankLayout.build needs torch.distributed initialised"):
        RankLayout.build(plan_layout(1))


def test_describe_agrees_with_the_plan():
    plan = _random_plan(9104)
    W = plan.world_size
    text = plan.describe()
    # Counts in the header (KINDS order) and the data line are whole numbers that match the plan.
    counts = [int(n) for n in re.findall(r"\((\d+) groups\)", text.splitlines()[0])]
    assert counts == [len(plan.groups(kind)) for kind in KINDS], text.splitlines()[0]
    data = re.findall(r"data: (\d+) sequence groups consume distinct sequences; expert shards replicated (\d+)x",
                      text)
    assert data == [(str(len(plan.seq_groups)), str(len(plan.expert_replica_groups[0])))], text
    rows = [l for l in text.splitlines() if l.strip()[:1].isdigit()]
    assert len(rows) == W
    for r, row in enumerate(rows):
        expected = [r]
        for kind in KINDS:
            expected += [plan.group_index(kind, r), plan.group_rank(kind, r)]
        assert [int(n) for n in re.findall(r"\d+", row)] == expected, row


def test_describe_lists_every_rank():
    text = plan_layout(8, 2, 4, 2).describe()
    assert "W=8" in text and "D=2" in text and "E_p=4" in text and "P=2" in text
    assert len([l for l in text.splitlines() if l.strip()[:1].isdigit()]) == 8


def test_cli_layout(capsys):
    from mop_train.cli import main

    assert main(["layout", "--world", "64", "--seq", "8", "--expert", "64", "--vocab", "8"]) == 0
    out = capsys.readouterr().out
    assert "W=64" in out and out.count("\n") > 64
    assert main(["layout", "--world", "6", "--seq", "4"]) == 2
    assert "seq_degree (4)" in capsys.readouterr().err


def _groups_sum_their_members(rank, world_size, all_degrees):
    # A plan for another world size is refused before any group is created (no collective runs).
    with pytest.raises(ValueError, match=re.escape(f"the plan is for {2 * world_size} ranks but the process "
                                                   f"group has {world_size}")):
        RankLayout.build(plan_layout(2 * world_size))
    for degrees in all_degrees:
        _check_groups(rank, world_size, degrees)


def _check_groups(rank, world_size, degrees):
    plan = plan_layout(world_size, *degrees)
    layout = RankLayout.build(plan)
    assert layout.mesh.size() == world_size
    for kind, pg in (("seq", layout.seq_group), ("expert", layout.expert_group),
                     ("vocab", layout.vocab_group)):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=pg)
        expected = sum(r + 1 for r in plan.group_of(kind, rank))
        assert t.item() == expected, f"{kind}: {t.item()} != {expected}"
        assert dist.get_world_size(pg) == plan.degree(kind)
        assert dist.get_rank(pg) == plan.group_rank(kind, rank)
    for kind in ("expert", "vocab"):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=getattr(layout, f"{kind}_replica_group"))
        members = [r for g in getattr(plan, f"{kind}_replica_groups") if rank in g for r in g]
        assert t.item() == sum(r + 1 for r in members)
        mesh = getattr(layout, f"{kind}_mesh")
        row = mesh.get_group(1)  # the shard dimension's group is this rank's group of that kind
        assert sorted(dist.get_process_group_ranks(row)) == list(plan.group_of(kind, rank))
        col = mesh.get_group(0)
        assert sorted(dist.get_process_group_ranks(col)) == sorted(members)
        # The dimension names in RankLayout's docs select these same groups (callers may index by name).
        names = {"expert": ("expert_replica", "ep"), "vocab": ("vocab_replica", "vocab")}[kind]
        for name, group in zip(names, (col, row)):
            assert dist.get_process_group_ranks(mesh.get_group(name)) == dist.get_process_group_ranks(group)
    assert dist.get_process_group_ranks(layout.mesh.get_group("fsdp")) == list(range(world_size))
    # Every mesh lives on the device of this rank's tensors (CPU under gloo, its GPU under NCCL).
    for mesh in (layout.mesh, layout.expert_mesh, layout.vocab_mesh):
        assert mesh.device_type == worker_device().type
    # The per-rank views agree with what the process groups themselves report.
    assert (layout.seq_rank, layout.expert_rank, layout.vocab_rank) == \
        tuple(dist.get_rank(g) for g in (layout.seq_group, layout.expert_group, layout.vocab_group))
    assert (layout.seq_size, layout.expert_size, layout.vocab_size) == \
        tuple(dist.get_world_size(g) for g in (layout.seq_group, layout.expert_group, layout.vocab_group))
    assert layout.data_rank == plan.seq_groups.index(plan.group_of("seq", rank))
    assert layout.data_size == world_size // dist.get_world_size(layout.seq_group)


@pytest.mark.slow
def test_real_groups_allreduce_inside_each_group():
    run_distributed(_groups_sum_their_members, 4, ((2, 4, 1), (4, 2, 2), (1, 1, 4)))
