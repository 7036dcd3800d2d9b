"""OffloadStreamAdamW on parameter dtypes beyond fp32 / bf16 (found 2026-12-07).

fp16 working weights are low-precision copies of fp32 masters, as bf16 ones: the update is torch's
fused AdamW on the fp32 masters, rounded once to fp16. fp64 parameters cannot keep their precision
with fp32 masters, so they are refused with a ValueError (before: updated in fp32 and rounded back,
silently ~1e-7 relative off torch.optim.AdamW's fp64 update).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mop_train.ops.offload_adamw import OffloadStreamAdamW
from tests.utils import assert_bitwise_equal, fresh_seed


def test_fp64_parameters_are_refused_naming_the_dtype():
    gen = torch.Generator().manual_seed(fresh_seed(7101))
    params = [nn.Parameter(torch.randn(5, generator=gen)),
              nn.Parameter(torch.randn(3, 7, generator=gen, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"torch\.float64 \(3, 7\).*torch\.optim\.AdamW"):
        OffloadStreamAdamW(params)


def test_fp16_parameters_are_rounded_fp32_masters():
    """fp16 weights: every step bitwise the fp32-master update (torch's fused AdamW) rounded to fp16,
    with buckets, a device head and a CPU tail cutting the parameters."""
    gen = torch.Generator().manual_seed(fresh_seed(7102))
    shapes = [(130,), (7, 65), (3,)]
    values = [torch.randn(s, generator=gen).half() for s in shapes]
    ours = [nn.Parameter(v.clone()) for v in values]
    masters = [nn.Parameter(v.float()) for v in values]
    opt = OffloadStreamAdamW(ours, lr=3e-2, weight_decay=0.1, bucket_params=64, device_fraction=0.3,
                             host_fraction=0.4)
    ref = torch.optim.AdamW(masters, lr=3e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        for p, q in zip(ours, masters):
            g = torch.randn(p.shape, generator=gen).half()
            p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, masters)):
            assert_bitwise_equal(p.detach(), q.detach().half(), name=f"step {step} param {i}")
