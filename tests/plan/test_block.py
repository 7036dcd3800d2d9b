"""The plan's block term with [mop.tiling] (mop_train.plan.block): what a tiled block really saves for
backward (saved-tensor hooks) against the planned bytes, and the plan for `small` at long context."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mop_train.models import zoo
from mop_train.models.attention import rope_cos_sin, rope_inv_freq
from mop_train.models.memory import FP32_BYTES, core_saved_bytes
from mop_train.models.model import TransformerBlock, tile_blocks
from mop_train.ops.bound import DeviceBound
from mop_train.ops.moe_dispatch.memory import RoutedShapes, device_bound
from mop_train.ops.moe_dispatch.options import PipelinedLLEPOptions
from mop_train.ops.tiling import TilingOptions
from mop_train.plan.block import block_bound
from tests.plan.test_job_plan import _saved_bytes
from tests.utils import fresh_seed


@pytest.mark.parametrize("variant", ["mla-qlora", "gqa"])
def test_a_tiled_block_saves_only_the_core_and_the_ffn_norm(variant):
    args = zoo.get_model_args("debug")
    args = dataclasses.replace(args, q_lora_rank=24) if variant == "mla-qlora" else dataclasses.replace(
        args, attention="gqa", n_heads=4, n_kv_heads=2, head_dim=16)
    torch.manual_seed(fresh_seed(3801))
    n, act = 384, 4
    rope = rope_cos_sin(torch.arange(n), rope_inv_freq(args.rope_dim, args.rope_theta))
    for layer in (0, args.n_dense_layers):
        block = TransformerBlock(layer, args)
        block.init_weights()
        tile_blocks(block, 64, 64)
        x = torch.randn(1, n, args.dim, requires_grad=True)
        total, probs = _saved_bytes(block, x, rope)
        moe = layer >= args.n_dense_layers
        planned = core_saved_bytes(args, n, act) + 2 * n * args.dim * act        # core; ffn_norm in and out
        if moe:
            planned += n * args.num_experts * FP32_BYTES + device_bound(None, RoutedShapes(
                tokens=n, hidden=args.dim, inter=args.moe_inter_dim, top_k=args.top_k, group_size=1,
                local_experts=args.num_experts, act_bytes=act)).saved
        # CPU-only: the math attention's [N, N] probabilities and the composite ffn_norm's normalized input.
        measured = total - probs - n * args.dim * act
        assert 0.9 * measured <= planned <= 1.1 * measured, (variant, layer, planned, measured)
        untiled = TransformerBlock(layer, args)
        untiled.load_state_dict(block.state_dict())
        width = args.n_shared_experts * args.moe_inter_dim if moe else args.dense_ffn_dim
        # untiled, the SwiGLU's four F-wide intermediates and the projections' own tensors are saved too
        assert _saved_bytes(untiled, x, rope)[0] - total >= 4 * n * width * act


def _routed(tokens):
    a = zoo.get_model_args("small")
    return device_bound(PipelinedLLEPOptions(), RoutedShapes(tokens=tokens, hidden=a.dim, inter=a.moe_inter_dim,
                                                             top_k=a.top_k, group_size=1,
                                                             local_experts=a.num_experts, act_bytes=2))


def test_the_block_term_shrinks_with_tiles_and_untiled_is_unchanged():
    a, tokens = zoo.get_model_args("small"), 1 << 20
    untiled = block_bound(a, tokens, 2, TilingOptions(), _routed(tokens))
    tiled = block_bound(a, tokens, 2, TilingOptions(20480, 16384), _routed(tokens))
    # Tiling drops at least the dense FFN's h1/h3 (2F per token) from the binding block.
    assert untiled[0] - tiled[0] >= tokens * 2 * a.dense_ffn_dim * 2 and "dense-FFN block" in untiled[2] and "tiled by 16,384" in tiled[2]
    big = block_bound(a, tokens, 2, TilingOptions(tokens, tokens), _routed(tokens))   # one tile: untiled
    assert big == untiled
    none = DeviceBound(0, 0, "none")
    smaller = block_bound(a, tokens, 2, TilingOptions(4096, 4096), none)[0]
    assert smaller <= block_bound(a, tokens, 2, TilingOptions(65536, 65536), none)[0]   # smaller tiles, less


def _small_every_operator(seq_len: int, *extra: str):
    from mop_train.config import load_job_config
    from mop_train.plan.job import plan_for_config

    cfg = load_job_config(["--job.config_file", "configs/small_1gpu.toml", "--training.seq_len", str(seq_len),
                           "--training.local_batch_size", "1", "--mop.moe.dispatch", "pipelined_llep",
                           "--mop.ring_dtp.enable", "--mop.sco.host_budget", "auto",
                           "--optimizer.name", "OffloadStreamAdamW", *extra])
    plan = plan_for_config(cfg, world=1, ranks_per_node=1, host_bytes=128 << 30)
    return sum(b for _, b, _ in plan.device_terms), dict((n, how) for n, _, how in plan.device_terms)


def test_small_at_1m_on_one_h200_fits_on_paper_only_with_tiling():
    """`small`, every operator, one H200 (141 GiB less the 2 GiB headroom), 128 GiB of host memory. With
    keep (K_max 10) the plan does not fit: that step ran out of memory on the H200
    (benchmarks/results/h200_2026-12-01/); with keep, K_max 40 and the weights and gradients streamed it does."""
    budget = (141 - 2) << 30
    tiles = ("--mop.tiling.ffn_tokens", "auto", "--mop.tiling.block_tokens", "auto")
    untiled, _ = _small_every_operator(1 << 20)
    tiled, how = _small_every_operator(1 << 20, *tiles)
    kept, _ = _small_every_operator(1 << 20, *tiles, "--mop.attention.keep")
    streamed, _ = _small_every_operator(1 << 20, *tiles, "--mop.attention.keep", "--mop.moe.max_chunks", "40",
                                        "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients", "stream")
    assert untiled > kept > budget >= streamed and budget >= tiled, (untiled / 2**30, kept / 2**30, tiled / 2**30,
                                                                      streamed / 2**30)
    per_token = core_saved_bytes(zoo.get_model_args("small"), 1, 2)
    assert "attention tiled by" in how["block"] and f"core q, k, v, out, lse {per_token:,} B/token" in how["block"]
