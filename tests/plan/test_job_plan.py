"""The memory plan is assembled from the model's and the operators' own byte counts, and those
counts follow what the modules really save for backward (measured here with saved-tensor hooks)."""

import dataclasses

import pytest
import torch

from mop_train.models import zoo
from mop_train.models.attention import rope_cos_sin, rope_inv_freq
from mop_train.models.memory import attention_saved_bytes, ffn_saved_bytes
from mop_train.models.model import TransformerBlock
from mop_train.ops.moe_dispatch.memory import RoutedShapes, device_bound
from mop_train.ops.moe_dispatch.options import EPOptions, LLEPOptions, PipelinedLLEPOptions
from mop_train.ops.moe_dispatch.pipelined_llep import max_received_bound
from mop_train.ops.offload_adamw.buckets import staging_bytes_bound
from mop_train.ops.ring_dtp.memory import ring_dtp_peak_bytes
from mop_train.ops.sco.budget import retained_boundary_bytes
from mop_train.plan.terms import MemoryPlanInputs, OperatorPlan, memory_plan
from tests.utils import fresh_seed


def routed_activation_bytes(options, **shapes):
    """The dispatch bound's (saved, working, how) as a tuple."""
    bound = device_bound(options, RoutedShapes(**shapes))
    return bound.saved, bound.working, bound.how


def _saved_bytes(block, x, rope) -> tuple[int, int]:
    """(bytes of the distinct storages the block saves for backward, of which [.., N, N] attention
    probabilities): parameters and the block input excluded (the boundary is planned on its own)."""
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    seen, n = {}, x.shape[1]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            probs = t.dim() == 4 and tuple(t.shape[-2:]) == (n, n)
            seen[storage.data_ptr()] = (storage.nbytes(), probs or seen.get(storage.data_ptr(), (0, False))[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope)
    return sum(b for b, _ in seen.values()), sum(b for b, probs in seen.values() if probs)


@pytest.mark.parametrize("flavor,q_lora", [("debug", 0), ("debug", 24), ("gpt-oss-20b-shape", 0)])
def test_saved_bytes_follow_the_modules(flavor, q_lora):
    args = zoo.get_model_args(flavor)
    if flavor == "gpt-oss-20b-shape":   # the GQA family at a CPU-sized width
        args = dataclasses.replace(args, dim=96, n_heads=4, n_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
                                   moe_inter_dim=48, dense_ffn_dim=128, n_dense_layers=1, n_layers=2)
    args = dataclasses.replace(args, q_lora_rank=q_lora) if args.attention == "mla" else args
    torch.manual_seed(fresh_seed(11))
    n = 384
    rope = rope_cos_sin(torch.arange(n), rope_inv_freq(args.rope_dim, args.rope_theta))
    for layer in (0, args.n_dense_layers):
        block = TransformerBlock(layer, args)
        block.init_weights()
        x = torch.randn(1, n, args.dim, requires_grad=True)
        total, probs = _saved_bytes(block, x, rope)
        moe = layer >= args.n_dense_layers
        planned = attention_saved_bytes(args, n, 4) + ffn_saved_bytes(args, n, 4, moe=moe)
        if moe:
            planned += routed_activation_bytes(None, tokens=n, hidden=args.dim, inter=args.moe_inter_dim,
                                               top_k=args.top_k, group_size=1, local_experts=args.num_experts,
                                               act_bytes=4)[0]
        # Two CPU-only extras: the math attention's [N, N] probabilities (MLA's unequal head widths; CUDA's
        # kernels save an output and a log-sum-exp, planned) and the composite RMSNorm's normalized input
        # (one H per norm; CUDA's fused kernel keeps only the input and rstd). The rest is one graph.
        norms = (2 + (args.attention == "mla") + (args.attention == "mla" and args.q_lora_rank > 0)) * n * args.dim * 4
        measured = total - probs
        assert 0.9 * (measured - norms) <= planned <= 1.1 * measured, (layer, planned, measured, norms)


def _inputs(**changes) -> MemoryPlanInputs:
    args = zoo.get_model_args("small")
    base = dict(model=args, world_size=2, local_batch=1, seq_len=65536, total_params=3_290_190_336,
                largest_block_params=10_000_000, root_params=300_000_000, checkpointed_layers=args.n_layers,
                first_grad_params=310_000_000, local_params=1_600_000_000, seq_degree=2, expert_degree=2,
                vocab_degree=2, act_bytes=2, ops=OperatorPlan())
    ops = changes.pop("ops", {})
    base.update(changes)
    base["ops"] = dataclasses.replace(OperatorPlan(), **ops)
    return MemoryPlanInputs(**base)


def _terms(x: MemoryPlanInputs) -> dict:
    return {name: (b, how) for name, b, how in memory_plan(x)}


def test_each_operator_line_is_the_operators_bound():
    x = _inputs(ops=dict(offload_optimizer=True, offload_bucket_params=1_000_000, offload_slots=3,
                         offload_device_fraction=0.25, ring_dtp=True, sco_host_budget=3 * 2**30,
                         dispatch=PipelinedLLEPOptions(token_budget=2048, max_chunks=64)))
    terms = _terms(x)
    assert terms["optimizer"][0] == staging_bytes_bound(1_000_000, 3) + round(0.25 * x.local_params) * 8
    tokens = x.seq_len // x.seq_degree
    boundary = tokens * x.model.dim * 2
    # Small tokens count here: the early phases hold every retained boundary plus SCO's two in flight.
    small = _inputs(seq_len=4096, ops=dict(sco_host_budget=4096 * x.model.dim, ring_dtp=True))
    t = _terms(small)
    b = 2048 * small.model.dim * 2
    if "last" not in t["gradients"][1]:
        assert t["boundaries"][0] == retained_boundary_bytes([b] * 12, 4096 * x.model.dim) + 2 * b
    # Ring-DTP's line in the loss phase is its own bound: at P = 2 with the weights on the device the vocab
    # shard is an fp32 master, cast to bf16 inside the loss; kept as bf16 working weights it is not.
    for weights, shard_dtype in (("device", torch.float32), ("bf16", None), ("stream", None)):
        loss_phase = _inputs(seq_len=2048, local_params=10_000, first_grad_params=10_000,
                             ops=dict(ring_dtp=True, offload_weights=weights))
        lt = _terms(loss_phase)
        assert "loss" in lt["gradients"][1]
        assert lt["loss"][0] == ring_dtp_peak_bytes(1024, loss_phase.model.dim, loss_phase.model.vocab_size, 2,
                                                    dtype=torch.bfloat16, weight_dtype=shard_dtype)
    assert boundary > 0


def test_pipelined_llep_bounds_the_chunk_where_ep_grows_with_tokens():
    args = zoo.get_model_args("small")
    common = dict(hidden=args.dim, inter=args.moe_inter_dim, top_k=args.top_k, group_size=4, local_experts=16,
                  act_bytes=2)
    pipelined = PipelinedLLEPOptions(token_budget=4096, max_chunks=1000)
    _, small_chunk, _ = routed_activation_bytes(pipelined, tokens=40_000, **common)
    _, large_chunk, _ = routed_activation_bytes(pipelined, tokens=400_000, **common)
    guaranteed = max_received_bound(4, args.top_k, 4096)
    weight_temp = 16 * args.moe_inter_dim * args.dim
    bound = (guaranteed * (2 * args.dim + 7 * args.moe_inter_dim) + weight_temp) * 2
    # One chunk's routes (k * c_eff per source, c_eff <= c), not N's: ten times the tokens, the same size,
    # within the budget's guarantee E_p * k * c_eff and held by LLEP to max(alpha, threshold) x the mean.
    assert small_chunk <= bound and large_chunk <= bound and large_chunk <= 1.1 * small_chunk
    balanced = (int(1.3 * args.top_k * 4000) + 1024) * (2 * args.dim + 7 * args.moe_inter_dim) + weight_temp
    assert small_chunk == balanced * 2                          # N = 40,000: K = 10 chunks of 4,000
    _, unbalanced, _ = routed_activation_bytes(pipelined, tokens=40_000, **{**common, "group_size": 1})
    assert unbalanced == (args.top_k * 4000 * (2 * args.dim + 7 * args.moe_inter_dim)
                          + weight_temp) * 2                    # one rank: the guarantee itself
    _, ep_small, _ = routed_activation_bytes(EPOptions(), tokens=40_000, **common)
    _, ep_large, _ = routed_activation_bytes(EPOptions(), tokens=400_000, **common)
    assert ep_large == 10 * ep_small
    # LLEP holds a receiver to max(alpha, threshold) x the mean, plus one GEMM's minimum of helper rows.
    _, llep, _ = routed_activation_bytes(LLEPOptions(alpha=1.0, imbalance_threshold=1.5, min_tokens_per_gemm=64),
                                         tokens=40_000, **common)
    assert llep == (int(1.5 * 40_000 * args.top_k) + 64) * args.dim * 2


def test_the_plan_is_the_largest_of_three_moments():
    # Tiny tokens, huge vocabulary: the loss's chunk dominates; many tokens: boundaries and blocks.
    loss = _terms(_inputs(seq_len=2048, local_params=1000, first_grad_params=1000,
                          ops=dict(loss_chunk=1024)))
    assert "at the peak (loss)" in loss["gradients"][1] and loss["loss"][0] == 3 * 1024 * 200_000 * 4
    long = _terms(_inputs(seq_len=1 << 21, local_params=1000, first_grad_params=1000))
    assert "first block backward" in long["gradients"][1] and long["loss"][0] == 0
    assert long["boundaries"][0] == 12 * (1 << 20) * 1536 * 2
    weights = _terms(_inputs(seq_len=2048))
    assert "last block backward" in weights["gradients"][1] and weights["gradients"][0] == 4 * 1_600_000_000
    # Ulysses: a rank holds S/D positions, so activation terms halve from D=1 to D=2.
    d1 = _terms(_inputs(seq_len=1 << 20, seq_degree=1, local_params=1000, first_grad_params=1000))
    d2 = _terms(_inputs(seq_len=1 << 20, seq_degree=2, local_params=1000, first_grad_params=1000))
    assert d2["boundaries"][0] * 2 == d1["boundaries"][0] and d2["block"][0] * 2 == d1["block"][0]
    kept = _terms(_inputs(seq_len=1 << 20, local_params=1000, first_grad_params=1000, ops=dict(keep_attention=True)))
    assert kept["kept attn"][0] == 12 * (1 << 19) * 16 * (128 * 2 + 4)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_keep_moves_the_kept_bytes_of_checkpointed_blocks_only(tiled):
    """A block that is not checkpointed holds its attention output and log-sum-exp all step, kept or
    saved: keep changes its bytes nowhere. A checkpointed one's move from its recompute into `kept attn`."""
    from mop_train.ops.tiling import TilingOptions
    tiling = dict(tiling=TilingOptions(block_tokens=8192, ffn_tokens=8192)) if tiled else {}
    n = zoo.get_model_args("small").n_layers
    for ckpt in (0, 3, n):
        shape = dict(seq_len=1 << 19, local_params=1000, first_grad_params=1000, checkpointed_layers=ckpt)
        plain, kept = (memory_plan(_inputs(**shape, ops=dict(keep_attention=keep, **tiling))) for keep in (False, True))
        by_name = [{name: b for name, b, _ in plan} for plan in (plain, kept)]
        per_layer = by_name[1]["kept attn"] // ckpt if ckpt else 0
        assert by_name[1]["kept attn"] == ckpt * per_layer
        if ckpt == 0:
            assert by_name[0] == by_name[1]
        else:
            # the early phases: every checkpointed block's kept bytes, less the one block in backward's
            total = [sum(b for name, b in lines.items() if name != "startup") for lines in by_name]
            assert total[1] - total[0] == (ckpt - 1) * per_layer


def test_auto_device_share_sees_the_plan_without_the_optimizers_own_line(monkeypatch):
    """fit_device_fraction adds OffloadStreamAdamW's staging and share itself: the free bytes it gets
    must not have them taken off already."""
    from types import SimpleNamespace

    from mop_train.train.optim import free_device_bytes

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=1000))
    terms = [("parameters", 100, ""), ("optimizer", 300, ""), ("block", 50, "")]
    assert free_device_bytes(terms, "cuda") == 850
    assert free_device_bytes(terms, "cpu") == 0


def _job(config: str, *overrides: str):
    from mop_train.config import load_job_config
    return load_job_config(["--job.config_file", config, *overrides], model_flavors=zoo.names())


def _lines(plan) -> dict:
    return {name: b for name, b, _ in plan.device_terms}


ALL_OPS = ("--mop.moe.dispatch", "pipelined_llep", "--mop.ring_dtp.enable", "--mop.sco.host_budget", "auto",
           "--optimizer.name", "OffloadStreamAdamW")


def test_parameters_and_gradients_lines_follow_the_weights_and_gradients_settings():
    """`small` with every operator at 524K on one rank (issue 32): the parameters line is 4 B, 2 B or the
    windows' slots per setting, the gradients line the staging of what leaves; host terms grow by the
    pinned working copies and gradient buffer."""
    from mop_train.ops.offload_adamw.memory import StreamSettings, WeightShapes, gradients_bound, weights_bound
    from mop_train.plan.job import plan_for_config
    args = zoo.get_model_args("small")
    plans = {}
    for w, g in (("device", "device"), ("bf16", "device"), ("bf16", "stream"), ("stream", "stream")):
        cfg = _job("configs/small_1gpu.toml", "--training.seq_len", "524288", "--training.local_batch_size", "1",
                   *ALL_OPS, "--mop.offload_adamw.weights", w, "--mop.offload_adamw.gradients", g)
        plans[w, g] = plan_for_config(cfg, world=1, ranks_per_node=1, host_bytes=128 * 2**30)
    mine = plans["device", "device"].local_params
    dd, bd, bs, ss = (_lines(plans[k]) for k in plans)
    assert dd["parameters"] == 4 * mine and bd["parameters"] == 2 * mine and dd["gradients"] == 4 * mine
    assert bd["gradients"] == dd["gradients"] and bs["gradients"] < dd["gradients"] / 3
    # stream: 2 slots of the largest block unit (the dense block) and of a MoE layer's experts, bf16
    experts = 3 * args.num_experts * args.moe_inter_dim * args.dim
    with torch.device("meta"):
        dense_block = TransformerBlock(0, args)
    unit = sum(p.numel() for p in dense_block.parameters())
    shapes = WeightShapes(mine, unit, experts, 0, 2)
    assert ss["parameters"] == weights_bound(StreamSettings("stream", "stream", 2), shapes).device_bytes \
        == 2 * (unit + experts) * 2
    assert ss["gradients"] == bs["gradients"] == gradients_bound(
        StreamSettings("stream", "stream"), shapes, device_grads=0, retained_grads=ss["gradients"] - 4 * (2 * unit + experts)
    ).device_bytes
    assert sum(ss.values()) < sum(bd.values()) < sum(dd.values())  # (the peak's moment may move: not their sum)
    host = {k: {name: b for name, b, _ in p.host_terms} for k, p in plans.items()}
    assert host["stream", "stream"]["working weights"] == 2 * mine
    assert host["stream", "stream"]["streamed grads"] == host["bf16", "stream"]["streamed grads"] == 4 * mine
    assert "working weights" not in host["bf16", "stream"] and "streamed grads" not in host["device", "device"]


def test_mop_667b_on_64_ranks_at_1m_plans_under_45_gib_with_streaming():
    """The issue's goal on paper: mop-667b, 64 ranks, 1M tokens, D=16, E_p=64, P=8: stream/stream plans
    <= 45 GiB per rank (from 110.4), and with an explicit SCO budget the node's host fits too."""
    from mop_train.plan.job import plan_for_config
    common = ("configs/mop_667b.toml", "--training.seq_len", "1048576", "--mop.layout.seq_degree", "16",
              "--mop.layout.expert_degree", "64", "--mop.layout.vocab_degree", "8")
    device = plan_for_config(_job(*common), world=64, ranks_per_node=8, host_bytes=2 * 2**40)
    stream = plan_for_config(_job(*common, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients",
                                  "stream", "--mop.sco.host_budget", "40GiB"), world=64, ranks_per_node=8,
                             host_bytes=2 * 2**40)
    assert device.device_bytes > 100 * 2**30 and stream.device_bytes <= 45 * 2**30
    assert stream.host_bytes_per_node <= 2 * 2**40
    assert _lines(stream)["parameters"] + _lines(stream)["gradients"] < 4 * 2**30


def test_the_start_up_peak_is_planned_where_it_exceeds_the_step():
    """Before the first step the device holds every local parameter in fp32 (initialised there) and the
    optimizer's staging; with weights = "stream" at 2 x 4K that is more than the step (measured on one
    H200, 2026-12-01: 13.19 GiB, the plan's step alone 5.90). The "start-up" line lifts the total to it;
    with weights = "device" the step holds the same fp32 shards and the line is 0."""
    from mop_train.ops.offload_adamw.buckets import staging_bytes_bound
    from mop_train.plan.job import plan_for_config
    short = ("configs/small_1gpu.toml", "--training.seq_len", "4096", "--training.local_batch_size", "2", *ALL_OPS)
    plans = {w: plan_for_config(_job(*short, "--mop.offload_adamw.weights", w, "--mop.offload_adamw.gradients",
                                     "stream" if w == "stream" else "device"), world=1, ranks_per_node=1,
                                host_bytes=128 * 2**30) for w in ("device", "bf16", "stream")}
    mine = plans["device"].local_params
    staging = staging_bytes_bound(25_000_000, 3, False)
    for w, extra in (("device", 0), ("bf16", 2 * mine), ("stream", 0)):
        lines = _lines(plans[w])
        step = sum(b for name, b in lines.items() if name != "start-up")
        start = 4 * mine + extra + staging
        assert lines["start-up"] == max(0, start - step) and plans[w].device_bytes == max(start, step), w
    assert _lines(plans["stream"])["start-up"] > 0 and _lines(plans["device"])["start-up"] == 0
    # at 524K the step's own peak is the larger: the line is 0 and the total is the step's
    long = _lines(plan_for_config(_job("configs/small_1gpu.toml", "--training.seq_len", "524288",
                                       "--training.local_batch_size", "1", *ALL_OPS, "--mop.offload_adamw.weights",
                                       "stream", "--mop.offload_adamw.gradients", "stream"),
                                  world=1, ranks_per_node=1, host_bytes=128 * 2**30))
    assert long["start-up"] == 0


def test_a_model_initialised_whole_is_on_the_device_whole_at_start_up():
    """Models up to HOST_INIT_MAX_PARAMS are initialised on the host and moved to the device whole before
    FSDP2 shards them: at W ranks the start-up holds 4 B x every parameter, not x the local shard."""
    from mop_train.ops.offload_adamw.memory import StreamSettings, startup_bound
    whole = startup_bound(StreamSettings(), local_params=1000, optimizer_bytes=0, whole_model_params=4000)
    assert whole.device_bytes == 16_000 and "whole" in whole.how
    local = startup_bound(StreamSettings("bf16"), local_params=1000, optimizer_bytes=500, whole_model_params=0)
    assert local.device_bytes == 4000 + 2000 + 500


def test_host_init_leaves_one_piece_on_the_device_at_start_up():
    """[mop.offload_adamw] host_init: the start-up holds twice the largest piece's local elements (the
    embedding or a block, FSDP2 padding a copy), not every local parameter: `small` at 2 x 4K with
    stream/stream plans the step's peak again (the head unit, projection + final norm, binds the pieces;
    the plan counts the two together, one norm's elements above the projection piece alone)."""
    from mop_train.plan.job import plan_for_config
    args = zoo.get_model_args("small")
    short = ("configs/small_1gpu.toml", "--training.seq_len", "4096", "--training.local_batch_size", "2", *ALL_OPS,
             "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients", "stream")
    off = _lines(plan_for_config(_job(*short), world=1, ranks_per_node=1, host_bytes=128 * 2**30))
    on = plan_for_config(_job(*short, "--mop.offload_adamw.host_init"), world=1, ranks_per_node=1,
                         host_bytes=128 * 2**30)
    assert off["start-up"] > 0 and _lines(on)["start-up"] == 0
    start = next(how for name, _, how in on.device_terms if name == "start-up")
    assert f"2 x 4 B x {args.vocab_size * args.dim + args.dim:,}" in start, start
