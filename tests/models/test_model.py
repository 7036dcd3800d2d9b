"""MoETransformer: shapes, forward/backward in fp32 and bf16, determinism, meta build, RoPE offsets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mop_train.models import MoETransformer
from mop_train.models.attention import apply_rope, rope_cos_sin, rope_inv_freq
from mop_train.models import zoo
from tests.utils import assert_bitwise_equal, assert_close, fresh_seed

GQA = dict(attention="gqa", n_heads=4, n_kv_heads=2, head_dim=16)
MLA_LORA = dict(attention="mla", q_lora_rank=24)


def _variants():
    debug = zoo.get_model_args("debug")
    return {
        "debug": debug,
        "gqa-softmax": replace(debug, score_func="softmax", route_norm=False, **GQA),
        "mla-qlora-noshared": replace(debug, n_shared_experts=0, n_dense_layers=0, **MLA_LORA),
    }


@pytest.mark.parametrize("variant", list(_variants()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_shapes(variant, dtype):
    args = _variants()[variant]
    torch.manual_seed(fresh_seed(0))
    model = zoo.build_model(args, dtype=dtype)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    hidden = model(tokens)
    assert hidden.shape == (2, 12, args.dim) and hidden.dtype == dtype
    assert torch.isfinite(hidden).all()
    logits = hidden @ model.output.weight.t()                       # [B, S, V]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype, name
        assert torch.isfinite(p.grad).all(), name
    for name, buf in model.named_buffers():                         # balancing state and RoPE stay fp32
        assert buf.dtype == torch.float32, name
    assert_bitwise_equal(model.rope_inv_freq, rope_inv_freq(args.rope_dim, args.rope_theta))


def test_deterministic_under_seed():
    tokens = torch.randint(0, 2048, (2, 10), generator=torch.Generator().manual_seed(fresh_seed(1)))
    runs = []
    for _ in range(2):
        torch.manual_seed(fresh_seed(123))
        model = zoo.build_model("debug")
        hidden = model(tokens)
        hidden.backward(torch.randn(hidden.shape, generator=torch.Generator().manual_seed(fresh_seed(2))))
        runs.append((hidden, model.layers["1"].moe.experts.w1.grad, model.tok_embeddings.weight.grad))
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b)
    torch.manual_seed(fresh_seed(124))
    other = zoo.build_model("debug")
    assert not torch.equal(other.tok_embeddings.weight, zoo.build_model("debug").tok_embeddings.weight)


def test_causal_prefix_matches():
    torch.manual_seed(fresh_seed(3))
    model = zoo.build_model("debug")
    tokens = torch.randint(0, 2048, (1, 16))
    full = model(tokens)
    assert_close(model(tokens[:, :7]), full[:, :7], rtol=1e-5, atol=1e-5, name="prefix")


def test_rope_offset_equals_slice_of_full_sequence():
    inv_freq = rope_inv_freq(8, 10000.0)
    full = rope_cos_sin(torch.arange(4096), inv_freq)
    shard = rope_cos_sin(torch.arange(3000, 3100), inv_freq)
    assert_bitwise_equal(shard, full[3000:3100])
    x = torch.randn(2, 4096, 3, 8)
    assert_bitwise_equal(apply_rope(x[:, 3000:3100], shard), apply_rope(x, full)[:, 3000:3100])
    # Through the model: RoPE sees only relative positions, so a uniform offset changes nothing
    # beyond rounding, while stretched positions do change the output.
    torch.manual_seed(fresh_seed(4))
    model = zoo.build_model("debug")
    tokens = torch.randint(0, 2048, (1, 6))
    assert_bitwise_equal(model(tokens, positions=torch.arange(6)), model(tokens))
    base = model(tokens)
    shifted = (model(tokens, positions=torch.arange(100, 106)) - base).abs().max()
    stretched = (model(tokens, positions=torch.arange(0, 12, 2)) - base).abs().max()
    assert shifted < 1e-6 and stretched > 100 * shifted, (shifted, stretched)


def test_rope_is_a_rotation_of_relative_position():
    # <R(p) q, R(p') k> depends only on p - p'.
    inv_freq = rope_inv_freq(16, 10000.0)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    def dot(p, pk):
        rq = apply_rope(q, rope_cos_sin(torch.tensor([p]), inv_freq).double())
        rk = apply_rope(k, rope_cos_sin(torch.tensor([pk]), inv_freq).double())
        return (rq * rk).sum()
    assert_close(dot(9, 4), dot(105, 100), rtol=1e-5, atol=1e-5)


def test_meta_build_and_init_weights():
    with torch.device("meta"):
        model = MoETransformer(zoo.get_model_args("debug"))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(fresh_seed(0))
    model.init_weights(buffer_device="cpu")
    torch.manual_seed(fresh_seed(0))
    direct = zoo.build_model("debug")
    for (name, a), b in zip(model.state_dict().items(), direct.state_dict().values()):
        assert_bitwise_equal(a, b, name=name)
    assert_bitwise_equal(model.rope_inv_freq, rope_inv_freq(8, 10000.0))
    assert all(not moe.router.tokens_per_expert.any() for moe in model.moe_layers())


def test_interface_layout():
    model = zoo.build_model("debug", device="meta")
    args = model.args
    assert list(model.layers.keys()) == [str(i) for i in range(args.n_layers)]
    assert tuple(model.output.weight.shape) == (args.vocab_size, args.dim) and model.output.bias is None
    for i, block in model.layers.items():
        assert hasattr(block.attention, "sdpa")
        assert hasattr(block, "feed_forward") == (int(i) < args.n_dense_layers)
        assert hasattr(block, "moe") == (int(i) >= args.n_dense_layers)
    moe = model.layers[str(args.n_dense_layers)].moe
    E, I, H = args.num_experts, args.moe_inter_dim, args.dim
    assert tuple(moe.experts.w1.shape) == (E, I, H) and tuple(moe.experts.w2.shape) == (E, H, I)
    assert tuple(moe.experts.w3.shape) == (E, I, H)
    assert moe.dispatch is None                        # every expert here until parallelism binds a dispatch


def test_validate_names_bad_fields():
    good = zoo.get_model_args("debug")
    for bad, field in [(dict(top_k=9), "top_k"), (dict(attention="mqa"), "attention"),
                       (dict(n_kv_heads=3, attention="gqa", n_heads=4), "n_kv_heads"),
                       (dict(qk_rope_head_dim=7), "qk_rope_head_dim"), (dict(n_dense_layers=5), "n_dense_layers"),
                       (dict(score_func="relu"), "score_func"), (dict(dim=0), "dim")]:
        with pytest.raises(ValueError, match=field):
            replace(good, **bad).validate()
    with pytest.raises(ValueError, match="max_seq_len"):
        zoo.build_model(replace(good, max_seq_len=4))(torch.zeros(1, 5, dtype=torch.long))
