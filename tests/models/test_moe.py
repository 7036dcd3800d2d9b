"""MoE layer and router: local dispatch vs the per-token reference (values and every gradient),
forced routing, bias-steered selection, aux-loss-free balancing, the optional aux loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from mop_train.models import zoo
from mop_train.models.attention import rope_cos_sin
from mop_train.models.moe import MoE
from mop_train.models.router import TopKRouter
from mop_train.ops.moe_dispatch import reference_experts_forward
from tests.utils import assert_bitwise_equal, assert_close, assert_close_to_scale, fresh_seed


def _moe(seed: int, **overrides) -> MoE:
    torch.manual_seed(fresh_seed(seed))
    moe = MoE(replace(zoo.get_model_args("debug"), **overrides))
    moe.init_weights(init_std=0.3)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.randn(moe.router.num_experts) * 0.05)
    return moe


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Plain routing + the per-token expert loop + the shared SwiGLU, written out from the spec."""
    r = moe.router
    logits = (x @ r.gate.weight.t()).float()                                  # [N, E]
    scores = logits.softmax(-1) if r.score_func == "softmax" else logits.sigmoid()
    indices = (scores + r.expert_bias).topk(r.top_k, dim=-1).indices         # [N, k]
    weights = scores.gather(1, indices)
    if r.route_norm:
        weights = weights / weights.sum(-1, keepdim=True)
    y = reference_experts_forward(x, indices, weights * r.route_scale,
                                  moe.experts.w1, moe.experts.w2, moe.experts.w3)
    if moe.shared_expert is not None:
        s = moe.shared_expert
        y = y + (F.silu(x @ s.w1.weight.t()) * (x @ s.w3.weight.t())) @ s.w2.weight.t()
    return y


CASES = {
    "sigmoid-norm-shared-grouped_mm": dict(),
    "softmax-nonorm-scaled": dict(score_func="softmax", route_norm=False, route_scale=2.5, n_shared_experts=0),
    "odd-width-loop-topk=E": dict(moe_inter_dim=5, num_experts=3, top_k=3, n_shared_experts=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_local_dispatch_matches_reference(case):
    moe = _moe(11, **CASES[case])
    N, H = 37, moe.experts.w1.shape[2]
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(fresh_seed(12)), requires_grad=True)
    grad_out = torch.randn(N, H, generator=torch.Generator().manual_seed(fresh_seed(13)))

    out = moe(x.view(1, N, H)).view(N, H)
    out.backward(grad_out)
    got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    x.grad = None
    moe.zero_grad()

    ref = _reference_moe(moe, x)
    ref.backward(grad_out)
    assert_close_to_scale(out, ref, name="out")
    assert_close_to_scale(got["x"], x.grad, name="grad x")
    for name, p in moe.named_parameters():
        assert p.grad.abs().sum() > 0 or name.startswith("experts"), name
        assert_close_to_scale(got[name], p.grad, name=f"grad {name}")  # sums over routes, reordered


def test_forced_routing_tuple_and_callable():
    moe = _moe(21)
    N, H, E = 9, 64, moe.router.num_experts
    x = torch.randn(N, H)
    indices = torch.randint(0, E, (N, 3), generator=torch.Generator().manual_seed(fresh_seed(22)))
    weights = torch.rand(N, 3, generator=torch.Generator().manual_seed(fresh_seed(23)))
    shared = moe.shared_expert(x)
    expected = reference_experts_forward(x, indices, weights, moe.experts.w1, moe.experts.w2, moe.experts.w3)
    moe.forced_routing = (indices, weights)
    assert_close(moe(x.view(1, N, H)).view(N, H) - shared, expected, rtol=1e-5, atol=1e-5)
    moe.forced_routing = lambda t: (indices[: t.shape[0]], weights[: t.shape[0]])
    assert_close(moe(x.view(3, 3, H)).view(N, H) - shared, expected, rtol=1e-5, atol=1e-5)
    assert_bitwise_equal(moe.router.tokens_per_expert, 2 * torch.bincount(indices.flatten(), minlength=E).float())
    moe.forced_routing = (indices[:4], weights[:4])
    with pytest.raises(ValueError, match="forced_routing"):
        moe(x.view(1, N, H))
    moe.forced_routing = (indices + E, weights)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        moe(x.view(1, N, H))


def test_bias_changes_selection_not_gate_weights():
    torch.manual_seed(fresh_seed(31))
    router = TopKRouter(16, num_experts=6, top_k=2, score_func="sigmoid", route_norm=True, route_scale=1.7)
    scores = router.scores(torch.randn(50, 16))                               # [N, E]
    idx0, w0 = router.select(scores)
    router.expert_bias.fill_(0.25)                                            # uniform shift: nothing moves
    idx_shift, w_shift = router.select(scores)
    assert_bitwise_equal(idx_shift, idx0)
    assert_bitwise_equal(w_shift, w0)
    router.expert_bias.zero_()
    router.expert_bias[5] = 10.0                                              # expert 5 now always selected
    idx1, w1 = router.select(scores)
    assert (idx1 == 5).any(dim=1).all() and not torch.equal(idx1, idx0)
    picked = scores.gather(1, idx1)                                           # unbiased scores of the picks
    assert_close(w1, 1.7 * picked / picked.sum(1, keepdim=True), rtol=1e-6, atol=1e-7)
    router.route_norm = False
    idx2, w2 = router.select(scores)
    assert_bitwise_equal(idx2, idx1)
    assert_bitwise_equal(w2, scores.gather(1, idx1) * 1.7)


def _imbalance(load: torch.Tensor) -> float:
    return float(load.max() / load.mean())


def test_bias_updates_balance_a_skewed_batch():
    torch.manual_seed(fresh_seed(41))
    model = zoo.build_model("debug")
    moes = model.moe_layers()
    x = torch.randn(256, 64) + 1.0                      # a shared offset along which experts 0, 1 are hot
    with torch.no_grad():
        for moe in moes:
            moe.router.gate.weight.normal_(0, 0.1)
            moe.router.gate.weight[:2] += 0.03
    history, first = [], None
    for _ in range(60):
        with torch.no_grad():
            for moe in moes:
                moe.router.record_load(moe.router(x)[0])
        loads = model.update_router_biases(rate=0.01)                         # [L_moe, E]
        first = loads.clone() if first is None else first
        history.append(max(_imbalance(load) for load in loads))
        assert not any(moe.router.tokens_per_expert.any() for moe in moes)
    assert history[0] > 2.5, history[0]
    assert max(history[-10:]) < 1.5, history
    # The most loaded expert at the start ends below every expert that started under the mean.
    for moe, load in zip(moes, first):
        bias = moe.router.expert_bias
        assert bias[int(load.argmax())] < bias[load < load.mean()].min(), (load, bias)


def test_update_router_biases_reduce_fn_and_state_dict():
    torch.manual_seed(fresh_seed(51))
    model = zoo.build_model("debug")
    model(torch.randint(0, 2048, (2, 8)))
    counted = [moe.router.tokens_per_expert.clone() for moe in model.moe_layers()]
    assert all(c.sum() == 2 * 8 * 2 for c in counted)                          # N * k routes per layer
    seen = []

    def reduce_fn(loads):                                                     # stands in for an all-reduce
        seen.append(loads.clone())
        loads.copy_(torch.arange(8.0).expand_as(loads))

    model.update_router_biases(0.1, reduce_fn=reduce_fn)
    assert_bitwise_equal(seen[0], torch.stack(counted))
    expected = 0.1 * torch.sign(3.5 - torch.arange(8.0))
    for moe in model.moe_layers():
        assert_bitwise_equal(moe.router.expert_bias, expected)

    state = model.state_dict()
    assert "layers.1.moe.router.expert_bias" in state
    assert not any("tokens_per_expert" in key for key in state)
    torch.manual_seed(fresh_seed(52))
    fresh = zoo.build_model("debug")
    fresh.load_state_dict(state)
    assert_bitwise_equal(fresh.layers["2"].moe.router.expert_bias, expected)
    fresh.to(torch.bfloat16)                                                  # bias keeps fp32 and its bits
    assert_bitwise_equal(fresh.layers["2"].moe.router.expert_bias, expected)


def test_aux_loss_value_and_gradient():
    router = TopKRouter(4, num_experts=2, top_k=1)
    scores = torch.tensor([[0.9, 0.1], [0.6, 0.4]])
    indices = torch.tensor([[0], [0]])
    # f = [1, 0], P = [0.75, 0.25]: coef * E * sum f * P = 0.1 * 2 * 0.75
    assert_close(router.aux_loss(scores, indices, 0.1), torch.tensor(0.15))

    torch.manual_seed(fresh_seed(61))
    tokens = torch.randint(0, 2048, (2, 8))
    off = zoo.build_model("debug")
    off(tokens)
    assert off.aux_loss().item() == 0.0 and all(m.last_aux_loss is None for m in off.moe_layers())
    torch.manual_seed(fresh_seed(61))
    on = zoo.build_model(replace(zoo.get_model_args("debug"), aux_loss_coef=0.01))
    on(tokens)
    parts = [m.last_aux_loss for m in on.moe_layers()]
    assert len(parts) == 2 and all(p > 0 for p in parts)
    assert_close(on.aux_loss(), parts[0] + parts[1])
    on.aux_loss().backward()
    assert all(m.router.gate.weight.grad.abs().sum() > 0 for m in on.moe_layers())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_counts_routes_once(use_reentrant):
    torch.manual_seed(fresh_seed(71))
    model = zoo.build_model(replace(zoo.get_model_args("debug"), aux_loss_coef=0.01))
    block, moe = model.layers["1"], model.layers["1"].moe
    x = torch.randn(2, 6, 64, requires_grad=True)
    rope = rope_cos_sin(torch.arange(6), model.rope_inv_freq)
    out = torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=use_reentrant)
    counts, aux = moe.router.tokens_per_expert.clone(), moe.last_aux_loss
    assert counts.sum() == 2 * 6 * 2
    out.backward(torch.randn_like(out))
    assert_bitwise_equal(moe.router.tokens_per_expert, counts)
    assert moe.last_aux_loss is aux


def test_aux_loss_gradient_through_checkpoint():
    grads = []
    for mode in ("plain", "non-reentrant", "reentrant"):
        torch.manual_seed(fresh_seed(81))
        model = zoo.build_model(replace(zoo.get_model_args("debug"), aux_loss_coef=0.1))
        block = model.layers["1"]
        x = torch.randn(2, 6, 64, requires_grad=True, generator=torch.Generator().manual_seed(fresh_seed(82)))
        rope = rope_cos_sin(torch.arange(6), model.rope_inv_freq)
        out = (block(x, rope) if mode == "plain"
               else torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=mode == "reentrant"))
        if mode == "reentrant":
            with pytest.raises(ValueError, match="non-reentrant"):
                model.aux_loss()
            continue
        loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(fresh_seed(83)))).sum() + model.aux_loss()
        loss.backward()
        grads.append((x.grad, block.moe.router.gate.weight.grad))
    for a, b in zip(*grads):
        assert_bitwise_equal(a, b)


def test_bf16_error_no_worse_than_reference_in_bf16():
    moe = _moe(91, n_shared_experts=0)
    N, H, E = 40, 64, moe.router.num_experts
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(fresh_seed(92)))
    indices = torch.randint(0, E, (N, 2), generator=torch.Generator().manual_seed(fresh_seed(93)))
    weights = torch.rand(N, 2, generator=torch.Generator().manual_seed(fresh_seed(94)))
    w = [moe.experts.w1, moe.experts.w2, moe.experts.w3]
    truth = reference_experts_forward(x.double(), indices, weights.double(), *(t.double() for t in w))
    ref_bf16 = reference_experts_forward(x.bfloat16(), indices, weights, *(t.bfloat16() for t in w))
    moe.to(torch.bfloat16)
    moe.forced_routing = (indices, weights)
    ours = moe(x.bfloat16().view(1, N, H)).view(N, H)
    ref_err = (ref_bf16.double() - truth).abs().max()
    assert (ours.double() - truth).abs().max() <= 2 * ref_err + 1e-3, ((ours.double() - truth).abs().max(), ref_err)
