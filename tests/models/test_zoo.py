"""Named configs: exact parameter counts (against a closed form), paper sizes within 3%,
meta-device build speed, the zoo table."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from mop_train.models import MoETransformer, zoo
from mop_train.models.args import MoEModelArgs


def _closed_form(a: MoEModelArgs) -> dict[str, int]:
    """Parameter counts written out from the architecture, independent of the module tree."""
    H = a.dim
    if a.attention == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (H * a.n_heads * qk if a.q_lora_rank == 0
             else H * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.n_heads * qk)
        attn = (q + H * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
                + a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim) + a.n_heads * a.v_head_dim * H)
    else:
        attn = 2 * H * a.n_heads * a.head_dim + 2 * H * a.n_kv_heads * a.head_dim
    expert = 3 * H * a.moe_inter_dim                                   # one routed expert
    moe_common = H * a.num_experts + a.n_shared_experts * expert     # gate + shared expert
    per_block = attn + 2 * H
    total = (2 * a.vocab_size * H + H + a.n_layers * per_block + a.n_dense_layers * 3 * H * a.dense_ffn_dim
             + a.n_moe_layers * (moe_common + a.num_experts * expert))
    active = total - a.n_moe_layers * (a.num_experts - a.top_k) * expert
    return {"total": total, "active": active}


def test_names():
    assert zoo.names() == ["debug", "small", "gpt-oss-20b-shape", "mop-37b", "mop-120b", "mop-241b", "mop-667b"]
    with pytest.raises(ValueError, match="unknown model 'mop-1t'"):
        zoo.get_model_args("mop-1t")


@pytest.mark.parametrize("name", zoo.names())
def test_counts_are_exact(name):
    assert zoo.param_counts(name) == _closed_form(zoo.get_model_args(name))


def test_counts_of_gqa_variant_and_materialised_model():
    args = replace(zoo.get_model_args("debug"), attention="gqa", n_kv_heads=1, head_dim=12, q_lora_rank=8)
    counts = zoo.param_counts(args)
    assert counts == _closed_form(args)
    assert counts["total"] == sum(p.numel() for p in zoo.build_model(args).parameters())


@pytest.mark.parametrize("name,nominal", sorted(zoo.NOMINAL_SIZES.items()))
def test_paper_models_within_three_percent(name, nominal):
    total = zoo.param_counts(name)["total"]
    assert abs(total - nominal) <= 0.03 * nominal, f"{name}: {total / 1e9:.2f}B vs {nominal / 1e9:.0f}B"


def test_paper_shapes():
    for name in ("mop-37b", "mop-120b", "mop-241b", "mop-667b"):
        a = zoo.get_model_args(name)
        assert (a.dim, a.num_experts, a.moe_inter_dim, a.top_k, a.vocab_size, a.dense_ffn_dim) == \
            (7168, 384, 2048, 8, 200_000, 18432)
        assert a.attention == "mla"
    assert [zoo.get_model_args(n).n_layers for n in ("mop-37b", "mop-120b", "mop-241b", "mop-667b")] == [2, 7, 14, 39]
    g = zoo.get_model_args("gpt-oss-20b-shape")
    assert (g.n_layers, g.dim, g.num_experts, g.top_k, g.vocab_size, g.moe_inter_dim) == (24, 2880, 32, 4, 201_088, 2880)
    assert (g.attention, g.n_heads, g.n_kv_heads, g.head_dim) == ("gqa", 64, 8, 64)
    d = zoo.get_model_args("debug")
    assert d.vocab_size == 2048 and d.moe_inter_dim % 4 == 0 and 0 < d.n_dense_layers < d.n_layers
    assert 1e9 < zoo.param_counts("small")["total"] < 6e9


def test_mop_667b_builds_on_meta_in_seconds():
    zoo.build_model("debug", device="meta")   # the first meta init_ imports torch._refs (a one-off ~3 s)
    start = time.perf_counter()
    with torch.device("meta"):
        model = MoETransformer(zoo.get_model_args("mop-667b"))
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, f"{elapsed:.1f}s"
    assert all(p.is_meta for p in model.parameters()) and len(model.layers) == 39


def test_get_model_args_returns_a_copy():
    zoo.get_model_args("debug").dim = 1
    assert zoo.get_model_args("debug").dim == 64


def test_format_table():
    table = zoo.format_table().splitlines()
    assert table[0].split() == ["name", "layers", "hidden", "experts", "top-k", "vocab", "total", "active"]
    assert len(table) == 2 + len(zoo.names())
    for name, line in zip(zoo.names(), table[2:]):
        a, counts = zoo.get_model_args(name), zoo.param_counts(name)
        cells = line.split()
        assert cells[:6] == [name, str(a.n_layers), str(a.dim), str(a.num_experts), str(a.top_k), str(a.vocab_size)]
        scale, unit = (1e9, "B") if counts["total"] >= 1e8 else (1e6, "M")
        assert cells[6] == f"{counts['total'] / scale:.2f}{unit}"
