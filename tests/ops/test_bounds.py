"""Every operator's bound has the one shape the plan sums (mop_train.ops.bound): `device_bound(settings,
shapes) -> DeviceBound`, whose bytes are the operator's own counts, checked here on random sizes."""

from __future__ import annotations

import random

import pytest
import torch

from mop_train.ops.bound import DeviceBound
from mop_train.ops.moe_dispatch import PipelinedLLEPOptions
from mop_train.ops.moe_dispatch import memory as dispatch_memory
from mop_train.ops.offload_adamw import memory as offload_memory
from mop_train.ops.offload_adamw import staging_bytes_bound
from mop_train.ops.ring_dtp import memory as ring_memory
from mop_train.ops.sco import budget as sco_memory
from tests.utils import fresh_seed


def test_a_bound_is_never_negative():
    with pytest.raises(ValueError, match="saved=-1"):
        DeviceBound(-1, 0, "broken")
    assert DeviceBound(3, 4, "x").device_bytes == 7


def test_sco_keeps_what_does_not_fit_and_fetches_two_of_the_rest():
    rng = random.Random(fresh_seed(5120))
    for _ in range(50):
        sizes = [rng.randint(0, 1000) for _ in range(rng.randint(0, 12))]
        budget = rng.randint(0, 6000)
        bound = sco_memory.device_bound(budget, sizes)
        # greedy in forward order: a boundary goes to the host while the budget holds it
        used, offloaded = 0, []
        for i, b in enumerate(sizes):
            if b and used + b <= budget:
                used += b
                offloaded.append(i)
        assert bound.saved == sum(b for i, b in enumerate(sizes) if i not in offloaded)
        assert bound.working == min(len(offloaded), 2) * max((sizes[i] for i in offloaded), default=0)


def test_offload_adamw_is_its_staging_plus_its_device_share():
    rng = random.Random(fresh_seed(5121))
    for _ in range(20):
        bucket, slots, host = rng.randint(1, 10**6), rng.randint(1, 4), rng.random() < 0.5
        fraction, numel, fp32 = rng.random(), rng.randint(0, 10**8), rng.random() < 0.5
        bound = offload_memory.device_bound(offload_memory.OffloadSettings(bucket, slots, host, fraction), numel,
                                            fp32_weights=fp32)
        assert bound.working == staging_bytes_bound(bucket, slots, host)
        assert bound.saved == round(fraction * numel) * (8 if fp32 else 12)


def test_ring_dtp_is_its_peak_while_the_loss_runs():
    rng = random.Random(fresh_seed(5122))
    for _ in range(20):
        n, h, v, p = rng.randint(1, 5000), rng.randint(8, 512), rng.randint(100, 50_000), rng.randint(1, 8)
        schedule, dtype = rng.choice(("recompute", "grad_in_forward")), rng.choice((torch.bfloat16, torch.float32))
        settings = ring_memory.RingDTPSettings(schedule=schedule, block_size=rng.choice((256, 8192)))
        bound = ring_memory.device_bound(settings, ring_memory.VocabShapes(n, h, v, p, dtype))
        assert bound.saved == 0
        assert bound.working == ring_memory.ring_dtp_peak_bytes(n, h, v, p, dtype=dtype, schedule=schedule,
                                                                block_size=settings.block_size)


def test_pipelined_llep_saves_rows_and_works_on_one_chunk():
    rng = random.Random(fresh_seed(5123))
    shapes = dispatch_memory.RoutedShapes(tokens=rng.randint(1000, 50_000), hidden=rng.randint(8, 256),
                                          inter=rng.randint(8, 256), top_k=rng.randint(1, 8),
                                          group_size=rng.randint(1, 8), local_experts=rng.randint(1, 8), act_bytes=2)
    bound = dispatch_memory.device_bound(PipelinedLLEPOptions(token_budget=512), shapes)
    assert bound.saved == shapes.tokens * shapes.top_k * (shapes.hidden * 2 + dispatch_memory.route_index_bytes(shapes.group_size))
    # one chunk recomputed in backward (its exact count: tests/ops/test_moe_dispatch_memory.py)
    assert bound.working >= shapes.local_experts * shapes.inter * shapes.hidden * 2
    assert bound.how.startswith("pipelined_llep")


def test_tiled_swiglu_saves_nothing_and_holds_one_tile():
    from mop_train.ops.tiling import memory as tiling_memory

    rng = random.Random(fresh_seed(5124))
    for _ in range(30):
        n, h, f, act = rng.randint(1, 10**6), rng.randint(8, 4096), rng.randint(8, 8192), rng.choice((2, 4))
        tile = rng.randint(1, 2 * n)
        shapes = tiling_memory.SwiGLUShapes(n, h, f, act)
        bound = tiling_memory.device_bound(tile, shapes)
        if tile >= n:                                          # one tile: the plain path, as untiled
            assert bound == tiling_memory.device_bound(0, shapes)
            assert (bound.saved, bound.working) == (4 * n * f * act, 2 * n * f * act)
            continue
        largest = tiling_memory.largest_tile(n, tile)
        assert largest <= tile and bound.saved == 0
        assert bound.working == (n * h * act + largest * (8 * f + 2 * h) * act
                                 + 4 * 4 * f * h + (0 if act == 4 else 3 * f * h * act))
