"""Ring-DTP under bf16 mixed precision: bf16 activations with the fp32 master shard of the projection
(the shard is kept out of FSDP2, so Ring-DTP itself casts it, as FSDP2 casts its own parameters).

The products must be exactly those of a call on the bf16-cast shard (same loss and dX, bitwise),
while dW comes back in fp32 straight from the fp32 accumulator: rounding it to bf16 gives the bf16
call's dW bitwise, and over a ring (P > 1) it holds bits bf16 cannot. Both schedules (recompute in
both modes; grad_in_forward, which moves activations, in chunks of 3 tokens). P = 1 (group None, the
single-device path: no process group, so in this process) and a gloo ring of P = 3, uneven N with an
empty rank.
"""

import torch

from mop_train.ops.ring_dtp import ring_dtp_cross_entropy
from tests.dist_utils import run_distributed
from tests.utils import fresh_seed

COUNTS = {1: [9], 2: [7, 4], 3: [5, 0, 8]}
VOCAB, HIDDEN = 29, 16


def _call(x, w, t, group, mode, schedule):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    chunk = 3 if schedule == "grad_in_forward" else None
    loss = ring_dtp_cross_entropy(x, w, t, group, vocab_size=VOCAB, mode=mode, reduction="sum", block_size=5,
                                  schedule=schedule, token_chunk=chunk)
    loss.backward(torch.tensor(0.75))
    return loss.detach(), x.grad, w.grad


def _cases(rank, world_size, seed):
    group = torch.distributed.new_group(list(range(world_size))) if world_size > 1 else None
    counts = COUNTS[world_size]
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(VOCAB, HIDDEN, generator=gen) * 2 / HIDDEN ** 0.5      # fp32, [V, H]
    xs = [(torch.randn(n, HIDDEN, generator=gen) * 2).bfloat16() for n in counts]
    ts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in counts]
    rows = -(-VOCAB // world_size)
    lo, hi = min(VOCAB, rank * rows), min(VOCAB, (rank + 1) * rows)
    x, t, shard = xs[rank], ts[rank], master[lo:hi]
    for mode, schedule in (("move_activations", "recompute"), ("move_weights", "recompute"),
                           ("move_activations", "grad_in_forward")):
        tag = f"P={world_size} rank={rank} {mode} {schedule}"
        loss, dx, dw = _call(x, shard, t, group, mode, schedule)                    # fp32 master, cast inside
        loss_b, dx_b, dw_b = _call(x, shard.bfloat16(), t, group, mode, schedule)   # bf16 weight, as before
        assert dw.dtype == torch.float32 and dx.dtype == torch.bfloat16, f"{tag}: {dw.dtype} {dx.dtype}"
        assert torch.equal(loss, loss_b), f"{tag}: loss {loss} != bf16-weight loss {loss_b}"
        assert torch.equal(dx, dx_b), f"{tag}: dX differs from the bf16-weight call"
        assert torch.equal(dw.bfloat16(), dw_b), f"{tag}: dW rounded to bf16 differs from the bf16-weight dW"
        if world_size > 1:
            # Over a ring, dW sums every rank's bf16 partial products in fp32: handed back in fp32,
            # it keeps bits that a bf16 round trip would drop.
            assert not torch.equal(dw, dw.bfloat16().float()), f"{tag}: dW went through bf16"


def test_fp32_master_shard_with_bf16_activations():
    # P = 1 passes group=None and needs no process group: run here, no spawn. No ring of 2: its single
    # round runs the same ring code as P = 3's two rounds (which also has a rank with no tokens and the
    # fp32 accumulation over more than one received partial product); spawning costs seconds per rank.
    _cases(0, 1, fresh_seed(7101))
    run_distributed(_cases, 3, fresh_seed(7103))
