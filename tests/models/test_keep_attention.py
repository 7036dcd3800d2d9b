"""Keep, don't replay, attention: a `debug`-sized model under per-block checkpointing (plain and SCO)
gives bitwise the losses and every gradient of plain checkpointing with keep on, the recompute runs
no attention kernel, nothing kept outlives its backward or a forward without one, and the pairing
holds for two forwards before their backwards, a retained graph, Ulysses at D=2 (gloo) and the
document mask. GPU: the explicit CUDA kernel pairs and keep within bf16 noise (marker gpu)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mop_train.models import zoo
from mop_train.models.attention import ScaledDotProductAttention
from mop_train.models.attention_backends import AttentionCall, attention_backward, attention_forward
from mop_train.models.document_mask import document_ids
from mop_train.models.keep_attention import (attention_cores, keep_attention, kept_attention_bytes,
                                             kept_entries)
from mop_train.ops.sco import SelectiveCheckpointOffload
from mop_train.ops.sco.reference import checkpointed
from mop_train.parallel.apply import apply_sequence_parallel
from tests.dist_utils import run_distributed
from tests.utils import assert_bitwise_equal, assert_no_worse_than_torch, fresh_seed

B, S, EOS = 2, 24, 1
FLASH_FWD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
FLASH_BWD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def _args(variant: str):
    debug = zoo.get_model_args("debug")
    if variant == "gqa":  # d_v == d_qk: the CPU flash kernel (countable); MLA runs the math backend
        return replace(debug, attention="gqa", n_heads=4, n_kv_heads=2, head_dim=16)
    return debug


def _wrapped(base, keep: bool, wrap: str = "plain", seq_group=None):
    """A copy of `base` with its blocks checkpointed (every one plain or through SCO, or
    "alternate": every other one) and keep on/off; with `seq_group`, every core Ulysses-wrapped."""
    model = copy.deepcopy(base)
    apply_sequence_parallel(model, seq_group)   # what the layout does (a no-op without a group)
    sco = SelectiveCheckpointOffload(1 << 20) if wrap == "sco" else None
    for i, (name, block) in enumerate(list(model.layers.items())):
        if wrap != "alternate" or i % 2 == 0:
            model.layers.register_module(name, sco.wrap(block) if sco else checkpointed(block))
    assert keep_attention(model, keep) == len(model.layers)
    return model


def _batch(seed: int, masked: bool):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 2048, (B, S), generator=g)
    tokens[torch.rand(B, S, generator=g) < 0.2] = EOS
    targets = torch.randint(0, 2048, (B, S), generator=g)
    return tokens, targets, (document_ids(tokens, EOS) if masked else None)


def _loss(model, batch):
    tokens, targets, doc_ids = batch
    h = model(tokens, doc_ids=doc_ids)                                  # [B, S, H]
    return F.cross_entropy(model.output(h).flatten(0, 1), targets.flatten(), reduction="sum")


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ours: dict, theirs: dict, tag: str) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert_bitwise_equal(ours[name], theirs[name], name=f"{tag} grad {name}")


class _KernelCount(TorchDispatchMode):
    """Counts the CPU flash kernels dispatched while active."""

    def __init__(self):
        super().__init__()
        self.counts = {FLASH_FWD: 0, FLASH_BWD: 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.counts:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant,masked,wrap,dtype", [
    ("mla", False, "plain", torch.float32), ("mla", True, "plain", torch.bfloat16),
    ("gqa", False, "plain", torch.float32), ("gqa", True, "sco", torch.bfloat16),
    ("gqa", False, "alternate", torch.float32)])
def test_keep_equals_plain_checkpointing_bitwise(variant, masked, wrap, dtype):
    """Two steps (optimizer-free: grads zeroed), losses and every gradient bitwise equal; nothing
    kept after each backward."""
    torch.manual_seed(fresh_seed(1))
    base = zoo.build_model(_args(variant), dtype=dtype)
    runs = {}
    for keep in (False, True):
        model = _wrapped(base, keep, wrap)
        steps = []
        for step in range(2):
            model.zero_grad(set_to_none=True)
            loss = _loss(model, _batch(fresh_seed(10 + step), masked))
            assert len(kept_entries(model)) == (len(model.layers) if keep else 0)
            loss.backward()
            assert kept_entries(model) == [], "kept attention outlived its backward"
            steps.append((loss.detach(), _grads(model)))
        runs[keep] = steps
    for step, ((loss_k, grads_k), (loss_p, grads_p)) in enumerate(zip(runs[True], runs[False])):
        assert_bitwise_equal(loss_k, loss_p, name=f"step {step} loss")
        _assert_same(grads_k, grads_p, f"step {step}")


def test_kernel_calls_forward_one_recompute_none_backward_one():
    torch.manual_seed(fresh_seed(2))
    base = zoo.build_model(_args("gqa"))
    L = len(base.layers)
    batch = _batch(fresh_seed(20), masked=False)
    for keep, recompute_fwd in ((False, L), (True, 0)):
        model = _wrapped(base, keep)
        with _KernelCount() as fwd:
            loss = _loss(model, batch)
        with _KernelCount() as bwd:
            loss.backward()
        assert fwd.counts == {FLASH_FWD: L, FLASH_BWD: 0}, (keep, fwd.counts)
        assert bwd.counts == {FLASH_FWD: recompute_fwd, FLASH_BWD: L}, (keep, bwd.counts)


def test_two_forwards_then_backwards_in_either_order_and_a_retained_graph():
    """Kept tensors pair by graph: forwards A, B then backward B, A (and A, B), then A twice
    through a retained graph (the second backward replays the kernel), equal to plain."""
    torch.manual_seed(fresh_seed(3))
    base = zoo.build_model(_args("gqa"))
    batches = [_batch(fresh_seed(30 + i), masked=i == 1) for i in range(2)]
    results = {}
    for keep in (False, True):
        model = _wrapped(base, keep)
        out = []
        for order in ((1, 0), (0, 1)):
            model.zero_grad(set_to_none=True)
            losses = [_loss(model, b) for b in batches]
            for i in order:
                losses[i].backward()
                out.append(_grads(model))
        model.zero_grad(set_to_none=True)
        loss = _loss(model, batches[0])
        loss.backward(retain_graph=True)
        loss.backward()
        out.append(_grads(model))
        del loss
        assert kept_entries(model) == []
        results[keep] = out
    for i, (ours, theirs) in enumerate(zip(results[True], results[False])):
        _assert_same(ours, theirs, f"case {i}")


def test_nothing_kept_without_backward():
    torch.manual_seed(fresh_seed(4))
    model = _wrapped(zoo.build_model(_args("gqa")), keep=True)
    batch = _batch(fresh_seed(40), masked=False)
    with torch.no_grad():
        _loss(model, batch)
    assert kept_entries(model) == []
    loss = _loss(model, batch)                      # a graph, then dropped without backward
    assert len(kept_entries(model)) == len(model.layers)
    del loss
    assert kept_entries(model) == []


def test_kept_bytes_match_the_plan_term():
    """Bytes alive after forward = layers x kept_attention_bytes (fp32: out and lse both 4 bytes)."""
    torch.manual_seed(fresh_seed(5))
    args = _args("gqa")
    model = _wrapped(zoo.build_model(args), keep=True)
    loss = _loss(model, _batch(fresh_seed(50), masked=False))
    kept = sum(e.nbytes for e in kept_entries(model))
    assert kept == len(model.layers) * kept_attention_bytes(args, B, S, seq_degree=1, dtype_bytes=4)
    loss.backward()
    small = zoo.get_model_args("small")  # 8 x 128K / 2 positions x 16 heads x (128 x 2 + 4) bytes
    assert kept_attention_bytes(small, 1, 1 << 18, seq_degree=2) == (1 << 17) * 16 * (128 * 2 + 4)


def test_explicit_backend_without_keep_replays_and_matches():
    """backend set, keep off: out/lse are ordinary saved tensors, so the recompute runs the kernel."""
    torch.manual_seed(fresh_seed(6))
    base = zoo.build_model(_args("gqa"))
    batch = _batch(fresh_seed(60), masked=False)
    plain = _wrapped(base, keep=False)
    _loss(plain, batch).backward()
    model = _wrapped(base, keep=False)
    for core in attention_cores(model):
        core.backend = "cpu_flash"
    loss = _loss(model, batch)
    with _KernelCount() as bwd:
        loss.backward()
    assert bwd.counts == {FLASH_FWD: len(model.layers), FLASH_BWD: len(model.layers)}
    _assert_same(_grads(model), _grads(plain), "explicit cpu_flash")


def test_bad_backend_is_a_value_error():
    core = ScaledDotProductAttention()
    core.backend = "flash"
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="does not run on cpu"):
        core(q, q, q)
    core.backend = "cpu_flash"
    with pytest.raises(ValueError, match="needs d_v == d_qk"):
        core(q, q, torch.randn(1, 4, 2, 4))


def _ulysses_keep(rank, world_size, seed):
    """Each rank: its sequence shard through the Ulysses-wrapped debug model; keep vs plain."""
    torch.manual_seed(seed)
    base = zoo.build_model(_args("mla"))
    S_l = S // world_size
    sl = slice(rank * S_l, (rank + 1) * S_l)
    for masked in (False, True):
        tokens, targets, doc_ids = _batch(seed + 1, masked)
        runs = []
        for keep in (False, True):
            model = _wrapped(base, keep, seq_group=dist.group.WORLD)
            h = model(tokens[:, sl], positions=torch.arange(sl.start, sl.stop), doc_ids=doc_ids)
            loss = F.cross_entropy(model.output(h).flatten(0, 1), targets[:, sl].flatten(), reduction="sum")
            assert len(kept_entries(model)) == (len(model.layers) if keep else 0)
            loss.backward()
            assert kept_entries(model) == []
            runs.append((loss.detach(), _grads(model)))
        assert_bitwise_equal(runs[1][0], runs[0][0], name=f"rank {rank} masked={masked} loss")
        _assert_same(runs[1][1], runs[0][1], f"rank {rank} masked={masked}")


@pytest.mark.slow
def test_ulysses_keep_equals_plain_bitwise():
    run_distributed(_ulysses_keep, 2, fresh_seed(7))


# ------------------------------------------------------------------------------------------------
# GPU: the explicit CUDA kernel pairs, and keep on a bf16 model
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "flash_pad_v", "efficient", "cudnn"])
@pytest.mark.parametrize("h,h_kv,d_qk,d_v", [(8, 8, 192, 128), (8, 1, 64, 64), (4, 4, 128, 128)])
def test_cuda_kernel_pairs_match_fp32_math(backend, h, h_kv, d_qk, d_v):
    if backend == "flash" and d_qk != d_v:
        pytest.skip("flash needs d_v == d_qk (flash_pad_v covers it)")
    g = torch.Generator(device="cuda").manual_seed(fresh_seed(8))
    shape = lambda heads, d: (2, heads, 1024, d)  # noqa: E731
    q, k, v = (torch.randn(shape(n, d), device="cuda", generator=g, dtype=torch.bfloat16)
               for n, d in ((h, d_qk), (h_kv, d_qk), (h_kv, d_v)))
    gout = torch.randn(shape(h, d_v), device="cuda", generator=g, dtype=torch.bfloat16)
    call = AttentionCall(backend=backend, gqa=h_kv != h)
    try:
        out, lse, aux = attention_forward(call, q, k, v)
    except RuntimeError as err:
        pytest.skip(f"{backend} does not take this shape on this GPU/torch: {err}")
    ours = [out, *attention_backward(call, gout, q, k, v, None, out, lse, aux)]

    def torch_sdpa(*inputs):
        leaves = [t.detach().requires_grad_() for t in inputs]
        res = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=h_kv != h)
        res.backward(gout.to(res.dtype))
        return [res.detach()] + [t.grad for t in leaves]

    truth = torch_sdpa(*(t.float() for t in (q, k, v)))
    theirs = torch_sdpa(q, k, v)
    for name, a, b, t in zip(("out", "dq", "dk", "dv"), ours, theirs, truth):
        assert_no_worse_than_torch(a, b, t, name=f"{backend} {name}")


@pytest.mark.gpu
def test_keep_on_cuda_bf16_within_noise_of_plain():
    from tests.utils import assert_close_to_scale

    torch.manual_seed(fresh_seed(9))
    base = zoo.build_model(_args("mla"), device="cuda", dtype=torch.bfloat16)
    batch = tuple(None if t is None else t.cuda() for t in _batch(fresh_seed(90), masked=False))
    runs = []
    for keep in (False, True):
        model = _wrapped(base, keep)
        _loss(model, batch).backward()
        assert kept_entries(model) == []
        runs.append(_grads(model))
    for name in runs[0]:
        assert_close_to_scale(runs[1][name], runs[0][name], rtol=2e-2, name=name)
