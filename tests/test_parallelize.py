"""The checks made before the model is built (titan knobs, layout against the model, activation
checkpointing blocks), and `parallelize` applied to the debug model on gloo ranks."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from mop_train.layout import RankLayout, plan_layout
from mop_train.models import zoo
from mop_train.models.keep_attention import attention_cores
from mop_train.models.memory import attention_stage_token_bytes
from mop_train.models.model import MoETransformer
from mop_train.models.moe import FeedForward
from mop_train.ops.moe_dispatch import ExpertDispatch, LLEPOptions, PipelinedLLEPOptions
from mop_train.ops.tiling import TilingOptions
from mop_train.ops.tiling.memory import auto_tile_tokens, swiglu_token_bytes
from mop_train.parallel.apply import dispatch_metrics, moe_blocks
from mop_train.parallel.parallelize import (ParallelizeOptions, apply_activation_checkpointing, check_layout_fits,
                                            check_titan_parallelism, checkpointed_layer_ids, parallelize)
from mop_train.parallel.precision import MixedPrecision
from mop_train.parallel.ulysses import UlyssesAttention
from mop_train.train.loss import LanguageModelLoss
from tests.dist_utils import run_distributed
from tests.utils import fresh_seed

TITAN_KNOBS = ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
               "context_parallel_degree", "expert_parallel_degree")


def _parallelism(**changes):
    return SimpleNamespace(**{**{key: 1 for key in TITAN_KNOBS}, **changes})


def _training(local_batch_size, global_batch_size, dtype="float32"):
    return SimpleNamespace(local_batch_size=local_batch_size, global_batch_size=global_batch_size, dtype=dtype)


def test_titan_parallelism_counts_micro_batches_and_rejects_what_mop_replaces():
    rng = random.Random(fresh_seed(7300))
    for _ in range(20):
        local, data, steps = rng.randint(1, 6), rng.randint(2, 6), rng.randint(1, 5)
        one_step = local * data
        micro_batches = check_titan_parallelism(_parallelism(), _training(local, one_step * steps), data_size=data)
        assert micro_batches == steps and type(micro_batches) is int      # a count the loop iterates over
        assert check_titan_parallelism(_parallelism(), _training(local, one_step), data_size=data) == 1
        assert check_titan_parallelism(_parallelism(), _training(local, -1), data_size=data) == 1
        # Not a whole number of micro-batches (above one of them), and less than one of them.
        for bad in (one_step * steps + rng.randint(1, one_step - 1), rng.randint(1, one_step - 1)):
            with pytest.raises(ValueError, match=rf"training.global_batch_size = {bad}: one micro-batch"):
                check_titan_parallelism(_parallelism(), _training(local, bad), data_size=data)
        knob, value = rng.choice(TITAN_KNOBS), rng.randint(2, 8)
        with pytest.raises(ValueError, match=rf"parallelism.{knob} = {value}: mop_train shards"):
            check_titan_parallelism(_parallelism(**{knob: value}), _training(local, -1), data_size=data)
    with pytest.raises(ValueError, match=r"training.dtype = 'bfloat16': weights and optimizer state"):
        check_titan_parallelism(_parallelism(), _training(2, -1, dtype="bfloat16"), data_size=2)


def _ac(mode, option="2"):
    return SimpleNamespace(mode=mode, selective_ac_option=option)


def test_checkpointed_layer_ids_for_each_mode():
    rng = random.Random(fresh_seed(7301))
    for _ in range(10):
        n_layers, every = rng.randint(2, 12), rng.randint(2, 5)
        assert checkpointed_layer_ids(_ac("none"), n_layers) == []
        assert checkpointed_layer_ids(_ac("full"), n_layers) == list(range(n_layers))
        assert checkpointed_layer_ids(_ac("selective", "1"), n_layers) == list(range(n_layers))
        want = [i for i in range(n_layers) if i % every == 0]      # blocks 0, every, 2 * every, ...
        assert checkpointed_layer_ids(_ac("selective", str(every)), n_layers) == want
    for mode, option in (("selective", "op"), ("selective", "0"), ("bogus", "2"), ("NONE", "2")):
        with pytest.raises(ValueError, match=rf"activation_checkpoint.mode = '{mode}' with selective_ac_option"):
            checkpointed_layer_ids(_ac(mode, option), 4)


def _model_args(n_heads, n_kv_heads, attention, num_experts):
    return SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv_heads, attention=attention, num_experts=num_experts)


def test_layout_fits_names_the_setting_that_does_not_divide():
    D, E_p = 2, 4
    layout = plan_layout(8, D, E_p, 1)
    fits = SimpleNamespace(seq_len=64)
    # Only GQA has its own key/value heads; MLA (and MHA) split the query heads' count.
    check_layout_fits(layout, fits, _model_args(4, 3, "mla", 8))
    with pytest.raises(ValueError, match=r"key/value heads \(3\) must be divisible by mop.layout.seq_degree \(2\)"):
        check_layout_fits(layout, fits, _model_args(4, 3, "gqa", 8))
    with pytest.raises(ValueError, match=r"attention heads \(6\) must be divisible by mop.layout.seq_degree \(4\)"):
        check_layout_fits(plan_layout(8, 4, 1, 1), fits, _model_args(6, 2, "gqa", 8))
    with pytest.raises(ValueError, match=r"training.seq_len \(63\) must be divisible"):
        check_layout_fits(layout, SimpleNamespace(seq_len=63), _model_args(4, 2, "gqa", 8))
    with pytest.raises(ValueError, match=r"expert_degree \(4\) must divide num_experts \(6\); .* one of \[1, 2, 3, 6\]"):
        check_layout_fits(layout, fits, _model_args(4, 2, "gqa", 6))


def test_parallelize_options_follow_the_config():
    rng = random.Random(fresh_seed(7305))
    model_args = replace(zoo.get_model_args("small"), n_layers=rng.randint(4, 12))
    seq_len, seq_degree = 1 << rng.randint(18, 20), 2 ** rng.randint(0, 2)
    every = rng.randint(2, 3)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    for keep, preserve, param, reduce, ffn, block, reshard in (
            (True, False, "float32", "bfloat16", "auto", 0, "never"),
            (False, True, "bfloat16", "float32", 4096, "auto", rng.choice(["default", "always"]))):
        alpha, m, threshold = rng.uniform(1.0, 2.0), rng.randint(1, 512), rng.uniform(1.0, 2.0)
        moe = SimpleNamespace(dispatch="llep", alpha=alpha, min_tokens_per_gemm=m, imbalance_threshold=threshold)
        cfg = SimpleNamespace(
            activation_checkpoint=SimpleNamespace(mode="selective", selective_ac_option=str(every),
                                                  preserve_rng_state=preserve),
            mop=SimpleNamespace(moe=moe, attention=SimpleNamespace(keep=keep),
                                tiling=SimpleNamespace(ffn_tokens=ffn, block_tokens=block),
                                layout=SimpleNamespace(seq_degree=seq_degree)),
            training=SimpleNamespace(mixed_precision_param=param, mixed_precision_reduce=reduce, local_batch_size=1,
                                     seq_len=seq_len),
            compile=SimpleNamespace(enable=False, components=["model", "loss"], backend="inductor"),
            parallelism=SimpleNamespace(fsdp_reshard_after_forward=reshard))
        act = torch.finfo(dtypes[param]).bits // 8
        tokens = seq_len // seq_degree
        auto = dict(ffn_tokens=auto_tile_tokens(swiglu_token_bytes(model_args.dim, model_args.dense_ffn_dim, act),
                                                tokens),
                    block_tokens=auto_tile_tokens(attention_stage_token_bytes(model_args, act), tokens))
        tiling = TilingOptions(**{key: auto[key] if value == "auto" else value
                                  for key, value in (("ffn_tokens", ffn), ("block_tokens", block))})
        assert all(t > 0 for t in auto.values()), auto          # 256K+ tokens of `small` are tiled by "auto"
        assert ParallelizeOptions.from_config(cfg, model_args) == ParallelizeOptions(
            dispatch=LLEPOptions(alpha=alpha, min_tokens_per_gemm=m, imbalance_threshold=threshold),
            keep_attention=keep, checkpointed=tuple(range(0, model_args.n_layers, every)),
            preserve_rng_state=preserve, precision=MixedPrecision(dtypes[param], dtypes[reduce]), tiling=tiling,
            reshard_after_forward=reshard)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class _Wrapped(nn.Module):
    """What the stand-in SCO returns: marks the block it wrapped."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner


def _stack(n):
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): _Block() for i in range(n)})
    return model


def test_activation_checkpointing_wraps_exactly_the_chosen_blocks():
    rng = random.Random(fresh_seed(7302))
    n = 6
    for preserve in (True, False):
        # Block 0 is never chosen: the loop must go on past a block it skips.
        chosen = sorted(rng.sample(range(1, n), 3))
        model = _stack(n)
        blocks = list(model.layers.values())
        apply_activation_checkpointing(model, chosen, preserve_rng_state=preserve)
        for i, (name, layer) in enumerate(model.layers.items()):
            assert name == str(i)
            if i in chosen:
                assert isinstance(layer, CheckpointWrapper) and layer._checkpoint_wrapped_module is blocks[i]
                assert layer.checkpoint_fn.keywords["preserve_rng_state"] is preserve
            else:
                assert layer is blocks[i]
    # With an SCO its wrapper (checkpoint + offload) replaces the plain one.
    model = _stack(n)
    blocks = list(model.layers.values())
    apply_activation_checkpointing(model, chosen, preserve_rng_state=True, sco=SimpleNamespace(wrap=_Wrapped))
    assert [type(m) for m in model.layers.values()] == [_Wrapped if i in chosen else _Block for i in range(n)]
    assert all(model.layers[str(i)].inner is blocks[i] for i in chosen)


def test_dispatch_metrics_sum_and_max_over_moe_layers():
    rng = random.Random(fresh_seed(7303))
    model = nn.Module()
    model.layers = nn.ModuleList()
    stats = []
    for i in range(4):
        layer = nn.Module()
        layer.moe = nn.Module()
        layer.moe.experts = nn.Linear(2, 2)
        if i == 2:      # an MoE layer left local: no dispatch bound, nothing counted
            layer.moe.dispatch = None
        else:
            s = SimpleNamespace(relocated_routes=rng.randint(0, 100), migrated_experts=rng.randint(0, 9),
                       weight_transfer_bytes=rng.randint(0, 10**6), num_chunks=rng.randint(1, 10),
                       last_chunk_max_received=rng.randint(1, 500))
            stats.append(s)
            layer.moe.dispatch = SimpleNamespace(stats=s)
        layer.attention = nn.Module()
        layer.attention.dispatch = "not an MoE"   # has dispatch, no experts
        model.layers.append(layer)
    assert moe_blocks(model) == [layer.moe for layer in model.layers]
    assert dispatch_metrics(model) == {
        "relocated_routes": sum(s.relocated_routes for s in stats),
        "migrated_experts": sum(s.migrated_experts for s in stats),
        "weight_transfer_bytes": sum(s.weight_transfer_bytes for s in stats),
        "num_chunks": max(s.num_chunks for s in stats),
        "max_received_per_chunk": max(s.last_chunk_max_received for s in stats)}
    for layer in model.layers:
        layer.moe.dispatch = None
    assert dispatch_metrics(model) == {}


def _fsdp_group(module):
    return module._get_fsdp_state()._fsdp_param_group


def _check_parallelized(layout, options, sco):
    """`parallelize` on the debug model (meta weights: only where each weight ends up is checked)."""
    args = zoo.get_model_args("debug")
    with torch.device("meta"):
        model = MoETransformer(args)
    module = LanguageModelLoss(model)
    holders = [m for m in model.modules() if isinstance(getattr(m, "sdpa", None), nn.Module)]
    cores = [m.sdpa for m in holders]
    blocks = list(model.layers.values())
    expert_shapes = [[getattr(moe.experts, w).shape for w in ("w1", "w2", "w3")] for moe in moe_blocks(model)]
    output_shape = model.output.weight.shape
    shards = parallelize(module, layout, options, sco=sco)

    # Ulysses over the sequence group only where it has more than one rank (W > 1 in both cases).
    assert holders and attention_cores(model) == cores
    for holder, core in zip(holders, cores):
        if layout.seq_size > 1:
            assert isinstance(holder.sdpa, UlyssesAttention)
            assert holder.sdpa.inner is core and holder.sdpa.group is layout.seq_group
        else:
            assert holder.sdpa is core
    assert all(core.keep is options.keep_attention for core in cores)
    ffns = [m for m in model.modules() if isinstance(m, FeedForward)]
    assert ffns and all(f.tile_tokens == options.tiling.ffn_tokens for f in ffns)
    assert all(b.tile_tokens == options.tiling.block_tokens for b in blocks)

    # Experts: DTensor shards of the whole weights over the expert mesh, out of FSDP, each layer bound
    # to the schedule and the expert group; with no schedule they stay dense weights under FSDP.
    moes = moe_blocks(model)
    assert len(moes) == len(expert_shapes) >= 1
    experts = [getattr(moe.experts, w) for moe in moes for w in ("w1", "w2", "w3")]
    assert [p.shape for p in experts] == [shape for shapes in expert_shapes for shape in shapes]
    if options.dispatch is None:
        assert shards.expert_params == [] and all(moe.dispatch is None for moe in moes)
        assert all(p.device_mesh == layout.mesh for p in experts)
    else:
        assert len(shards.expert_params) == len(experts)
        assert all(a is b for a, b in zip(shards.expert_params, experts))
        assert all(p.device_mesh == layout.expert_mesh for p in experts)
        for moe in moes:
            assert isinstance(moe.dispatch, ExpertDispatch)
            assert moe.dispatch.options == options.dispatch and moe.dispatch.group is layout.expert_group
    weight = model.output.weight
    assert isinstance(weight, DTensor) and weight.shape == output_shape
    if layout.vocab_size > 1:
        assert shards.vocab_params == [weight] and weight.device_mesh == layout.vocab_mesh
    else:
        assert shards.vocab_params == [] and weight.device_mesh == layout.mesh

    # Checkpointed blocks wrapped (by the SCO when given), the others left as they were.
    assert shards.checkpointed == list(options.checkpointed)
    layers = list(model.layers.values())
    for i, (layer, block) in enumerate(zip(layers, blocks)):
        if i not in options.checkpointed:
            assert layer is block
        elif sco is not None:
            assert isinstance(layer, _Wrapped) and layer.inner is block
        else:
            assert isinstance(layer, CheckpointWrapper) and layer._checkpoint_wrapped_module is block
            assert layer.checkpoint_fn.keywords["preserve_rng_state"] is options.preserve_rng_state

    # FSDP2, torchtitan's units: the token embedding, one unit per block and the head [norm, output],
    # over all ranks, in the run's precision, summing gradients; the root holds no parameters. The last
    # block and the head stay unsharded after forward (backward needs them first); the embedding is
    # resharded after forward and not gathered in backward (its backward reads only the token ids).
    assert not isinstance(model, FSDPModule) and isinstance(module, FSDPModule)
    assert _fsdp_group(module) is None
    embedding, head = _fsdp_group(model.tok_embeddings), _fsdp_group(model.norm)
    if isinstance(model.output, FSDPModule):      # the projection in FSDP2 (not a vocab shard): in the head
        assert _fsdp_group(model.output) is head
    for i, unit in enumerate(layers + [model.tok_embeddings, model.norm]):
        assert isinstance(unit, FSDPModule)
        group = _fsdp_group(unit)
        assert group.mesh_info.mesh == layout.mesh
        assert group.mp_policy.param_dtype == options.precision.param_dtype
        assert group.mp_policy.reduce_dtype == options.precision.reduce_dtype
        assert group.gradient_divide_factor == 1.0 and group.force_sum_reduction_for_comms is True
        if i < len(layers):
            assert (group.post_forward_mesh_info is not None) == (i < len(layers) - 1), i
    assert embedding.post_forward_mesh_info is not None and embedding.unshard_in_backward is False
    assert head.post_forward_mesh_info is None and head.unshard_in_backward is True


def _layouts_and_options(world_size, seed):
    rng = random.Random(seed)
    bf16, fp32 = torch.bfloat16, torch.float32
    # Every MoP group of size 2: Ulysses, experts and the projection sharded; plain checkpointing.
    sharded = ParallelizeOptions(dispatch=PipelinedLLEPOptions(token_budget=rng.randint(8, 64)),
                                 keep_attention=True, checkpointed=(0, 2), preserve_rng_state=True,
                                 precision=MixedPrecision(param_dtype=bf16, reduce_dtype=fp32),
                                 tiling=TilingOptions(ffn_tokens=rng.randint(1, 64), block_tokens=rng.randint(1, 64)))
    # Every MoP group of size 1 (FSDP alone over both ranks), local experts, the SCO's wrapper.
    fsdp_only = ParallelizeOptions(dispatch=None, keep_attention=False, checkpointed=(1,), preserve_rng_state=False,
                                   precision=MixedPrecision(param_dtype=fp32, reduce_dtype=bf16))
    return [(plan_layout(world_size, 2, 2, 2), sharded, None),
            (plan_layout(world_size, 1, 1, 1), fsdp_only, SimpleNamespace(wrap=_Wrapped))]


def _parallelize_two_layouts(rank, world_size, seed):
    for plan, options, sco in _layouts_and_options(world_size, seed):
        _check_parallelized(RankLayout.build(plan), options, sco)


@pytest.mark.slow
def test_parallelize_places_every_weight_by_the_layout():
    run_distributed(_parallelize_two_layouts, 2, fresh_seed(7304))
