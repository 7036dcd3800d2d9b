"""Named configs: exact parameter counts (against a closed form), paper sizes within 3% and depths
derived from them, gpt-oss-20b's published counts, grouped_mm alignment, meta-device builds that
allocate nothing, the zoo table."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mop_train.models import MoETransformer, zoo
from mop_train.models.args import MoEModelArgs
from mop_train.train.data import EMBEDDED_VOCAB_SIZE


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


# The paper's table (its section 4): what every mop-* model shares; n_layers is derived below.
PAPER_SPEC = dict(dim=7168, num_experts=384, moe_inter_dim=2048, top_k=8, vocab_size=200_000, attention="mla")
# gpt-oss-20b's model card: 20.91B parameters, 3.61B active (the input embedding not counted).
GPT_OSS_20B_TOTAL, GPT_OSS_20B_ACTIVE = 20.91e9, 3.61e9


def test_paper_series_differs_only_in_depth_and_depth_is_derived():
    """The mop-* models are the paper's width at several depths: every other field is equal, and each
    depth is the one whose exact count (counts are affine in n_layers) lands nearest its nominal size."""
    first = zoo.get_model_args("mop-37b")
    assert {k: getattr(first, k) for k in PAPER_SPEC} == PAPER_SPEC
    for name, nominal in zoo.NOMINAL_SIZES.items():
        a = zoo.get_model_args(name)
        assert replace(a, n_layers=first.n_layers) == first, name
        base = _closed_form(replace(a, n_layers=0))["total"]
        per_block = _closed_form(replace(a, n_layers=1))["total"] - base
        nearest = round((nominal - base) / per_block)
        assert a.n_layers == nearest, f"{name}: {a.n_layers} blocks, the nominal size asks for {nearest}"


def test_gpt_oss_shape_matches_the_published_counts():
    a = zoo.get_model_args("gpt-oss-20b-shape")
    counts = zoo.param_counts(a)
    embedding = a.vocab_size * a.dim
    assert abs(counts["total"] - GPT_OSS_20B_TOTAL) <= 0.005 * GPT_OSS_20B_TOTAL, counts   # no biases, no sinks
    assert abs(counts["active"] - embedding - GPT_OSS_20B_ACTIVE) <= 0.01 * GPT_OSS_20B_ACTIVE, counts


@pytest.mark.parametrize("name", zoo.names())
def test_expert_rows_keep_grouped_mm_alignment(name):
    """torch._grouped_mm needs 16-byte rows: every expert weight's row in bf16 (and fp32)."""
    a = zoo.get_model_args(name)
    for width in (a.dim, a.moe_inter_dim):
        assert width * torch.bfloat16.itemsize % 16 == 0, (name, width)


def test_debug_model_fits_the_embedded_tokenizer_and_has_both_block_kinds():
    model = zoo.build_model("debug", device="meta")
    assert model.args.vocab_size == EMBEDDED_VOCAB_SIZE
    kinds = [hasattr(layer, "moe") for layer in model.layers.values()]
    assert False in kinds and True in kinds, kinds                  # dense and MoE blocks both exercised


def test_mop_667b_builds_on_meta_without_storage_or_init():
    """The 668B model is built on meta without touching real memory: every op of the constructor
    runs on meta (no storage anywhere), init_weights never runs, and the count is the exact one."""
    seen = set()

    class Devices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.update(t.device.type for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return out

    def no_init(*args, **kwargs):
        raise AssertionError("init_weights ran while building on meta")

    args = zoo.get_model_args("mop-667b")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MoETransformer, "init_weights", no_init)
        with torch.device("meta"), Devices():
            model = MoETransformer(args)
        assert zoo.build_model(args, device="meta").args == args
    assert seen == {"meta"}
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.is_meta for t in tensors) and len(model.layers) == args.n_layers
    assert sum(p.numel() for p in model.parameters()) == _closed_form(args)["total"]


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
