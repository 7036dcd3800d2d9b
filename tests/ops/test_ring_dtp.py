"""Ring-DTP against the full-logits reference: loss, dX and every shard's dW, both schedules
(recompute, grad_in_forward), at P = 1..4 on gloo (impl="torch"; P = 2 as two rings inside a world of 4)
and at P = 2 on NCCL (impl="triton", marked gpu). The ways of calling a loss (autocast, no_grad, two
calls, ...) are in test_ring_dtp_calls.py.

Every rank rebuilds the whole problem (all ranks' tokens, the full weight) from one fresh seed, runs
the ring op on its own part, and checks it against a single-process reference over the full data.
fp32: relative 1e-5 (of the reference's largest magnitude; TF32 off on CUDA). bf16: our rms and max
errors against an fp32 ground truth (same bf16-rounded inputs) are no worse than PyTorch's own bf16
errors against it, up to 1.25x (rms) / 2x (max, a noisy statistic on tiny tensors) plus 0.2% / 0.4% of
the scale (tests.utils.assert_no_worse_than_torch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from mop_train.ops.ring_dtp import (reference_cross_entropy, reference_ring_dtp_cross_entropy, resolve_mode,
                                    ring_dtp_cross_entropy, ring_dtp_largest_tensor_bytes, ring_dtp_peak_bytes)
from tests.dist_utils import backend_params, run_distributed, worker_device
from tests.utils import AllocatedBytes, assert_close, assert_no_worse_than_torch, fresh_seed

MODES = ("move_activations", "move_weights", "auto")
REDUCTIONS = ("mean", "sum", "none")
COUNTS = {1: [6], 2: [7, 0], 3: [5, 0, 8], 4: [6, 3, 0, 9]}  # uneven N, one rank with none


def _problem(seed, counts, vocab, hidden, dtype, device="cpu", logit_scale=1.0):
    """All ranks' tokens, targets (some ignored), upstream gradients (per token; a scalar loss takes
    its rank's first, or with `_SHARED` one for all ranks), and the full weight, drawn on the CPU (the
    same numbers whatever the device) and moved to `device`. logit_scale multiplies the tokens: at
    100 the logits reach the hundreds, where exp overflows fp32 unless the log-sum-exp is shifted by
    the running maximum."""
    gen = torch.Generator().manual_seed(fresh_seed(seed))
    weight = (torch.randn(vocab, hidden, generator=gen) * 2 / hidden ** 0.5).to(dtype)
    xs, ts, gouts = [], [], []
    for n in counts:
        xs.append((torch.randn(n, hidden, generator=gen) * 2 * logit_scale).to(dtype))
        t = torch.randint(0, vocab, (n,), generator=gen)
        t[torch.rand(n, generator=gen) < 0.2] = -100
        ts.append(t)
        gouts.append(torch.rand(n, generator=gen) + 0.5)
    to = lambda ts_: [t.to(device) for t in ts_]  # noqa: E731
    return weight.to(device), to(xs), to(ts), to(gouts)


_SHARED = 0.8125  # grad_in_forward's scalar upstream: one value on every rank (its contract)


def _reference(weight, xs, ts, gouts, reduction, shared=False):
    """Losses of every rank and gradients of every rank's X and of the full W, in one process."""
    w = weight.clone().requires_grad_()
    xs = [x.clone().requires_grad_() for x in xs]
    losses = [reference_cross_entropy(x, w, t, reduction=reduction) for x, t in zip(xs, ts)]
    total = sum((l.float() * _upstream(l, g, shared)).nansum() for l, g in zip(losses, gouts))
    total.backward()
    return [l.detach().float() for l in losses], [x.grad for x in xs], w.grad


def _upstream(loss, gout, shared=False):
    if loss.dim() == 1:
        return gout
    if shared:
        return gout.new_tensor(_SHARED)
    return gout[:1].sum() if len(gout) else gout.new_tensor(1.0)


def _shared(kw) -> bool:
    return kw.get("schedule") in ("grad_in_forward", "auto")


def _ours(rank, group, weight, xs, ts, gouts, vocab, **kw):
    shard_rows = -(-vocab // max(1, len(xs)))
    lo, hi = min(vocab, rank * shard_rows), min(vocab, (rank + 1) * shard_rows)
    w = weight[lo:hi].clone().requires_grad_()
    x = xs[rank].clone().requires_grad_()
    loss = ring_dtp_cross_entropy(x, w, ts[rank], group, vocab_size=vocab, **kw)
    if loss.dim() == 0 and torch.isnan(loss):
        loss.backward(loss.new_zeros(()))  # mean over no valid token: nan, as PyTorch; nothing flows
    else:
        loss.backward(_upstream(loss, gouts[rank], _shared(kw)))
    return loss.detach(), x.grad, w.grad, (lo, hi)


def _term_scales(weight, xs, ts, gouts, reduction, rank, shared):
    """Largest sums of |terms| behind one element of dX (this rank) and of dW (all tokens): a gradient
    element is such a sum, and fp32 sums in another order differ by ulps of the terms, not of the
    (possibly cancelled) result; fp32 gradients are judged relative to these."""
    grads = []
    for x, t, g in zip(xs, ts, gouts):
        p = torch.softmax((x @ weight.t()).double(), dim=1)                 # [N, V]
        valid = t != -100
        p[valid.nonzero().squeeze(1), t[valid]] -= 1.0
        up = _upstream(torch.zeros(()) if reduction != "none" else g, g, shared).double()
        up = up / max(1, int(valid.sum())) if reduction == "mean" else up
        grads.append((p * valid[:, None] * (up[:, None] if up.dim() else up)).abs())
    term_dx = (grads[rank] @ weight.double().abs()).max().item() if len(xs[rank]) else 0.0
    term_dw = sum(gr.t() @ x.double().abs() for gr, x in zip(grads, xs)).max().item()
    return term_dx, term_dw


def _logit_rounding(weight, xs):
    """Largest error of PyTorch's fp32 logits against fp64 over every rank's tokens (0 when small)."""
    errs = [((x.float() @ weight.float().t()).double() - x.double() @ weight.double().t()).abs().max().item()
            for x in xs if len(x)]
    return max(errs, default=0.0)


def _scale(t):
    """Largest magnitude of a reference tensor: fp32 tolerances are relative to it."""
    return t.abs().max().item() if t.numel() else 0.0


def _errors(a, b):
    """(rms, max) absolute error of a against b."""
    if a.numel() == 0:
        return 0.0, 0.0
    diff = (a.float() - b.float()).abs()
    return diff.pow(2).mean().sqrt().item(), diff.max().item()


def _check_case(rank, group, counts, vocab, hidden, dtype, reduction, seed, device="cpu", logit_scale=1.0, **kw):
    weight, xs, ts, gouts = _problem(seed, counts, vocab, hidden, dtype, device, logit_scale)
    loss, dx, dw, (lo, hi) = _ours(rank, group, weight, xs, ts, gouts, vocab, reduction=reduction, **kw)
    tag = f"P={len(counts)} rank={rank} {dtype} {reduction} {kw}"
    if dtype == torch.float32:
        ref_loss, ref_dx, ref_dw = _reference(weight, xs, ts, gouts, reduction, _shared(kw))
        # A logit rounded by delta moves its probability by a factor e^delta: with logits in the hundreds
        # two correct fp32 matmuls may round them apart by more than 1e-5 (PyTorch's own fp32 error).
        tol = max(1e-5, 4 * _logit_rounding(weight, xs))
        # A token's loss is lse - z_target, a difference of two numbers of the logits' size, so its fp32
        # error is set by the logits, however small the loss (a confident token's is ~1e-4); a sum adds
        # one such error per token. Each probability carries that error relatively (dp = p dz, and the
        # p sum to 1): a token's dX row is off by up to per_token * max|W| * |upstream|, a dW row by
        # per_token * sum|x| * |upstream|.
        live = [x.double() for x in xs if len(x)]
        z_max = max(((x @ weight.double().t()).abs().max().item() for x in live), default=0.0)
        per_token = 2 * _logit_rounding(weight, xs) + 4 * torch.finfo(torch.float32).eps * z_max
        up = max((g.abs().max().item() for g in gouts if g.numel()), default=0.0)
        x_sum = sum(x.abs().sum(0) for x in live).max().item() if live else 0.0
        if torch.isnan(ref_loss[rank]).all() and ref_loss[rank].numel():
            assert torch.isnan(loss).all(), f"{tag}: expected nan loss (no valid token), got {loss}"
        else:
            tokens = sum(len(t) for t in ts) if reduction == "sum" else 1
            assert_close(loss, ref_loss[rank], rtol=tol, atol=tol * _scale(ref_loss[rank]) + per_token * tokens,
                         name=f"loss {tag}")
        term_dx, term_dw = _term_scales(weight, xs, ts, gouts, reduction, rank, _shared(kw))
        dx_atol = tol * max(term_dx, _scale(ref_dx[rank])) + per_token * weight.abs().max().item() * up
        dw_atol = tol * max(term_dw, _scale(ref_dw[lo:hi])) + per_token * x_sum * up
        assert_close(dx, ref_dx[rank], rtol=tol, atol=dx_atol, name=f"dX {tag}")
        assert_close(dw, ref_dw[lo:hi], rtol=tol, atol=dw_atol, name=f"dW {tag}")
        return
    truth = _reference(weight.float(), [x.float() for x in xs], ts, gouts, reduction, _shared(kw))
    torch_bf16 = _reference(weight, xs, ts, gouts, reduction, _shared(kw))
    # bf16 is judged on the whole problem (every rank's losses and dX, the full dW, gathered), against
    # PyTorch's bf16 error on the same: one rank's few tokens or rows make either error a matter of luck.
    # A per-token loss also carries the bf16 rounding of its target logit, and two correct bf16
    # matmuls may round it one ulp apart, so the loss may be off by that ulp; a sum adds one such ulp
    # per token (as the fp32 branch's per_token * tokens), which PyTorch's rounding of the sum to bf16
    # can hide by luck (seed 950145393: ours 0.083 off at 39.5 with 6 tokens, PyTorch 0.017).
    # Gathered and compared on the CPU: a pickled CUDA tensor would unpickle onto its sender's GPU.
    mine = [None] * len(counts)
    if len(counts) > 1:
        torch.distributed.all_gather_object(mine, (loss.cpu(), dx.cpu(), dw.cpu()), group=group)
    else:
        mine = [(loss, dx, dw)]
    logit_ulp = 2.0 ** -7 * max((x.float() @ weight.float().t()).abs().max().item() if len(x) else 0.0 for x in xs)
    loss_slack = logit_ulp * (sum(int((t != -100).sum()) for t in ts) if reduction == "sum" else 1)
    flat = lambda ts_: torch.cat([t.reshape(-1).float().cpu() for t in ts_])  # noqa: E731
    pieces = {"loss": (flat([m[0] for m in mine]), flat(torch_bf16[0]), flat(truth[0])),
              "dX": (flat([m[1] for m in mine]), flat(torch_bf16[1]), flat(truth[1])),
              "dW": (flat([m[2] for m in mine]), flat([torch_bf16[2]]), flat([truth[2]]))}
    for name, (ours, theirs, true) in pieces.items():
        keep = ~torch.isnan(true)  # mean over a rank with no valid token: nan, as PyTorch
        assert torch.isnan(ours[~keep]).all(), f"{tag}: expected nan {name} where PyTorch's is nan"
        assert_no_worse_than_torch(ours[keep], theirs[keep], true[keep], name=f"{name} {tag} (whole problem)",
                                   slack=loss_slack if name == "loss" else 0.0)


def _ring_cases(rank, world_size, seed):
    """Every mode x dtype x reduction; under NCCL with the Triton block kernels the op uses on CUDA."""
    group = torch.distributed.new_group(list(range(world_size)))  # a subgroup, as the layout builds
    _ring_suite(rank, group, world_size, seed)


def _ring_suite(rank, group, world_size, seed):
    """_ring_cases on `group` (world_size ranks, this one at `rank`): also run on rings inside a world."""
    counts = COUNTS[world_size]
    device = worker_device()
    impl = "triton" if device.type == "cuda" else "torch"
    case = 0
    for mode in MODES:
        for dtype in (torch.float32, torch.bfloat16):
            for reduction in REDUCTIONS:
                case += 1
                _check_case(rank, group, counts, 37, 16, dtype, reduction, seed + case, device, mode=mode,
                            block_size=4, impl=impl)
        # tiny vocabulary: trailing shards shorter or empty (V=5 at P=4: 2, 2, 1, 0 rows)
        case += 1
        _check_case(rank, group, counts, 5, 8, torch.float32, "sum", seed + case, device, mode=mode,
                    block_size=1, impl=impl)
    # grad_in_forward (moves activations: mode auto), sum and mean; several chunks per rank, and one
    gif = dict(schedule="grad_in_forward", block_size=4, impl=impl)
    for dtype in (torch.float32, torch.bfloat16):
        for reduction, chunk in (("sum", 2), ("mean", None)):
            case += 1
            _check_case(rank, group, counts, 37, 16, dtype, reduction, seed + case, device, token_chunk=chunk, **gif)
    for mode, chunk in (("move_activations", 1), ("auto", 64)):
        case += 1
        _check_case(rank, group, counts, 5, 8, torch.float32, "mean", seed + case, device, mode=mode,
                    token_chunk=chunk, **dict(gif, block_size=1))
    # logits in the hundreds: every schedule's log-sum-exp (local and across ranks) shifts by the maximum
    for kw in (dict(mode="move_activations"), dict(mode="move_weights"), dict(schedule="grad_in_forward", token_chunk=2)):
        case += 1
        _check_case(rank, group, counts, 37, 16, torch.float32, "sum", seed + case, device, logit_scale=100.0,
                    block_size=4, impl=impl, **kw)
    # impl="reference": the gathered-shards full-logits path behind the same signature
    _check_case(rank, group, counts, 37, 16, torch.float32, "none", seed + case + 1, device, impl="reference")
    # the op forms nothing near N x V: what it allocates against both bounds, on random shapes
    gen = torch.Generator().manual_seed(seed)                          # the same shapes on every rank
    for mode, schedule in (("move_activations", "recompute"), ("move_weights", "recompute"),
                           ("auto", "grad_in_forward")):
        hidden, vocab, block = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((3, 20), (20, 120), (2, 12)))
        chunk = int(torch.randint(1, 6, (1,), generator=gen)) if schedule == "grad_in_forward" else None
        call = dict(mode=mode, block_size=block, impl=impl, schedule=schedule, token_chunk=chunk)
        seen = _allocated(rank, group, counts, vocab, hidden, torch.float32, seed, device, **call)
        _check_bounds(seen, counts[rank], hidden, vocab, world_size, torch.float32, max(counts), exact=False,
                      slack=6.0, **call)  # uneven shards: a short one allocates below the bound


def _allocated(rank, group, counts, vocab, hidden, dtype, seed, device, **kw):
    """What one forward + backward allocates on this rank beyond its inputs (AllocatedBytes)."""
    weight, xs, ts, gouts = _problem(seed, counts, vocab, hidden, dtype, device)
    shard_rows = -(-vocab // len(counts))
    w = weight[min(vocab, rank * shard_rows):min(vocab, (rank + 1) * shard_rows)].clone().requires_grad_()
    x = xs[rank].clone().requires_grad_()
    with AllocatedBytes() as seen:
        loss = ring_dtp_cross_entropy(x, w, ts[rank], group, vocab_size=vocab, reduction="sum", **kw)
        loss.backward(_upstream(loss, gouts[rank], _shared(kw)))
        del loss
    return seen


def _check_bounds(seen, n, hidden, vocab, p, dtype, n_max, *, exact, slack, **kw):
    """largest: the bound is the largest tensor (exact=True: it is allocated); peak: the bound covers
    the measured peak and stays within `slack` times it (it sums terms never all alive at once: up to
    ~3x at P = 1, ~4x on a ring's small shapes), so that a term that grows or vanishes shows."""
    tag = f"N={n} H={hidden} V={vocab} P={p} {dtype} {kw}"
    largest = ring_dtp_largest_tensor_bytes(n, hidden, vocab, p, dtype=dtype, n_max=n_max, **kw)
    peak = ring_dtp_peak_bytes(n, hidden, vocab, p, dtype=dtype, n_max=n_max, **kw)
    assert seen.largest == largest if exact else seen.largest <= largest, f"{tag}: largest {seen.largest} B, bound {largest} B"
    assert seen.peak <= peak <= slack * seen.peak, f"{tag}: peak {seen.peak} B, bound {peak} B"


def _two_vocab_groups(rank, world_size, seed):
    """Two rings of 2 inside a world of 4 (as a layout with D = 2 builds them): every collective must
    stay in its own ring; one that falls back to the default group mixes the two problems. Each ring
    also runs the whole P = 2 suite (_ring_suite: every mode, dtype, reduction, schedule, bound), so a
    world of 2 of its own is not spawned (a ring of 2 is the same code as a subgroup or as the world)."""
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]  # all ranks create both
    group, member = groups[rank // 2], rank % 2
    seed = seed + 100 * (rank // 2)                                  # a different problem in each ring
    _ring_suite(member, group, 2, seed + 1000)
    for case, kw in enumerate((dict(mode="move_activations"), dict(mode="move_weights"),
                               dict(schedule="grad_in_forward", token_chunk=2), dict(impl="reference"))):
        kw = {"block_size": 4, "impl": "torch", **kw}
        _check_case(member, group, [7, 4], 37, 16, torch.float32, "none" if kw["impl"] == "reference" else "sum",
                    seed + case, **kw)
    _inputs_in_another_dtype(member, group, [5, 3], seed + 50)


def _inputs_in_another_dtype(rank, group, counts, seed):
    """The bound with inputs not in the compute dtype (bf16): an fp32 shard (the vocab shard kept out of
    FSDP2 under bf16 mixed precision) and fp32 hidden states under autocast. Sized so that the shard's
    casts are a large part of the peak: leaving them out of the bound fails this."""
    vocab, hidden = 2048, 256
    weight, xs, ts, _ = _problem(seed, counts, vocab, hidden, torch.float32)
    shard_rows = -(-vocab // len(counts))
    lo, hi = min(vocab, rank * shard_rows), min(vocab, (rank + 1) * shard_rows)
    for schedule in ("recompute", "grad_in_forward"):
        for hidden_dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
            x = xs[rank].detach().to(hidden_dtype).requires_grad_()
            w = weight[lo:hi].clone().requires_grad_()
            with AllocatedBytes() as seen:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = ring_dtp_cross_entropy(x, w, ts[rank], group, vocab_size=vocab, reduction="sum",
                                                  schedule=schedule, impl="torch", block_size=512)
                loss.backward(loss.new_tensor(_SHARED))
                del loss
            assert x.grad.dtype == hidden_dtype and w.grad.dtype == torch.float32
            bound = ring_dtp_peak_bytes(counts[rank], hidden, vocab, len(counts), dtype=torch.bfloat16,
                                        n_max=max(counts), impl="torch", schedule=schedule, block_size=512,
                                        hidden_dtype=hidden_dtype, weight_dtype=torch.float32)
            tag = f"P={len(counts)} rank={rank} {schedule} hidden {hidden_dtype}, fp32 shard"
            assert seen.peak <= bound <= 6.0 * seen.peak, f"{tag}: peak {seen.peak} B, bound {bound} B"


@pytest.mark.slow
def test_rings_inside_a_larger_world():
    run_distributed(_two_vocab_groups, 4, fresh_seed(2400))



@pytest.mark.slow
# No gloo world of 2: test_rings_inside_a_larger_world runs the whole P = 2 suite on its two rings of 2
# (a spawn costs seconds per rank, more than the suite). NCCL stays at 2 GPUs.
@pytest.mark.parametrize("backend,world_size", backend_params([1, 3, 4]))
def test_ring_matches_full_logits_reference(backend, world_size):
    run_distributed(_ring_cases, world_size, fresh_seed(1000 * world_size), backend=backend)


def test_single_device_path_and_largest_block():
    """group=None is the fused single-device path; its largest allocation stays within the bound."""
    seed = fresh_seed(17)
    for dtype in (torch.float32, torch.bfloat16):
        for schedule in ("recompute", "grad_in_forward"):
            _check_case(0, None, [11], 41, 12, dtype, "mean", seed, block_size=6, impl="torch", schedule=schedule,
                        token_chunk=4 if schedule == "grad_in_forward" else None)
    _inputs_in_another_dtype(0, None, [9], seed + 1)
    for schedule in ("recompute", "grad_in_forward"):                 # logits in the hundreds
        _check_case(0, None, [11], 41, 12, torch.float32, "sum", seed, block_size=6, impl="torch", schedule=schedule,
                    logit_scale=100.0)
    weight, xs, ts, gouts = _problem(seed, [13], 101, 8, torch.float32)
    for reduction, schedule in (("none", "recompute"), ("sum", "grad_in_forward")):
        with AllocatedBytes() as seen:
            _ours(0, None, weight, xs, ts, gouts, 101, reduction=reduction, block_size=8, impl="torch",
                  schedule=schedule, token_chunk=2 if schedule == "grad_in_forward" else None)
        bound = ring_dtp_largest_tensor_bytes(13, 8, 101, 1, dtype=torch.float32, block_size=8, impl="torch",
                                              schedule=schedule, token_chunk=2)
        assert seen.largest <= bound < 13 * 101 * 4, (schedule, seen.largest, bound)  # below full logits


def test_auto_mode_and_bound_arithmetic():
    assert resolve_mode("auto", n_max=25_001, vocab_size=200_000, group_size=8) == "move_weights"
    assert resolve_mode("auto", n_max=25_000, vocab_size=200_000, group_size=8) == "move_activations"
    assert resolve_mode("move_weights", n_max=1, vocab_size=10, group_size=2) == "move_weights"
    small = ring_dtp_peak_bytes(16384, 7168, 200_000, 1, dtype=torch.bfloat16, block_size=1024)
    large = ring_dtp_peak_bytes(16384, 7168, 200_000, 1, dtype=torch.bfloat16, block_size=8192)
    assert small < large < 16384 * 200_000 * 2  # grows with the block, stays below one bf16 logits tensor
    sharded = ring_dtp_peak_bytes(16384, 7168, 200_000, 8, dtype=torch.float32, mode="move_activations")
    assert sharded < ring_dtp_peak_bytes(16384, 7168, 200_000, 1, dtype=torch.float32)
    # grad_in_forward at the shapes: the fp32 dW_r accumulator dominates; P = 2 stays under a
    # fifth of the full-logits standard's fp32 [N, V] trio alone (logits, log-softmax, its gradient)
    gib = 2 ** 30
    for n in (16384, 32768):
        for dtype in (torch.bfloat16, torch.float32):
            gif = ring_dtp_peak_bytes(n, 7168, 200_000, 2, dtype=dtype, schedule="grad_in_forward")
            assert 100_000 * 7168 * 4 < gif < 0.2 * n * 200_000 * 12, (n, dtype, gif / gib)
    one = ring_dtp_peak_bytes(16384, 7168, 200_000, 1, dtype=torch.bfloat16, schedule="grad_in_forward")
    assert 8.0 * gib < one < 9.5 * gib  # fp32 dW [V, H] 5.34 GiB, then its bf16 cast 2.67 GiB in backward


def test_errors_name_the_argument():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    for bad_x, bad_w in ((x, torch.randn(10, 6)), (x[None], w), (x, w[None])):      # H differs; not 2-D
        with pytest.raises(ValueError, match=r"hidden must be \[N, H\] and weight_shard \[rows, H\]"):
            ring_dtp_cross_entropy(bad_x, bad_w, t, vocab_size=10)
    with pytest.raises(ValueError, match="weight_shard has 9 rows"):
        ring_dtp_cross_entropy(x, w[:9], t, vocab_size=10)
    with pytest.raises(ValueError, match="target 12"):
        ring_dtp_cross_entropy(x, w, torch.tensor([1, 12, -100, 3]), vocab_size=10)
    with pytest.raises(ValueError, match="mode="):
        ring_dtp_cross_entropy(x, w, t, vocab_size=10, mode="sideways")
    with pytest.raises(ValueError, match="schedule="):
        ring_dtp_cross_entropy(x, w, t, vocab_size=10, schedule="later")
    with pytest.raises(ValueError, match="reduction='none'"):
        ring_dtp_cross_entropy(x, w, t, vocab_size=10, schedule="grad_in_forward", reduction="none")
    with pytest.raises(ValueError, match="moves activations"):
        ring_dtp_cross_entropy(x, w, t, vocab_size=10, schedule="grad_in_forward", mode="move_weights")
    with pytest.raises(ValueError, match="token_chunk="):
        ring_dtp_cross_entropy(x, w, t, vocab_size=10, schedule="grad_in_forward", token_chunk=0)
    with pytest.raises(ValueError, match="reduction="):
        ring_dtp_cross_entropy(x, w, t, vocab_size=10, reduction="max")
    with pytest.raises(ValueError, match="block_size="):
        ring_dtp_cross_entropy(x, w, t, vocab_size=10, block_size=0)
    with pytest.raises(ValueError, match="must be floating point"):
        ring_dtp_cross_entropy(x, w.to(torch.int32), t, vocab_size=10)


def test_float64_gradients_are_refused_off_the_reference_and_exact_on_it():
    """Float64 tokens that want a gradient once ran with float32 accumulators (log-sum-exp, dX, dW):
    float32-accurate gradients (5e-7 relative) handed back as float64. The fused impls refuse them, naming
    impl='reference', whose loss and every gradient are float64 autograd's; their loss alone (an fp32
    loss, as documented) and a float64 master shard under float32 tokens (products in float32) are still
    taken."""
    gen = torch.Generator().manual_seed(fresh_seed(45))
    N, H, V = 7, 6, 13
    x = torch.randn(N, H, generator=gen, dtype=torch.float64) * 2
    w = torch.randn(V, H, generator=gen, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=gen)
    t[0] = -100
    for schedule in ("recompute", "grad_in_forward"):
        for wants in ((True, True), (False, True), (True, False)):
            leaves = [a.clone().requires_grad_(want) for a, want in zip((x, w), wants)]
            with pytest.raises(ValueError, match="hidden is float64 and a gradient is wanted.*impl='reference'"):
                ring_dtp_cross_entropy(*leaves, t, vocab_size=V, impl="torch", schedule=schedule, reduction="sum")
    forward_only = ring_dtp_cross_entropy(x, w, t, vocab_size=V, impl="torch", reduction="sum")
    assert forward_only.dtype == torch.float32 and not forward_only.requires_grad
    ours = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    theirs = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    loss = ring_dtp_cross_entropy(*ours, t, vocab_size=V, impl="reference", reduction="sum")
    loss.backward()
    want = reference_cross_entropy(*theirs, t, reduction="sum")                  # float64 full logits
    want.backward()
    assert_close(loss, want.float(), rtol=0, atol=0, name="loss")
    for a, b in zip(ours, theirs):                              # (assert_close compares in float32)
        assert a.grad.dtype == torch.float64
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    master = w.clone().requires_grad_()
    ring_dtp_cross_entropy(x.float(), master, t, vocab_size=V, impl="torch", reduction="sum").backward()
    assert master.grad.dtype == torch.float64


def test_targets_outside_the_vocabulary_are_rejected_at_the_edges():
    """[0, V) and ignore_index are accepted, V and -1 are not (unless one of them is ignore_index),
    on random V and N, whatever the impl (the check precedes the dispatch)."""
    gen = torch.Generator().manual_seed(fresh_seed(41))
    for _ in range(4):
        V, N = int(torch.randint(2, 40, (1,), generator=gen)), int(torch.randint(2, 9, (1,), generator=gen))
        x, w = torch.randn(N, 4, generator=gen), torch.randn(V, 4, generator=gen)
        good = torch.randint(0, V, (N,), generator=gen)
        good[0], good[1] = V - 1, 0
        for impl in ("torch", "reference"):
            ring_dtp_cross_entropy(x, w, good, vocab_size=V, impl=impl)
            for bad in (V, V + 1, -1):
                t = good.clone()
                t[int(torch.randint(0, N, (1,), generator=gen))] = bad
                with pytest.raises(ValueError, match=f"target {bad} is outside"):
                    ring_dtp_cross_entropy(x, w, t, vocab_size=V, impl=impl)
                loss = ring_dtp_cross_entropy(x, w, t, vocab_size=V, impl=impl, ignore_index=bad, reduction="none")
                assert loss[t == bad].eq(0).all() and loss[t != bad].gt(0).all()


def test_auto_schedule_budget_edge_in_bf16_with_an_fp32_shard():
    """auto takes grad_in_forward exactly when its bound, in the compute dtype (bf16 here) with the
    shard's own dtype (an fp32 master), fits memory_budget: at the bound it does, one byte below not."""
    gen = torch.Generator().manual_seed(fresh_seed(43))
    n, h, v = 9, 16, 45
    x = torch.randn(n, h, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(v, h, generator=gen).requires_grad_()                 # fp32 master shard
    t = torch.randint(0, v, (n,), generator=gen)
    t[:3] = -100                                                          # the bound counts every token
    bound = ring_dtp_peak_bytes(n, h, v, 1, dtype=torch.bfloat16, block_size=8, impl="torch",
                                schedule="grad_in_forward", token_chunk=3, weight_dtype=torch.float32)
    for budget, expected in ((bound, "RingDTPGradInForwardBackward"), (bound - 1, "SumBackward0")):
        loss = ring_dtp_cross_entropy(x, w, t, vocab_size=v, reduction="sum", block_size=8, impl="torch",
                                      token_chunk=3, memory_budget=budget)
        assert type(loss.grad_fn).__name__ == expected, (budget, bound, loss.grad_fn)


def test_default_reduction_is_the_mean_over_valid_tokens():
    gen = torch.Generator().manual_seed(fresh_seed(47))
    x, w = torch.randn(6, 4, generator=gen), torch.randn(11, 4, generator=gen)
    t = torch.tensor([3, -100, 0, 10, 7, -100])
    per_token = reference_cross_entropy(x, w, t, reduction="none")
    want = per_token.sum() / 4
    for loss in (ring_dtp_cross_entropy(x, w, t, vocab_size=11, impl="torch"),
                 reference_ring_dtp_cross_entropy(x, w, t, None, vocab_size=11), reference_cross_entropy(x, w, t)):
        assert_close(loss, want, rtol=1e-6, atol=1e-6, name="default reduction")


_INTERPRETED = """
import sys, torch
sys.path.insert(0, {root!r})
from mop_train.ops.ring_dtp import kernels, local
from tests.ops.test_ring_dtp import _check_case
from tests.utils import fresh_seed
launches = {{}}
def counted(name, kernel):
    def launch(*args, **kwargs):
        launches[name] = launches.get(name, 0) + 1
        return kernel(*args, **kwargs)
    return launch
for name in ("lse_update_", "softmax_grad_"):   # the torch path gives the same values: count the kernels
    setattr(kernels, name, counted(name, getattr(kernels, name)))
seed = fresh_seed(11)
for dtype, reduction in ((torch.float32, "none"), (torch.bfloat16, "sum")):
    launches.clear()
    _check_case(0, None, [5], 23, 8, dtype, reduction, seed, block_size=7, impl="triton")
    assert launches.get("lse_update_") and launches.get("softmax_grad_"), ("recompute", launches)
gemms = []
def whole_shard_gemm(acc, a, b, real=local.matmul_accumulate):
    gemms.append((tuple(acc.shape), tuple(a.shape)))
    real(acc, a, b)
local.matmul_accumulate = whole_shard_gemm
for dtype, reduction in ((torch.float32, "sum"), (torch.bfloat16, "mean")):
    launches.clear()
    gemms.clear()
    _check_case(0, None, [5], 23, 8, dtype, reduction, seed, block_size=7, impl="triton",
                schedule="grad_in_forward", token_chunk=2)
    assert launches.get("lse_update_") and launches.get("softmax_grad_"), ("grad_in_forward", launches)
    # with Triton, dX += g [c, V] @ W and dW [V, H] += g^T @ X are one GEMM each over all V = 23 rows
    assert gemms and all(23 in (a[1], acc[0]) for acc, a in gemms), gemms
print("ok")
"""


@pytest.mark.slow
def test_triton_kernels_in_interpreter():
    """The Triton block kernels (online LSE, in-place softmax gradient) on CPU via TRITON_INTERPRET=1,
    on recompute's blocks and on grad_in_forward's stored [c, V_r] blocks; each schedule must launch
    both kernels (its torch fallback would give the same values)."""
    pytest.importorskip("triton", reason="a CPU install without triton (pip install -e '.[gpu]' brings it)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED.format(root=root)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_matches_reference(dtype):
    torch.cuda.set_device(0)
    seed = fresh_seed(19)
    for reduction in REDUCTIONS:
        _check_case_cuda([1536], 5003, 256, dtype, reduction, seed, block_size=1024)
    for reduction in ("sum", "mean"):  # several rounds of 512 tokens, and the default chunk (one round)
        for chunk in (512, None):
            _check_case_cuda([1536], 5003, 256, dtype, reduction, seed, block_size=1024, schedule="grad_in_forward",
                             token_chunk=chunk)


def _check_case_cuda(counts, vocab, hidden, dtype, reduction, seed, **kw):
    """As _check_case at P = 1, on the GPU with the Triton path."""
    weight, xs, ts, gouts = _problem(seed, counts, vocab, hidden, dtype, "cuda")
    loss, dx, dw, _ = _ours(0, None, weight, xs, ts, gouts, vocab, reduction=reduction, impl="triton", **kw)
    truth = _reference(weight.float(), [x.float() for x in xs], ts, gouts, reduction, _shared(kw))
    theirs = _reference(weight, xs, ts, gouts, reduction, _shared(kw))
    for name, ours, true, other in (("loss", loss, truth[0][0], theirs[0][0]), ("dX", dx, truth[1][0], theirs[1][0]),
                                    ("dW", dw, truth[2], theirs[2])):
        if dtype == torch.float32:  # fp32 GEMMs (TF32 off) summed in other orders: relative 1e-5
            scale, ours_max = _scale(true), _errors(ours, true)[1]
            assert ours_max <= 2e-5 * scale, f"{name}: {ours_max} (scale {scale})"
        else:
            assert_no_worse_than_torch(ours, other, true, name=f"{name} {dtype} {reduction}")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["recompute", "grad_in_forward"])
def test_gpu_peak_within_bound(schedule):
    torch.cuda.set_device(0)
    n, h, v, block = 4096, 1024, 50_000, 4096
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") / h ** 0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    call = dict(vocab_size=v, block_size=block, reduction="sum", schedule=schedule)
    ring_dtp_cross_entropy(x, w, t, **call).backward()  # warm-up
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ring_dtp_cross_entropy(x, w, t, **call).backward()
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    bound = ring_dtp_peak_bytes(n, h, v, 1, dtype=torch.bfloat16, block_size=block, schedule=schedule)
    assert used <= bound < n * v * 4, f"{schedule}: peak {used} B above the inputs, bound {bound} B"


def test_borrowed_accumulator_schedule_is_bitwise_the_plain_one():
    """P = 1, bf16: dX accumulating inside dW's unwritten rows changes only where it lives."""
    from mop_train.ops.ring_dtp.local import borrowed_rows, shard_backward, single_shard_backward
    from tests.utils import assert_bitwise_equal
    gen = torch.Generator().manual_seed(fresh_seed(13))
    n, h, v = 7, 12, 54  # V - 2n a multiple of the block: both schedules cut the same blocks
    x = torch.randn(n, h, generator=gen).bfloat16()
    w = torch.randn(v, h, generator=gen).bfloat16()
    t = torch.randint(0, v, (n,), generator=gen)
    lse = torch.logsumexp((x @ w.t()).float(), dim=1)
    scale = torch.rand(n, generator=gen)
    assert borrowed_rows(n, h, v, torch.bfloat16) == 2 * n
    dx, dw = single_shard_backward(x, w, t, lse, scale, block_size=8, impl="torch")
    plain_dx, plain_dw = torch.zeros(n, h), torch.empty_like(w)
    shard_backward(x, w, 0, t, lse, scale, plain_dx, plain_dw, accumulate_dw=False, block_size=8, impl="torch")
    assert_bitwise_equal(dx, plain_dx.bfloat16(), name="dX")
    assert_bitwise_equal(dw, plain_dw, name="dW")


def test_one_meeting_on_a_shard_window_against_full_logits():
    """local.py's pieces as a ring meeting uses them: tokens (none, one, several) against a window
    [offset, offset + V_r) of a larger vocabulary, blocks that do not divide it, gradients added onto
    accumulators already holding other meetings' terms. Judged against fp64 full logits (bf16: 2%)."""
    gen = torch.Generator().manual_seed(fresh_seed(71))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for n in (0, 1, int(torch.randint(3, 12, (1,), generator=gen))):
            _one_meeting(gen, n, dtype, tol)


def _one_meeting(gen, n, dtype, tol, device="cpu", impl="torch", block=None):
    """One meeting drawn from `gen` (on the CPU), run on `device` with `impl`; `block` fixes the
    block rows (else drawn), and the expected values stay fp64 on the CPU."""
    from mop_train.ops.ring_dtp.local import add_dw, add_dx, block_grad_, block_stats, fold_shard, new_stats, shard_backward
    h, rows = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((4, 16), (5, 30)))
    v = rows + int(torch.randint(2, 30, (1,), generator=gen))
    offset, drawn = int(torch.randint(1, v - rows + 1, (1,), generator=gen)), int(torch.randint(2, 7, (1,), generator=gen))
    block = block or drawn
    x, w_full = torch.randn(n, h, generator=gen).to(dtype), torch.randn(v, h, generator=gen).to(dtype)
    w = w_full[offset:offset + rows]
    t = torch.randint(0, v, (n,), generator=gen)
    t[:2] = torch.tensor([offset, offset + rows - 1])[:n]              # the window's edges are targets
    z = x.double() @ w_full.double().t()                               # [n, V]
    win = z[:, offset:offset + rows]
    hit = (t >= offset) & (t < offset + rows)
    want_stats = torch.stack([win.amax(1), torch.exp(win - win.amax(1, keepdim=True)).sum(1),
                              torch.where(hit, z.gather(1, t[:, None]).squeeze(1), 0.0)])
    lse, scale = torch.logsumexp(z, 1).float(), torch.rand(n, generator=gen)
    prior_dx, prior_dw = torch.randn(n, h, generator=gen), torch.randn(rows, h, generator=gen)
    x, w, t, lse, scale = (a.to(device) for a in (x, w, t, lse, scale))
    stats = new_stats(n, x.device)
    fold_shard(x, w, offset, t, stats, block_size=block, impl=impl)
    stored = x @ w.t()                                                 # grad_in_forward's [n, V_r] block
    # Every gradient below starts from logits rounded to dtype (the stored block, or shard_backward's own
    # recomputation, the same product): judged from those logits, since bf16 logits near 10 already move
    # exp() by ~4%; and against the upstream's size, as an element scale * (p - 1) with p near 1 keeps only
    # the absolute accuracy of p
    g_stored = torch.exp(stored.double().cpu() - lse.double().cpu()[:, None]) * scale.double().cpu()[:, None]
    g_stored[hit.nonzero().squeeze(1), (t.cpu() - offset)[hit]] -= scale.cpu()[hit].double()
    want_dx, want_dw = g_stored @ w.double().cpu(), g_stored.t() @ x.double().cpu()
    for name, got in (("fold_shard", stats), ("block_stats", block_stats(stored, t, offset, block_size=block,
                                                                           impl=impl))):
        assert_close(got, want_stats.float(), rtol=tol, atol=tol * _scale(want_stats), name=f"{name} n={n}")
    dx, dw = prior_dx.to(device, copy=True), prior_dw.to(device, copy=True)
    shard_backward(x, w, offset, t, lse, scale, dx, dw, accumulate_dw=True, block_size=block, impl=impl)
    written = torch.randn(rows, h, generator=gen).to(dtype).to(device)  # stale values the meeting overwrites
    shard_backward(x, w, offset, t, lse, scale, None, written, accumulate_dw=False, block_size=block, impl=impl)
    block_grad_(stored, t, offset, lse, scale, block_size=block, impl=impl)
    gif_dx, gif_dw = prior_dx.to(device, copy=True), prior_dw.to(device, copy=True)
    add_dx(gif_dx, stored, w, block_size=block, impl=impl)
    add_dw(gif_dw, stored, x, block_size=block, impl=impl)
    atol_dx, atol_dw = (tol * (_scale(want) + 1) for want in (want_dx, want_dw))
    assert_close(stored, g_stored, rtol=tol, atol=tol * max(_scale(g_stored), _scale(scale)), name=f"block_grad_ n={n}")
    for name, got, want, atol in (("dX", dx, prior_dx + want_dx, atol_dx), ("dW", dw, prior_dw + want_dw, atol_dw),
                                  ("dW written", written, want_dw, atol_dw),
                                  ("add_dx", gif_dx, prior_dx + want_dx, atol_dx),
                                  ("add_dw", gif_dw, prior_dw + want_dw, atol_dw)):
        assert_close(got.float(), want.float(), rtol=tol, atol=atol, name=f"{name} {dtype} n={n}")


def test_low_precision_accumulation_past_one_partial_product():
    """matmul_accumulate in bf16 bounds its fp32 partial products to a fixed row count: an operand of
    more rows than that (and not a multiple) must still add every row exactly once."""
    from mop_train.ops.ring_dtp.local import _LOW_PRECISION_ROWS, matmul_accumulate
    gen = torch.Generator().manual_seed(fresh_seed(73))
    m = 2 * _LOW_PRECISION_ROWS + int(torch.randint(1, 50, (1,), generator=gen))
    a, b = torch.randn(m, 3, generator=gen).bfloat16(), torch.randn(3, 5, generator=gen).bfloat16()
    acc = torch.randn(m, 5, generator=gen)
    want = acc.double() + a.double() @ b.double()
    matmul_accumulate(acc, a, b)
    assert_close(acc, want, rtol=1e-5, atol=1e-5 * _scale(want), name="acc")


# GPU, one process, one GPU: the CUDA-only branches of the local pieces, the auto schedule's bound on the
# Triton path, grad_in_forward's one-GEMM gradients, and a ring of two played by two threads.

@pytest.mark.gpu
def test_gpu_one_meeting_and_single_shard_backward_against_full_logits():
    """The Triton block kernels on a shard window of several blocks (targets in later blocks: each
    block's offset is offset + its start), and single_shard_backward on CUDA in both of its dX homes:
    a plain fp32 accumulator (fp32, or too few rows to borrow) and dW's unwritten rows (bf16)."""
    from mop_train.ops.ring_dtp.local import borrowed_rows, single_shard_backward
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(fresh_seed(83))
    # fp32 and n != 1 only: with one token (a small random upstream) or in bf16 (logits near 10 rounded)
    # the helper's block_grad_ check misses its tolerance in a few draws per thousand, resp. per hundred;
    # the Triton bf16 path is judged in test_gpu_triton_matches_reference
    for n in (0, *(int(torch.randint(3, 12, (1,), generator=gen)) for _ in range(3))):
        _one_meeting(gen, n, torch.float32, 1e-5, device="cuda", impl="triton", block=3)  # >= 2 blocks (rows >= 5)
    for dtype, n, borrowed, tol in ((torch.float32, 9, False, 1e-5), (torch.bfloat16, 31, False, 2e-2),
                                    (torch.bfloat16, 5, True, 2e-2)):
        h, v, block = 16, 53, 8
        assert bool(borrowed_rows(n, h, v, dtype)) == borrowed
        # logits of a few units: their bf16 rounding moves a probability by well under 2% (at logits
        # near 15, as unscaled randn gives, it moves them by up to ~3% and the check turns flaky)
        x, w = (torch.randn(n, h, generator=gen) / 4).to(dtype), torch.randn(v, h, generator=gen).to(dtype)
        t = torch.randint(0, v, (n,), generator=gen)
        t[0] = v - 1                                                   # a target in the last block
        scale = torch.rand(n, generator=gen) + 0.5
        z = x.double() @ w.double().t()                                # [n, V]
        g = torch.softmax(z, 1) * scale[:, None].double()
        g[torch.arange(n), t] -= scale.double()
        want_dx, want_dw = g @ w.double(), g.t() @ x.double()
        lse = torch.logsumexp(z, 1).float()
        dx, dw = single_shard_backward(*(a.cuda() for a in (x, w, t, lse, scale)), block_size=block, impl="triton")
        tag = f"single_shard_backward {dtype} n={n} borrowed={borrowed}"
        assert dx.device.type == dw.device.type == "cuda" and dx.dtype == dw.dtype == dtype, tag
        for name, got, want in (("dX", dx, want_dx), ("dW", dw, want_dw)):
            assert_close(got.float(), want.float(), rtol=tol, atol=tol * (_scale(want) + 1), name=f"{name} {tag}")


@pytest.mark.gpu
def test_gpu_fp32_output_addmm_and_its_fallback(monkeypatch):
    """matmul_accumulate in bf16 on CUDA: one fp32-output addmm, its verdict cached per device type
    ("cuda": True); where that addmm raises, it is tried once ("cuda": False) and the bounded fp32
    partial products (torch.mm with out_dtype=fp32, rows past one partial product too) add every
    product exactly once, in fp32, on every later call as well."""
    from mop_train.ops.ring_dtp import local
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(fresh_seed(79))
    m = 2 * local._LOW_PRECISION_ROWS + int(torch.randint(1, 50, (1,), generator=gen))
    a, b = torch.randn(m, 48, generator=gen).bfloat16(), torch.randn(48, 40, generator=gen).bfloat16()
    acc0 = torch.randn(m, 40, generator=gen)
    product = a.double() @ b.double()                                  # exact products of the bf16 operands
    real_addmm, tried = torch.addmm, []

    def counted(*args, **kwargs):
        tried.append("out_dtype" in kwargs)
        return real_addmm(*args, **kwargs)

    def missing(*args, **kwargs):
        tried.append("out_dtype" in kwargs)
        if "out_dtype" in kwargs:
            raise RuntimeError("addmm: out_dtype is not supported here (simulated)")
        return real_addmm(*args, **kwargs)

    for fake, verdict in ((counted, True), (missing, False)):
        monkeypatch.setattr(local, "_FUSED_FP32_ADDMM", {})
        monkeypatch.setattr(torch, "addmm", fake)
        tried.clear()
        acc = acc0.cuda()
        for calls in (1, 2):
            local.matmul_accumulate(acc, a.cuda(), b.cuda())
            want = acc0.double() + calls * product
            assert_close(acc, want, rtol=1e-5, atol=1e-5 * _scale(want), name=f"acc after {calls} (fused {verdict})")
            assert local._FUSED_FP32_ADDMM == {"cuda": verdict}, (calls, local._FUSED_FP32_ADDMM)
            assert tried == [True] * (calls if verdict else 1), (verdict, calls, tried)  # a failure is not retried


@pytest.mark.gpu
def test_gpu_grad_in_forward_forms_each_gradient_in_one_gemm(monkeypatch):
    """On the Triton path each round's dX and dW_r are one GEMM each over the whole shard (with block
    columns only on the torch path): per round of c tokens, acc [c, H] += g [c, V] @ W, then
    dW [V, H] += g^T [V, c] @ X_c, and nothing else goes through matmul_accumulate."""
    from mop_train.ops.ring_dtp import local
    torch.cuda.set_device(0)
    real, calls = local.matmul_accumulate, []

    def spy(acc, a, b):
        calls.append((tuple(acc.shape), tuple(a.shape)))
        real(acc, a, b)

    monkeypatch.setattr(local, "matmul_accumulate", spy)
    n, v, h, chunk = 1536, 5003, 256, 512
    for dtype in (torch.float32, torch.bfloat16):
        calls.clear()
        _check_case_cuda([n], v, h, dtype, "sum", fresh_seed(89), block_size=1024, schedule="grad_in_forward",
                         token_chunk=chunk)
        assert calls == [((chunk, h), (chunk, v)), ((v, h), (v, chunk))] * (n // chunk), (dtype, calls)


@pytest.mark.gpu
def test_gpu_auto_schedule_budget_edge_on_the_triton_path():
    """On CUDA (impl None: triton) auto's test uses the Triton path's bound, which is below the torch
    path's here: at that bound grad_in_forward is taken, one byte below it recompute."""
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(fresh_seed(97))
    n, h, v, block, chunk = 64, 32, 1000, 256, 64
    x = torch.randn(n, h, generator=gen).bfloat16().cuda().requires_grad_()
    w = torch.randn(v, h, generator=gen).cuda().requires_grad_()          # fp32 master shard
    t = torch.randint(0, v, (n,), generator=gen).cuda()
    bound = {impl: ring_dtp_peak_bytes(n, h, v, 1, dtype=torch.bfloat16, block_size=block, impl=impl,
                                       schedule="grad_in_forward", token_chunk=chunk, weight_dtype=torch.float32)
             for impl in ("triton", "torch")}
    assert bound["triton"] < bound["torch"], bound
    for budget, expected in ((bound["triton"], "RingDTPGradInForwardBackward"), (bound["triton"] - 1, "SumBackward0")):
        loss = ring_dtp_cross_entropy(x, w, t, vocab_size=v, reduction="sum", block_size=block, token_chunk=chunk,
                                      memory_budget=budget)
        assert type(loss.grad_fn).__name__ == expected, (budget, bound, loss.grad_fn)


_HUB_TIMEOUT = 60.0  # seconds a thread-rank waits for the other before the test fails (a hang)


class _OtherRankFailed(RuntimeError):
    pass


class _Hub:
    """The ranks of one vocab group played by threads of this process on one GPU. The ring's shifts
    and the group's collectives meet here and are held to NCCL's rules: every buffer exchanged lives
    on the GPU, and a receive has exactly its send's dtype and element count."""

    def __init__(self, size: int, device: torch.device):
        self.size, self.device = size, device
        self.cond = threading.Condition()
        self.barrier = threading.Barrier(size, timeout=_HUB_TIMEOUT)
        self.mail, self.shifts, self.slots, self.broken = {}, [0] * size, [None] * size, False

    def check(self, tensors, what: str) -> None:
        for t in tensors:
            if t.device != self.device:
                raise RuntimeError(f"{what}: a {tuple(t.shape)} buffer on {t.device}; NCCL takes {self.device} only")

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()
        self.barrier.abort()

    def exchange(self, rank: int, tensor: torch.Tensor) -> list:
        """Every rank's `tensor`, by rank (the core of both collectives)."""
        self.slots[rank] = tensor.clone()
        self._wait()
        parts = list(self.slots)
        self._wait()                                                   # all have read before any rewrites
        return parts

    def _wait(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise _OtherRankFailed("the other rank failed or hung") from None


class _ThreadGroup:
    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank = hub, rank


class _Arrival:
    """The work of one shift: wait() copies the previous rank's matching shift into the receives."""

    def __init__(self, hub: _Hub, key, recvs):
        self.hub, self.key, self.recvs = hub, key, recvs

    def wait(self) -> None:
        hub = self.hub
        with hub.cond:
            if not hub.cond.wait_for(lambda: hub.broken or self.key in hub.mail, timeout=_HUB_TIMEOUT):
                raise TimeoutError(f"shift {self.key}: nothing arrived")
            if hub.broken:
                raise _OtherRankFailed("the other rank failed")
            payload = hub.mail.pop(self.key)
        got = [(t.dtype, t.numel()) for t in payload]
        want = [(t.dtype, t.numel()) for t in self.recvs]
        if got != want:
            raise RuntimeError(f"shift {self.key}: receives {want} do not match the sends {got}")
        for dst, src in zip(self.recvs, payload):
            dst.copy_(src.reshape(dst.shape))


def _thread_shift(ring, sends, recvs):
    """Ring.shift through the hub: the k-th shift of rank r reaches the k-th shift of rank r+1."""
    hub = ring.group.hub
    sends = [t for t in sends if t.numel() > 0]                        # as Ring.shift: empty ones skipped
    recvs = [t for t in recvs if t.numel() > 0]
    hub.check(sends + recvs, "shift")
    with hub.cond:
        k = hub.shifts[ring.rank]
        hub.shifts[ring.rank] += 1
        hub.mail[((ring.rank + 1) % ring.size, k)] = [t.clone() for t in sends]
        hub.cond.notify_all()
    return [_Arrival(hub, (ring.rank, k), recvs)]


def _thread_all_gather(outs, tensor, group=None, async_op=False):
    group.hub.check([tensor, *outs], "all_gather")
    for out, part in zip(outs, group.hub.exchange(group.rank, tensor), strict=True):
        out.copy_(part)


def _thread_all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
    group.hub.check([tensor], "all_reduce")
    parts = group.hub.exchange(group.rank, tensor)
    total = parts[0]
    for part in parts[1:]:
        total = torch.maximum(total, part) if op == torch.distributed.ReduceOp.MAX else total + part
    tensor.copy_(total)


def _run_thread_ranks(hub: _Hub, fn, *args) -> None:
    """fn(rank, group, *args) on every rank of `hub`, one thread each; the first real failure is raised."""
    errors = [None] * hub.size

    def body(rank):
        try:
            torch.cuda.set_device(hub.device)
            fn(rank, _ThreadGroup(hub, rank), *args)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            errors[rank] = err
            hub.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(hub.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=3 * _HUB_TIMEOUT)
    if any(thread.is_alive() for thread in threads):
        hub.abort()
        raise AssertionError("a thread-rank hung")
    failed = [e for e in errors if e is not None]
    real = [e for e in failed if not isinstance(e, _OtherRankFailed)]
    if failed:
        raise (real or failed)[0]


def _thread_ring_rank(rank, group, problem, refs, vocab):
    """One rank of the two-thread ring: eval forwards (both ways of moving) and grad_in_forward, whose
    backward is applied in this thread (the autograd engine's one CUDA worker would serve one rank at a
    time, while each rank's backward waits for the other's all-gather)."""
    weight, xs, ts, _ = problem
    shard_rows = -(-vocab // 2)
    lo, hi = min(vocab, rank * shard_rows), min(vocab, (rank + 1) * shard_rows)
    call = dict(vocab_size=vocab, block_size=4, impl="torch")

    def close(ours, true, name):
        err, scale = _errors(ours, true)[1], _scale(true)
        assert err <= 2e-5 * scale, f"rank {rank} {name}: {err} (scale {scale})"

    for mode in ("move_activations", "move_weights"):
        with torch.no_grad():
            loss = ring_dtp_cross_entropy(xs[rank], weight[lo:hi], ts[rank], group, mode=mode, reduction="none",
                                          **call)
        close(loss, refs["none"][0][rank], f"loss {mode}")
    x, w = xs[rank].clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
    loss = ring_dtp_cross_entropy(x, w, ts[rank], group, schedule="grad_in_forward", token_chunk=2, reduction="sum",
                                  **call)
    assert type(loss.grad_fn).__name__ == "RingDTPGradInForwardBackward", loss.grad_fn
    dx, dw = loss.grad_fn.apply(loss.new_tensor(_SHARED))[:2]
    ref_loss, ref_dx, ref_dw = refs["sum"]
    close(loss, ref_loss[rank], "grad_in_forward loss")
    close(dx, ref_dx[rank], "grad_in_forward dX")
    close(dw, ref_dw[lo:hi], "grad_in_forward dW")


@pytest.mark.gpu
def test_gpu_ring_of_two_threads_keeps_every_buffer_on_the_gpu(monkeypatch):
    """A vocab group of 2 on one GPU, its ranks two threads (no second GPU here): the counts'
    all-gather, the forward's token and accumulator shifts, grad_in_forward's lse all-reduces and
    travelling dX accumulators, and backward's upstream all-gather all exchange GPU buffers of
    matching sizes, and the results match the full-logits reference (fp32, relative 2e-5)."""
    from mop_train.ops.ring_dtp.ring import Ring
    torch.cuda.set_device(0)
    vocab, counts = 37, [7, 4]
    problem = _problem(fresh_seed(101), counts, vocab, 16, torch.float32, "cuda")
    weight, xs, ts, gouts = problem
    refs = {"none": _reference(weight, xs, ts, gouts, "none"),
            "sum": _reference(weight, xs, ts, gouts, "sum", shared=True)}
    monkeypatch.setattr(Ring, "shift", _thread_shift)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: group.rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group.hub.size)
    monkeypatch.setattr(torch.distributed, "all_gather", _thread_all_gather)
    monkeypatch.setattr(torch.distributed, "all_reduce", _thread_all_reduce)
    _run_thread_ranks(_Hub(2, torch.device("cuda", 0)), _thread_ring_rank, problem, refs, vocab)
