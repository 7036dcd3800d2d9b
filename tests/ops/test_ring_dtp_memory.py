"""Ring-DTP's memory bounds (memory.py) against what the torch path allocates, on the CPU at P = 1 and
random shapes; P > 1 is checked the same way inside the gloo ranks of test_ring_dtp.py.

`ring_dtp_largest_tensor_bytes` must be the largest storage the op allocates (fp32, and bf16 under
grad_in_forward, whose fp32 stored gradients dominate; bf16 recompute writes dW in bf16, so there its
fp32 candidate only bounds). `ring_dtp_peak_bytes` must cover the measured peak of live storages yet
stay within a small factor of it, so that a term that grows or vanishes shows.
"""

from __future__ import annotations

import torch

from mop_train.ops.ring_dtp import resolve_mode
from tests.ops.test_ring_dtp import _allocated, _check_bounds
from tests.utils import fresh_seed


def test_bounds_against_what_the_cpu_path_allocates():
    gen = torch.Generator().manual_seed(fresh_seed(61))
    for case in range(3):
        n, hidden, vocab, block = (int(torch.randint(lo, hi, (1,), generator=gen))
                                   for lo, hi in ((1, 80), (4, 24), (4, 80), (2, 24)))
        # even H: bf16 dX borrows dW's rows only when a row holds whole fp32 words; H >= 4: dX [N, H]
        # outweighs the stats [3, N], so the largest bound is a tensor that is allocated
        hidden += hidden % 2
        for dtype in (torch.float32, torch.bfloat16):
            for schedule in ("recompute", "grad_in_forward"):
                chunk = int(torch.randint(1, n + 1, (1,), generator=gen)) if schedule == "grad_in_forward" else None
                call = dict(block_size=block, impl="torch", schedule=schedule, token_chunk=chunk)
                seen = _allocated(0, None, [n], vocab, hidden, dtype, fresh_seed(case), "cpu", **call)
                exact = dtype == torch.float32 or schedule == "grad_in_forward"
                _check_bounds(seen, n, hidden, vocab, 1, dtype, n, exact=exact, slack=4.0, **call)


def test_auto_mode_switches_at_the_ceil_shard_size():
    """'auto' moves the weights exactly when N_max exceeds a shard's rows, ceil(V/P): at V not a
    multiple of P the edge sits on the rounded-up count (V/P itself would switch one token early)."""
    gen = torch.Generator().manual_seed(fresh_seed(67))
    for _ in range(8):
        p = int(torch.randint(2, 9, (1,), generator=gen))
        vocab = p * int(torch.randint(1, 1000, (1,), generator=gen)) + int(torch.randint(1, p, (1,), generator=gen))
        shard_rows = len(torch.arange(vocab).chunk(p)[0])                # torch.chunk's first (largest) shard
        assert resolve_mode("auto", shard_rows, vocab, p) == "move_activations", (vocab, p)
        assert resolve_mode("auto", shard_rows + 1, vocab, p) == "move_weights", (vocab, p)
