"""The CPU storage census (mop_train.train.census): exact byte counts, and its fp32 GEMM stand-in.

- the census counts exactly the bytes of what autograd, FSDP2-style resize_ and Python allocate and
  free (random sizes), and its fp32 stand-in for bf16 GEMMs keeps each op's output dtype and shape;
"""

from __future__ import annotations

import torch

from tests.utils import fresh_seed


def test_census_counts_what_is_allocated_and_freed():
    from mop_train.train.census import StorageCensus

    g = torch.Generator().manual_seed(fresh_seed(3601))
    n, h, o = (int(v) for v in torch.randint(8, 300, (3,), generator=g))
    lin = torch.nn.Linear(h, o)
    with StorageCensus() as census:
        x = torch.randn(n, h, generator=g, requires_grad=True)
        y = lin(x).relu()                                      # saved: y (relu's output); addmm's freed
        assert census.total == 4 * (n * h + n * o)
        y.sum().backward()
        grads = 4 * (n * h + o * h + o)                        # x.grad, W.grad, b.grad
        assert census.total == 4 * (n * h + n * o) + grads
        del y
        assert census.total == 4 * n * h + grads
        s = torch.empty(0).untyped_storage()
        s.resize_(4 * n)                                       # FSDP2's way of (un)allocating
        assert census.total == 4 * n * h + grads + 4 * n
        s.resize_(0)
        assert census.total == 4 * n * h + grads
        assert census.peak_bytes >= 4 * (n * h + n * o) + grads


def test_fp32_gemms_keep_dtypes_shapes_and_values():
    from mop_train.train.census import StorageCensus

    g = torch.Generator().manual_seed(fresh_seed(3602))
    a, b = (torch.randn(s, generator=g).bfloat16() for s in ((7, 33), (33, 5)))
    c = torch.randn(7, 5, generator=g).bfloat16()
    ref = a.float() @ b.float()
    with StorageCensus(fp32_gemms=True) as census:
        y = a @ b
        assert y.dtype == torch.bfloat16 and y.shape == (7, 5) and census.total == 7 * 5 * 2
        out = torch.empty(7, 5, dtype=torch.bfloat16)
        torch.mm(a, b, out=out)
        d = c.clone()
        d.addmm_(a, b)
        z = torch.bmm(a.unsqueeze(0), b.unsqueeze(0))
    for got, want in ((y, ref), (out, ref), (d, c.float() + ref), (z[0], ref)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.bfloat16().float(), atol=0.05, rtol=0.02)
