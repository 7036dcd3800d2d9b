"""Ring-DTP under every way a loss gets called, both schedules, P = 1 (in process) and 2..4 (gloo):
a scaled loss, reduction="none" with per-token weights, two calls on the same inputs before one
backward, evaluation (torch.no_grad, or no input requiring grad: the loss only, no gradient buffers),
torch.autocast with backward inside and outside it, only some leaves wanting a gradient (the hidden on one
rank, no hidden, no weight), a second backward, ranks whose upstreams differ (nan, a single valid
token, none at all), ranks that disagree on needing gradients, auto's choice against a memory budget,
which payload travels under each mode, two rings inside a larger world; at P = 1 also bad arguments,
the smallest accepted sizes, and no buffer for a gradient that no leaf wants.

fp32 gradients: relative 1e-5 of the largest sum of |terms| (tests.ops.test_ring_dtp._term_scales);
bf16 under autocast: no worse than PyTorch's own autocast against the fp64 truth of the same rounded
inputs, on the whole problem (tests.utils.assert_no_worse_than_torch).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from mop_train.ops.ring_dtp import reference_cross_entropy, ring_dtp_cross_entropy, ring_dtp_peak_bytes
from mop_train.ops.ring_dtp.ring import Ring
from tests.dist_utils import run_distributed
from tests.ops.test_ring_dtp import COUNTS, _check_case, _problem, _scale, _term_scales
from tests.utils import AllocatedBytes, assert_close, assert_no_worse_than_torch, fresh_seed

VOCAB, HIDDEN, BLOCK = 37, 16, 4
SCHEDULES = ("recompute", "grad_in_forward")
UPSTREAM = 0.8125  # the same on every rank (grad_in_forward's contract)


class _Rank:
    """One rank's view of a drawn problem: its tokens, targets, shard rows, and the whole problem."""

    def __init__(self, rank, group, counts, seed, dtype=torch.float32):
        self.rank, self.group, self.counts = rank, group, counts
        self.weight, self.xs, self.ts, self.gouts = _problem(seed, counts, VOCAB, HIDDEN, dtype)
        rows = -(-VOCAB // len(counts))
        self.lo, self.hi = min(VOCAB, rank * rows), min(VOCAB, (rank + 1) * rows)

    def leaves(self, grad=True):
        x = self.xs[self.rank].clone().requires_grad_(grad)
        w = self.weight[self.lo:self.hi].clone().requires_grad_(grad)
        return x, w

    def loss(self, x, w, **kw):
        kw = dict(dict(block_size=BLOCK, impl="torch", token_chunk=2), **kw)
        if kw.get("schedule") == "recompute":
            kw.pop("token_chunk")
        return ring_dtp_cross_entropy(x, w, self.ts[self.rank], self.group, vocab_size=VOCAB, **kw)

    def reference(self, reduction, factor, dtype=torch.float64):
        """Every rank's losses and the gradients of this rank's X and shard, upstream `factor`."""
        w = self.weight.to(dtype).requires_grad_()
        xs = [x.to(dtype).requires_grad_() for x in self.xs]
        losses = [reference_cross_entropy(x, w, t, reduction=reduction) for x, t in zip(xs, self.ts)]
        sum(l.nansum() * factor for l in losses).backward()
        return losses[self.rank].detach(), xs[self.rank].grad, w.grad[self.lo:self.hi]

    def check_fp32(self, loss, dx, dw, reduction, factor, tag, check_dx=True, check_dw=True):
        """Loss, dX and dW against the reference; check_dx / check_dw False skip a gradient no leaf asked for."""
        ref_loss, ref_dx, ref_dw = self.reference(reduction, factor)
        term_dx, term_dw = _term_scales(self.weight, self.xs, self.ts, self.gouts, reduction, self.rank, True)
        term_dx, term_dw = term_dx * factor / UPSTREAM, term_dw * factor / UPSTREAM
        if not torch.isnan(ref_loss).all():
            assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5 * _scale(ref_loss), name=f"loss {tag}")
        if check_dx:
            assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5 * max(term_dx, _scale(ref_dx)), name=f"dX {tag}")
        if check_dw:
            assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5 * max(term_dw, _scale(ref_dw)), name=f"dW {tag}")


def _grad_fn(loss) -> str:
    return type(loss.grad_fn).__name__ if loss.grad_fn is not None else "None"


def _scaled_and_twice(p: _Rank, tag):
    for schedule in SCHEDULES:
        for reduction in ("sum", "mean"):
            x, w = p.leaves()                                               # a scaled loss, one call
            (p.loss(x, w, schedule=schedule, reduction=reduction) * UPSTREAM).backward()
            loss = p.loss(x.detach(), w.detach(), schedule=schedule, reduction=reduction)
            p.check_fp32(loss, x.grad, w.grad, reduction, UPSTREAM, f"{tag} {schedule} {reduction} scaled")
            x, w = p.leaves()                                               # two calls, one backward
            first = p.loss(x, w, schedule=schedule, reduction=reduction)
            second = p.loss(x, w, schedule=schedule, reduction=reduction)
            (0.5 * first + 0.25 * second).backward()
            p.check_fp32(first.detach(), x.grad, w.grad, reduction, 0.75, f"{tag} {schedule} {reduction} twice")


def _evaluation(p: _Rank, tag):
    """No gradient wanted: the loss only; nothing near a gradient accumulator is allocated."""
    accumulator = (p.hi - p.lo) * HIDDEN * 4                               # dW_r fp32
    ref = p.reference("sum", 1.0)[0].float()
    for schedule in SCHEDULES + ("auto",):
        for how in ("no_grad", "no_requires_grad"):
            x, w = p.leaves(grad=how != "no_requires_grad")
            with AllocatedBytes() as seen, torch.set_grad_enabled(how != "no_grad"):
                loss = p.loss(x, w, schedule=schedule, reduction="sum", memory_budget=1 << 40)
            assert loss.grad_fn is None and not loss.requires_grad, f"{tag} {schedule} {how}: {_grad_fn(loss)}"
            assert_close(loss, ref, rtol=1e-5, atol=1e-5 * _scale(ref), name=f"eval loss {tag} {schedule} {how}")
            assert seen.largest < accumulator, f"{tag} {schedule} {how}: allocated {seen.largest} B"


def _none_and_auto(p: _Rank, seed, tag):
    """reduction="none" with per-token weights: auto takes recompute, whatever the budget; a sum takes
    grad_in_forward exactly when its bound fits every rank's budget."""
    x, w = p.leaves()
    loss = p.loss(x, w, reduction="none", memory_budget=1 << 40)
    assert _grad_fn(loss) == "RingDTPCrossEntropyBackward", f"{tag}: {_grad_fn(loss)}"
    _check_case(p.rank, p.group, p.counts, VOCAB, HIDDEN, torch.float32, "none", seed, schedule="auto",
                memory_budget=1 << 40, block_size=BLOCK, impl="torch")
    bound = ring_dtp_peak_bytes(p.counts[p.rank], HIDDEN, VOCAB, len(p.counts), dtype=torch.float32,
                                block_size=BLOCK, n_max=max(p.counts), impl="torch", schedule="grad_in_forward",
                                token_chunk=2)
    fewest = p.counts.index(min(p.counts))                                # its bound still counts N_max
    for budget, expected in ((None, "SumBackward0"), (bound, "RingDTPGradInForwardBackward"),
                             (bound - (p.rank == 0), "SumBackward0"), (bound - (p.rank == fewest), "SumBackward0")):
        loss = p.loss(x, w, reduction="sum", memory_budget=budget)
        assert _grad_fn(loss) == expected, f"{tag} budget {budget} (bound {bound}): {_grad_fn(loss)}"


def _autocast(p: _Rank, tag):
    """fp32 leaves under bf16 autocast, backward inside and outside it; PyTorch's autocast as the bar,
    both judged on the whole problem (every rank's loss and dX, the full dW) against the fp64 truth."""
    rounded = [xi.bfloat16().double().requires_grad_() for xi in p.xs]     # what autocast's products see
    w64 = p.weight.bfloat16().double().requires_grad_()
    wf, xs = p.weight.clone().requires_grad_(), [xi.clone().requires_grad_() for xi in p.xs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [reference_cross_entropy(xi, wf, t, reduction="sum") for xi, t in zip(xs, p.ts)]
    true_losses = [reference_cross_entropy(xi, w64, t, reduction="sum") for xi, t in zip(rounded, p.ts)]
    for ls in (losses, true_losses):
        sum(ls).mul(UPSTREAM).backward()
    theirs = _flat([l.detach() for l in losses], [xi.grad for xi in xs], wf.grad)
    truth = _flat([l.detach() for l in true_losses], [xi.grad for xi in rounded], w64.grad)
    for schedule in SCHEDULES:
        for inside in (True, False):
            x, w = p.leaves()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = p.loss(x, w, schedule=schedule, reduction="sum")
                if inside:
                    (loss * UPSTREAM).backward()
            if not inside:
                (loss * UPSTREAM).backward()
            assert x.grad.dtype == w.grad.dtype == torch.float32, f"{tag}: {x.grad.dtype} {w.grad.dtype}"
            mine = [(loss.detach(), x.grad, w.grad)]
            if p.group is not None:
                mine = [None] * len(p.counts)
                dist.all_gather_object(mine, (loss.detach(), x.grad, w.grad), group=p.group)
            ours = _flat([m[0] for m in mine], [m[1] for m in mine], torch.cat([m[2] for m in mine]))
            name = f"{tag} {schedule} autocast backward {'inside' if inside else 'outside'}"
            for what, a, b, c in zip(("loss", "dX", "dW"), ours, theirs, truth):
                assert_no_worse_than_torch(a, b, c, name=f"{what} {name} (whole problem)")


def _flat(losses, dxs, dw):
    """(losses, dX, dW) of the whole problem, each flattened to fp32."""
    return tuple(torch.cat([t.reshape(-1).float() for t in ts]) for ts in (losses, dxs, [dw]))


def _partial_leaves(p: _Rank, tag):
    """Only some leaves want a gradient: the hidden on rank 0 alone (the others still carry rank 0's
    dX accumulator around the ring), no hidden at all (a frozen trunk), or no weight (a frozen head)."""
    wanted = {"hidden on rank 0 only": (p.rank == 0, True), "weights only": (False, True),
              "hidden only": (True, False)}
    for schedule in SCHEDULES:
        for reduction in ("sum", "mean"):
            for what, (want_x, want_w) in wanted.items():
                name = f"{tag} {schedule} {reduction} {what}"
                x, w = p.leaves()
                x.requires_grad_(want_x)
                w.requires_grad_(want_w)
                loss = p.loss(x, w, schedule=schedule, reduction=reduction)
                (loss * UPSTREAM).backward()
                assert (x.grad is not None) == want_x and (w.grad is not None) == want_w, \
                    f"{name}: gradients where none were asked for, or none where one was"
                p.check_fp32(loss.detach(), x.grad, w.grad, reduction, UPSTREAM, name, check_dx=want_x,
                             check_dw=want_w)


def _misuse(p: _Rank, tag):
    """A second backward, ranks whose upstreams differ, ranks that disagree on needing gradients."""
    x, w = p.leaves()
    loss = p.loss(x, w, schedule="recompute", reduction="sum")
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert_close(x.grad, 2 * first, name=f"{tag} recompute: second backward")
    loss = p.loss(x, w, schedule="grad_in_forward", reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    if p.group is None:
        return
    active = [q for q, t in enumerate(p.ts) if bool((t != -100).any())]
    x, w = p.leaves()
    loss = p.loss(x, w, schedule="grad_in_forward", reduction="sum")
    if len(active) > 1:
        with pytest.raises(ValueError, match="differs across"):
            loss.backward(torch.tensor(1.0 + p.rank))
    elif active:                                                            # one rank's tokens: its upstream
        loss.backward(torch.tensor(1.0 + p.rank))
        p.check_fp32(loss.detach(), x.grad, w.grad, "sum", 1.0 + active[0], f"{tag} the only active rank's upstream")
    _upstream_agreement(p, active, tag)
    with pytest.raises(ValueError, match="every rank makes the same call"):
        with torch.set_grad_enabled(p.rank != 0):
            p.loss(x, w, schedule="grad_in_forward", reduction="sum")


def _upstream_agreement(p: _Rank, active, tag):
    """Which ranks' upstreams must agree under grad_in_forward: every rank with a valid token (even a
    single one); a nan agrees only with nan; and with no valid token anywhere, any upstreams do."""
    nan = float("nan")
    cases = [("every rank nan", nan, False)]
    if len(active) > 1:
        cases += [("first active rank nan", nan if p.rank == active[0] else 1.0, True),
                  ("other ranks nan", 1.0 if p.rank == active[0] else nan, True)]
    for what, upstream, raises in cases:
        loss = p.loss(*p.leaves(), schedule="grad_in_forward", reduction="sum")
        if raises:
            with pytest.raises(ValueError, match="differs across"):
                loss.backward(torch.tensor(upstream))
        else:
            loss.backward(torch.tensor(upstream))
    targets = p.ts[p.rank]
    first_valid = torch.full_like(targets, -100)                            # one valid token per active rank
    keep = (targets != -100).nonzero()[:1, 0]
    first_valid[keep] = targets[keep]
    for what, t in (("one valid token per rank", first_valid), ("no valid token anywhere", torch.full_like(targets, -100))):
        x, w = p.leaves()
        loss = ring_dtp_cross_entropy(x, w, t, p.group, vocab_size=VOCAB, schedule="grad_in_forward",
                                      reduction="sum", block_size=BLOCK, impl="torch", token_chunk=2)
        if len(active) > 1 and what == "one valid token per rank":
            with pytest.raises(ValueError, match="differs across"):
                loss.backward(torch.tensor(1.0 + p.rank))
        elif not active or what == "no valid token anywhere":
            loss.backward(torch.tensor(1.0 + p.rank))
            assert not (x.grad.any() or w.grad.any()), f"{tag} {what}: a gradient from ignored tokens"


def _moved_payloads(p: _Rank, tag):
    """What travels the ring: under move_weights the shard (and its dW), never a token's target; under
    move_activations the tokens with their targets, in forward and in backward."""
    real_shift = Ring.shift
    for mode in ("move_weights", "move_activations"):
        sent = []

        def spy(ring, sends, recvs):
            sent.extend(t.dtype for t in sends)
            return real_shift(ring, sends, recvs)

        x, w = p.leaves()
        with mock.patch.object(Ring, "shift", spy):
            loss = p.loss(x, w, schedule="recompute", reduction="sum", mode=mode)
            forward, sent[:] = list(sent), []
            loss.backward()
        moved = (torch.int64 in forward, torch.int64 in sent)
        assert moved == (mode == "move_activations",) * 2, f"{tag} {mode}: targets moved (forward, backward) {moved}"
        p.check_fp32(loss.detach(), x.grad, w.grad, "sum", 1.0, f"{tag} {mode}")


def _rings_of_two(rank, groups, seed):
    """Two rings of 2 in a world of 4, logits in the hundreds in one only: grad_in_forward's log-sum-exp
    shift (the max across the ring) must come from its own ring, or the small ring's sums underflow."""
    _check_case(rank % 2, groups[rank // 2], [7, 4], VOCAB, HIDDEN, torch.float32, "sum", seed + rank // 2,
                logit_scale=100.0 if rank < 2 else 1.0, schedule="grad_in_forward", token_chunk=2,
                block_size=BLOCK, impl="torch")


def _cases(rank, world_size, seed):
    group = dist.new_group(list(range(world_size))) if world_size > 1 else None
    _suite(rank, group, world_size, seed)
    if world_size == 4:
        # Two rings of 2 inside the world: each runs the whole P = 2 suite on its own problem, so no
        # world of 2 is spawned for it (a ring of 2 is the same code whether it is a subgroup or the
        # world; a spawn costs seconds per rank).
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]           # every rank creates both
        _suite(rank % 2, groups[rank // 2], 2, seed + 10 + 10 * (rank // 2))
        _rings_of_two(rank, groups, seed + 4)


def _suite(rank, group, world_size, seed):
    """Every way of calling on `group` (world_size ranks, this one at `rank`; None at world_size 1)."""
    counts = COUNTS[world_size]
    tag = f"P={world_size} rank={rank}"
    p = _Rank(rank, group, counts, seed)
    _scaled_and_twice(p, tag)
    _evaluation(p, tag)
    _none_and_auto(p, seed + 1, tag)
    _autocast(_Rank(rank, group, counts, seed + 2), tag)
    _partial_leaves(_Rank(rank, group, counts, seed + 3), tag)
    _misuse(p, tag)
    if world_size > 1:
        _moved_payloads(p, tag)


def test_calls_single_device():
    _cases(0, 1, fresh_seed(4100))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])  # P = 2: the two rings inside the world of 4 (_cases)
def test_calls_on_a_ring(world_size):
    run_distributed(_cases, world_size, fresh_seed(4100 + world_size))


def _draw(seed, n, vocab, hidden=HIDDEN, ignored=0.2):
    """One rank's problem at P = 1: tokens [n, H], the weight [V, H], targets with some ignored."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen) * 2
    w = torch.randn(vocab, hidden, generator=gen) * 2 / hidden ** 0.5
    t = torch.randint(0, vocab, (n,), generator=gen)
    t[torch.rand(n, generator=gen) < ignored] = -100
    return x, w, t


def _against_reference(x, w, t, reduction, tag, rtol=1e-5, **kw):
    """Loss, dX and dW of one call at P = 1 (upstream UPSTREAM) against the fp64 full-logits reference."""
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = ring_dtp_cross_entropy(xs, ws, t, vocab_size=w.shape[0], reduction=reduction, **kw)
    (loss * UPSTREAM).sum().backward()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_cross_entropy(x64, w64, t, reduction=reduction)
    (ref * UPSTREAM).sum().backward()
    for name, ours, theirs in (("loss", loss, ref), ("dX", xs.grad, x64.grad), ("dW", ws.grad, w64.grad)):
        assert_close(ours, theirs, rtol=rtol, atol=rtol * max(1.0, _scale(theirs)), name=f"{name} {tag}")


def test_bad_arguments_raise_naming_the_argument():
    """Each bad argument raises ValueError naming it: none slips through to fail later inside the ring."""
    x, w, t = _draw(fresh_seed(4200), 5, VOCAB)
    calls = {"vocab_size=0": dict(vocab_size=0),
             "impl=": dict(impl="cuda"),                                    # an unknown impl, not a default
             r"targets must be integer \[5\]": dict(targets=t[:4]),
             "targets must be integer": dict(targets=t.float()),
             r"hidden must be \[N, H\]": dict(weight=w[:, :, None])}       # H agrees; the shard is 3-D
    if not x.is_cuda:                                                         # (the triton kernels are CUDA's)
        calls["impl='triton' runs its kernels on CUDA"] = dict(impl="triton")
    for message, kw in calls.items():
        with pytest.raises(ValueError, match=message):
            ring_dtp_cross_entropy(x, kw.pop("weight", w), kw.pop("targets", t), **dict(dict(vocab_size=VOCAB), **kw))


def test_triton_without_the_package_names_the_fix(monkeypatch):
    """impl='triton' where triton is not installed: a ValueError naming the package and impl='torch', not
    a ModuleNotFoundError from the kernels' import."""
    import importlib.util

    from mop_train.ops import ring_dtp as ring_dtp_module
    x, w, t = _draw(fresh_seed(4201), 5, VOCAB)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(ring_dtp_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))   # past the device check
    with pytest.raises(ValueError, match="needs the triton package.*impl='torch'"):
        ring_dtp_cross_entropy(x, w, t, vocab_size=VOCAB, impl="triton")


def test_smallest_accepted_sizes_and_the_default_impl():
    """V = 1, block_size = 1 and token_chunk = 1 are valid (the checks stop at 0); impl=None on the CPU is
    the torch path."""
    seed = fresh_seed(4201)
    x, w, t = _draw(seed, 6, 1)
    _against_reference(x, w, t, "sum", "V=1", impl="torch")
    x, w, t = _draw(seed + 1, 6, 9)
    for schedule in SCHEDULES:
        _against_reference(x, w, t, "sum", f"{schedule} block_size=1", block_size=1, impl="torch", schedule=schedule)
    _against_reference(x, w, t, "mean", "token_chunk=1", impl="torch", schedule="grad_in_forward", token_chunk=1)
    _against_reference(x, w, t, "mean", "impl=None", block_size=BLOCK)


def test_which_inputs_choose_the_path():
    """auto never takes grad_in_forward when the weights must move; a frozen trunk (only the shard wants a
    gradient) gets it whatever the budget; fp64 inputs stay fp64 under autocast, as torch.mm does."""
    x, w, t = _draw(fresh_seed(4202), 6, VOCAB)
    loss = ring_dtp_cross_entropy(x.requires_grad_(), w.requires_grad_(), t, vocab_size=VOCAB, reduction="sum",
                                  mode="move_weights", memory_budget=1 << 40, impl="torch", block_size=BLOCK)
    assert _grad_fn(loss) == "SumBackward0", f"auto with mode='move_weights': {_grad_fn(loss)}"
    x.requires_grad_(False)
    for budget in (None, 0, 1 << 40):
        x_frozen, w_leaf = x.clone(), w.detach().clone().requires_grad_()
        (ring_dtp_cross_entropy(x_frozen, w_leaf, t, vocab_size=VOCAB, reduction="sum", memory_budget=budget,
                                impl="torch", block_size=BLOCK) * UPSTREAM).backward()
        w64 = w.detach().double().requires_grad_()
        (reference_cross_entropy(x.double(), w64, t, reduction="sum") * UPSTREAM).backward()
        assert_close(w_leaf.grad, w64.grad, atol=1e-5 * _scale(w64.grad), name=f"frozen trunk dW, budget {budget}")
    x64, w64 = x.double(), w.detach().double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ring_dtp_cross_entropy(x64, w64, t, vocab_size=VOCAB, reduction="none", impl="torch")
    ref = reference_cross_entropy(x64, w64, t, reduction="none")
    assert_close(loss, ref, rtol=1e-6, atol=1e-6 * _scale(ref), name="fp64 loss under autocast")


def test_grad_in_forward_edges():
    """A mean over a single valid token (its owner's scale is 1/1), and an fp32 hidden with a bf16 shard:
    the products run in fp32, so dX keeps fp32 accuracy (only dW comes back in the shard's bf16)."""
    x, w, t = _draw(fresh_seed(4203), 6, VOCAB)
    one = torch.full_like(t, -100)
    one[3] = t[3].clamp(min=0)
    _against_reference(x, w, one, "mean", "one valid token", schedule="grad_in_forward", token_chunk=2,
                       impl="torch", block_size=BLOCK)
    xs, ws = x.clone().requires_grad_(), w.bfloat16().requires_grad_()
    (ring_dtp_cross_entropy(xs, ws, t, vocab_size=VOCAB, reduction="sum", schedule="grad_in_forward", token_chunk=2,
                            impl="torch", block_size=BLOCK) * UPSTREAM).backward()
    x64, w64 = x.double().requires_grad_(), ws.detach().double().requires_grad_()
    (reference_cross_entropy(x64, w64, t, reduction="sum") * UPSTREAM).backward()
    assert xs.grad.dtype == torch.float32 and ws.grad.dtype == torch.bfloat16, (xs.grad.dtype, ws.grad.dtype)
    assert_close(xs.grad, x64.grad, atol=1e-5 * _scale(x64.grad), name="fp32 dX beside a bf16 shard")
    assert_close(ws.grad, w64.grad, rtol=1e-2, atol=1e-2 * _scale(w64.grad), name="bf16 dW")


def test_allocations_follow_the_wanted_gradients():
    """Nothing the size of a gradient that no leaf wants: grad_in_forward forms no dX for a frozen trunk and
    no dW_r for a frozen head (recompute's P = 1 backward forms both in one buffer), and neither schedule
    forms either when no input requires grad; and impl="reference" is the full-logits path
    (it forms the [N, V] logits the fused paths never do)."""
    seed = fresh_seed(4204)
    many_tokens, few_tokens = _draw(seed, 40, 8), _draw(seed + 1, 3, 64)   # N*H > V*H, then V*H > N*H
    for (x, w, t), wanted in ((many_tokens, "weight"), (few_tokens, "hidden"), (many_tokens, "nothing")):
        unwanted = x if wanted != "hidden" else w
        x, w = x.clone().requires_grad_(wanted == "hidden"), w.clone().requires_grad_(wanted == "weight")
        for schedule in SCHEDULES if wanted == "nothing" else ("grad_in_forward",):
            with AllocatedBytes() as seen:
                loss = ring_dtp_cross_entropy(x, w, t, vocab_size=w.shape[0], reduction="sum", schedule=schedule,
                                              impl="torch", block_size=BLOCK, token_chunk=x.shape[0])  # one chunk
                if wanted != "nothing":
                    loss.backward()
            assert seen.largest < unwanted.numel() * 4, \
                f"{schedule}, only the {wanted} wants a gradient: allocated {seen.largest} B"
    x, w, t = many_tokens
    with AllocatedBytes() as seen:
        ring_dtp_cross_entropy(x, w, t, vocab_size=w.shape[0], impl="reference", block_size=BLOCK)
    assert seen.largest >= x.shape[0] * w.shape[0] * 4, f"impl='reference' allocated only {seen.largest} B"


def _bad_target_on_one_rank(rank, world_size, seed):
    x, w, t = _draw(seed + rank, 6, VOCAB)
    lo, hi = Ring.of(dist.group.WORLD, VOCAB).shard_bounds(rank)
    if rank == world_size - 1:
        t[3] = VOCAB + 5                                  # only the last rank's labels are bad
    for impl in ("torch", "reference"):
        with pytest.raises(ValueError, match=f"target {VOCAB + 5} on rank {world_size - 1} of the vocab group"):
            ring_dtp_cross_entropy(x, w[lo:hi], t, vocab_size=VOCAB, group=dist.group.WORLD, impl=impl)
    dist.barrier()                                        # every rank got here: none is left in a collective


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bad_target_on_one_rank_is_refused_on_every_rank(world_size):
    """A label outside the vocabulary on one rank of the ring: every rank raises the same ValueError (naming
    that rank), instead of that rank alone while the others wait in the ring's first all-gather."""
    run_distributed(_bad_target_on_one_rank, world_size, fresh_seed(4202), timeout_s=60)
