"""Where OffloadStreamAdamW cuts its flat state (buckets, the device share's end, the CPU share's start), and
why it matters on CPU: torch's fused AdamW rounds an element by its place in the vector lanes of its piece,
so the cuts fall on lane boundaries of their parameter (buckets.PIECE_ALIGN) and the settings that move
them give the same bits. Found at W=3, where FSDP2's shards are uneven: a device share of 0.5 differed from
none in the last bit of a few moments at step 2."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mop_train.ops.offload_adamw import OffloadStreamAdamW
from mop_train.ops.offload_adamw.buckets import PIECE_ALIGN, aligned_cut, device_cut, param_offsets, plan_buckets
from mop_train.ops.offload_adamw.host_update import host_cut
from tests.utils import assert_bitwise_equal, fresh_seed

SHAPES = [(37, 111), (7,), (1025,), (), (0, 3), (64, 9), (4099,), (13, 5)]
"""Sizes that are not multiples of any lane width, beside empty, scalar and aligned ones."""


def _brute_cut(numels, flat, align):
    for offset, n in zip(param_offsets(numels), numels):
        if offset <= flat < offset + n:
            return flat - (flat - offset) % align
    return flat


def test_every_cut_inside_a_parameter_is_on_its_lanes():
    gen = torch.Generator().manual_seed(fresh_seed(1))
    rand = lambda hi: int(torch.randint(0, hi, (1,), generator=gen))  # noqa: E731
    for _ in range(300):
        numels = [rand(300) if rand(4) else 0 for _ in range(1 + rand(6))]
        offsets, total = param_offsets(numels), sum(numels)
        align = (1, 16, PIECE_ALIGN)[rand(3)]
        for flat in range(total + 1):
            assert aligned_cut(offsets, numels, flat, align) == _brute_cut(numels, flat, align)
        start = rand(total + 1)
        end = start + rand(total - start + 1)
        bucket = 1 + rand(3 * align)
        buckets = plan_buckets(numels, bucket, start, end, align=align)
        assert sum(b.numel for b in buckets) == end - start and [b.start for b in buckets][:1] in ([start], [])
        for b, after in zip(buckets, buckets[1:]):
            assert after.start == b.start + b.numel
            assert (b.numel == bucket) if bucket < align else (bucket - align < b.numel <= bucket)
            cut = after.start   # inside a parameter only on a lane of it (buckets smaller than a lane cut anywhere)
            assert bucket < align or aligned_cut(offsets, numels, cut, align) == cut, (numels, bucket, align, cut)
        for b in buckets:
            assert sum(seg.numel for seg in b.segments) == b.numel
    numels = [100, 300]
    assert device_cut(numels, 0.5) == 100 + 64 and device_cut(numels, 0.5, align=1) == 200
    assert host_cut(numels, 0, 0.25) == 100 + 192 and host_cut(numels, 164, 0.5, align=1) == 282


def _params(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _run(dtype, seed, steps=4, **kwargs):
    params = _params(seed, dtype)
    opt = OffloadStreamAdamW(params, lr=3e-2, betas=(0.9, 0.99), weight_decay=0.1, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 10.0 ** float(torch.randint(-4, 1, (1,), generator=gen))
                      ).to(dtype)
        opt.step()
    state = opt.state_dict()["state"]
    return [(p.detach().clone(), {k: v.clone() for k, v in state[i].items()}) for i, p in enumerate(params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buckets_and_shares_do_not_change_the_bits_on_cpu(dtype):
    """Every bucket size, device share and CPU share gives the bits of one whole-tensor update per
    parameter (one bucket holding everything), on CPU, for fp32 and bf16 working weights."""
    seed = fresh_seed(7)
    whole = _run(dtype, seed, bucket_params=1 << 20)
    settings = [dict(bucket_params=b, device_fraction=d, host_fraction=f)
                for b, d, f in itertools.product((64, 100, 1000), (0.0, 0.37, 0.5), (0.0, 0.3))]
    for kwargs in settings:
        for i, ((p, state), (q, ref)) in enumerate(zip(_run(dtype, seed, **kwargs), whole)):
            assert_bitwise_equal(p, q, name=f"{kwargs} param {i}")
            for key in ref:
                assert_bitwise_equal(state[key], ref[key], name=f"{kwargs} param {i} {key}")


def test_piece_align_is_checked():
    for bad in (0, -64, 1.5, True, "64"):
        with pytest.raises(ValueError, match="piece_align"):
            OffloadStreamAdamW([nn.Parameter(torch.randn(3))], piece_align=bad)
