"""The whole order of parallelisms applied to the MoE decoder, and the checks that precede it.

    check_layout_fits(layout.plan, cfg.training, model_args)       # config time: before anything is built
    micro_batches = check_titan_parallelism(cfg.parallelism, cfg.training, data_size=W // D)
    options = ParallelizeOptions.from_config(cfg, model_args)       # dispatch options, AC blocks, precision
    ...                                                             # model (+ loss) built
    shards = parallelize(module, layout, options, sco=sco)          # module.model is the decoder

`parallelize` applies, in order: Ulysses attention cores over the sequence group; attention kept
across the recompute ([mop.attention] keep); token tiles of the FFNs and attention's row-wise stages
([mop.tiling]); expert shards over the expert group with the dispatch
schedule bound to each MoE layer; the output projection's shard over the vocab group (P > 1);
activation checkpointing of the chosen blocks (non-reentrant: a block's input is the retained
boundary and everything inside is recomputed in backward; with an SCO host budget the block is
wrapped by `SelectiveCheckpointOffload.wrap` instead, which also offloads boundaries to host);
torch.compile of each block and of the loss ([compile]: mop_train/parallel/compile.py); FSDP2
under one MixedPrecision policy. FSDP2 shards the token embedding, each block, and the head (final
norm + output projection) as units of their own over all W ranks (torchtitan's units; `apply_fsdp`
says when each is gathered and reduced); weights sharded by a MoP group (experts over E_p, the
projection over P) stay out of FSDP2. Gradients are summed over ranks,
not averaged: the loop divides the summed token loss by the global token count, so the sum is the
exact gradient of the mean. Each check of the job against the layout and the model is made once, in
the functions above `parallelize`, before the model is built.

Legend: W ranks, D sequence degree, E_p expert degree, P vocab degree.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from mop_train.layout import divisors
from mop_train.models.keep_attention import keep_attention
from mop_train.models.memory import tiling_options
from mop_train.models.model import tile_blocks
from mop_train.ops.moe_dispatch import DispatchOptions, dispatch_options
from mop_train.ops.tiling import TilingOptions
from mop_train.parallel.apply import apply_expert_parallel, apply_sequence_parallel, apply_vocab_parallel
from mop_train.parallel.compile import CompileOptions, apply_compile
from mop_train.parallel.one_rank_reduce import OneRankReduce
from mop_train.parallel.precision import MixedPrecision


def check_layout_fits(layout_plan, training, model_args) -> None:
    """The MoP degrees against the batch and the model, before anything is built: the sequence
    splits over D, so do the query and key/value heads (Ulysses), the experts over E_p. Raises
    ValueError with the fix."""
    D, E_p = layout_plan.seq_degree, layout_plan.expert_degree
    if training.seq_len % D:
        raise ValueError(f"training.seq_len ({training.seq_len}) must be divisible by mop.layout.seq_degree "
                         f"({D}): each rank of a sequence group holds seq_len / D positions")
    kv_heads = model_args.n_kv_heads if model_args.attention == "gqa" else model_args.n_heads
    for name, count in (("attention heads", model_args.n_heads), ("key/value heads", kv_heads)):
        if count % D:
            raise ValueError(f"{name} ({count}) must be divisible by mop.layout.seq_degree ({D}) "
                             f"for Ulysses attention; valid seq_degree values: {divisors(count)}")
    if model_args.num_experts % E_p:
        raise ValueError(f"expert_degree ({E_p}) must divide num_experts ({model_args.num_experts}); "
                         f"set [mop.layout] expert_degree to one of {divisors(model_args.num_experts)}")


def check_titan_parallelism(parallelism, training, *, data_size: int) -> int:
    """torchtitan's own parallelism knobs are not used: the MoP layout ([mop.layout]) replaces them.
    `data_size` is the number of ranks reading distinct sequences (W / D). Returns the micro-batches
    per step: global_batch_size / (local_batch_size x W/D) (torchtitan's rule; 1 for -1)."""
    for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                "context_parallel_degree", "expert_parallel_degree"):
        value = getattr(parallelism, key)
        if value != 1:
            raise ValueError(f"parallelism.{key} = {value}: mop_train shards dense weights with FSDP2 over "
                             f"all ranks and splits sequences/experts/vocab through [mop.layout]; set it to 1")
    one_step = training.local_batch_size * data_size
    if training.global_batch_size != -1 and (training.global_batch_size < one_step
                                             or training.global_batch_size % one_step):
        raise ValueError(f"training.global_batch_size = {training.global_batch_size}: one micro-batch is "
                         f"local_batch_size x W/D = {training.local_batch_size} x {data_size} = {one_step} "
                         f"sequences, and a step accumulates a whole number of them; set it to -1 (no "
                         f"accumulation) or a multiple of {one_step}")
    if training.dtype != "float32":
        raise ValueError(f"training.dtype = {training.dtype!r}: weights and optimizer state stay fp32; "
                         f"use training.mixed_precision_param = \"bfloat16\" for bf16 compute")
    return 1 if training.global_batch_size == -1 else training.global_batch_size // one_step


def checkpointed_layer_ids(ac, n_layers: int) -> list[int]:
    """The blocks `[activation_checkpoint]` wraps: mode "full" (all), "none", or "selective" with an
    integer option N (every N-th block). Raises ValueError for any other setting."""
    if ac.mode == "none":
        return []
    if ac.mode == "full":
        return list(range(n_layers))
    if ac.mode == "selective" and ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1:
        every = int(ac.selective_ac_option)
        return [i for i in range(n_layers) if i % every == 0]
    raise ValueError(f"activation_checkpoint.mode = {ac.mode!r} with selective_ac_option = "
                     f"{ac.selective_ac_option!r} is not supported; use mode \"full\", \"none\", or "
                     f"\"selective\" with an integer option N (checkpoint every N-th block)")


@dataclass(frozen=True)
class ParallelizeOptions:
    """What `parallelize` applies, resolved from the job's config once and checked there, before
    the model is built (so `parallelize` itself meets no bad setting)."""

    dispatch: DispatchOptions | None      # the expert schedule bound to every MoE layer; None: local
    keep_attention: bool                  # [mop.attention] keep
    checkpointed: tuple[int, ...]         # blocks under activation checkpointing (or SCO)
    preserve_rng_state: bool              # [activation_checkpoint] preserve_rng_state
    precision: MixedPrecision             # FSDP2's policy, also followed by the shards kept out of it
    tiling: TilingOptions = TilingOptions()   # [mop.tiling], "auto" resolved for this rank's tokens
    compile: CompileOptions | None = None  # [compile]; None: eager
    reshard_after_forward: str = "default"    # [parallelism] fsdp_reshard_after_forward

    @classmethod
    def from_config(cls, cfg, model_args) -> ParallelizeOptions:
        """From [mop.moe], [mop.attention], [mop.tiling], [activation_checkpoint] and [training]."""
        ac = cfg.activation_checkpoint
        precision = MixedPrecision.from_training(cfg.training)
        tokens = cfg.training.local_batch_size * cfg.training.seq_len // cfg.mop.layout.seq_degree
        return cls(dispatch=dispatch_options(cfg.mop.moe.dispatch, cfg.mop.moe),
                   keep_attention=cfg.mop.attention.keep,
                   tiling=tiling_options(cfg.mop.tiling, model_args, tokens=tokens,
                                                 act_bytes=precision.activation_bytes),
                   checkpointed=tuple(checkpointed_layer_ids(ac, model_args.n_layers)),
                   preserve_rng_state=ac.preserve_rng_state,
                   precision=precision,
                   compile=CompileOptions.from_config(cfg.compile),
                   reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward)


@dataclass
class ParallelizedShards:
    """What `parallelize` leaves the loop: the weights kept out of FSDP2 (their gradients are summed
    over their replica groups after backward) and the checkpointed blocks."""

    expert_params: list[nn.Parameter]     # DTensors sharded over the expert group
    vocab_params: list[nn.Parameter]      # the projection sharded over the vocab group
    checkpointed: list[int]               # block indices under activation checkpointing
    once_a_step_units: list[nn.Module]    # FSDP2 units gathered once a step (`apply_fsdp`'s return)


def parallelize(module: nn.Module, layout, options: ParallelizeOptions, *, sco=None) -> ParallelizedShards:
    """Apply the MoP layout, activation checkpointing and FSDP2 to `module.model` in place, in the
    order of the module docstring.

    Args:
        module: the FSDP2 root, whose `.model` is the decoder and whose forward also uses the projection
            through `model.output()` (mop_train.train.loss.LanguageModelLoss); meta or materialised.
        layout: the RankLayout (groups and meshes).
        options: `ParallelizeOptions.from_config(...)`.
        sco: a `SelectiveCheckpointOffload` that wraps the checkpointed blocks, or None.
    """
    model = module.model
    apply_sequence_parallel(model, layout.seq_group)
    keep_attention(model, options.keep_attention)
    tile_blocks(model, options.tiling.ffn_tokens, options.tiling.block_tokens)
    expert_params = apply_expert_parallel(model, layout.expert_mesh, layout.expert_group, options.dispatch)
    vocab_params = apply_vocab_parallel(model, layout.vocab_mesh) if layout.vocab_size > 1 else []
    apply_activation_checkpointing(model, options.checkpointed, preserve_rng_state=options.preserve_rng_state,
                                   sco=sco)
    if options.compile is not None:
        apply_compile(module, options.compile, device_type=layout.mesh.device_type)
    once = apply_fsdp(module, model, layout.mesh, param_dtype=options.precision.param_dtype,
                      reduce_dtype=options.precision.reduce_dtype, ignored_params=set(expert_params + vocab_params),
                      reshard_after_forward=options.reshard_after_forward)
    return ParallelizedShards(expert_params, vocab_params, list(options.checkpointed), once)


def apply_activation_checkpointing(model: nn.Module, layer_ids, *, preserve_rng_state: bool, sco=None) -> None:
    """Wrap the blocks `layer_ids` of `model.layers` in place: `sco.wrap` (checkpoint + offload of
    the boundary) when an SCO is given, else a non-reentrant checkpoint wrapper."""
    for i, (name, block) in enumerate(list(model.layers.items())):
        if i not in layer_ids:
            continue
        if sco is not None:
            wrapped = sco.wrap(block)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state)
        model.layers.register_module(name, wrapped)


RESHARD_POLICIES = ("default", "always", "never")
"""torchtitan's [parallelism] fsdp_reshard_after_forward values (its llama3/deepseek_v3 `apply_fsdp`)."""


def block_reshard_after_forward(policy: str, index: int, n_blocks: int) -> bool:
    """FSDP2's `reshard_after_forward` for block `index` under torchtitan's policy: "always" reshards every
    block after its forward (and gathers it again in backward), "never" keeps every block unsharded from its
    forward to its backward (one all-gather a block per micro-batch instead of two, at the memory of all
    blocks unsharded through the loss: the plan's `gathered` line), "default" reshards all but the last
    block, which backward needs first (torchtitan's default without pipeline parallelism)."""
    if policy not in RESHARD_POLICIES:
        raise ValueError(f"parallelism.fsdp_reshard_after_forward = {policy!r} must be one of {RESHARD_POLICIES}")
    return {"always": True, "never": False}.get(policy, index < n_blocks - 1)


def apply_fsdp(root: nn.Module, model: nn.Module, mesh, *, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, ignored_params: set | None = None,
               reshard_after_forward: str = "default") -> list[nn.Module]:
    """FSDP2 over `mesh`, units as torchtitan's llama3/deepseek_v3 `apply_fsdp` makes them: the token
    embedding, one unit per block of `model.layers`, the head [final norm, output projection], then
    `root` (which holds `model`; here it keeps no parameters of its own).

    - embedding: gathered for its forward at the start of the step, resharded after it, and never
      gathered in backward (`set_unshard_in_backward(False)`: the embedding's backward reads only the
      token ids); its gradient forms at the end of backward and is reduced in FSDP2's final callback.
    - head: gathered in the final norm's pre-forward, kept for the loss and its backward
      (reshard_after_forward=False, as the last block), resharded and its gradient reduced by the
      post-backward hook on the norm's input, i.e. right after the loss's and the norm's backward,
      before the first block's. `root`'s forward reads the projection through `model.output()`
      (models.model.OutputProjection), so both modules of the unit run forward. A projection kept out
      of FSDP2 (vocab-sharded, P > 1) leaves the norm alone in the unit.
    - blocks: `block_reshard_after_forward(reshard_after_forward, i, L)`, torchtitan's policy. The two
      other units keep their place under every policy, as they must or gain nothing: the head cannot be
      resharded after its forward (its forward hands the loss a view of the projection, which the loss's
      backward reads before FSDP2's pre-backward hook of the unit could gather it again), and the
      embedding is never gathered in backward, so keeping it unsharded would only hold memory.
    Names and values are FSDP2's sharding of each parameter over `mesh` whatever the unit, so state
    dicts and DCP checkpoints are those of a single root unit.
    Returns the units gathered once a step, each named by its first module: [embedding, final norm]
    (weights = "stream" gives them a one-off buffer instead of a block-sized window slot).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ignored = {id(p) for p in ignored_params or ()}
    embedding = fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=True,
                            ignored_params=ignored_params)
    embedding.set_unshard_in_backward(False)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored_params,
                    reshard_after_forward=block_reshard_after_forward(reshard_after_forward, i, len(blocks)))
    head = [model.norm] + ([model.output] if id(model.output.weight) not in ignored else [])
    # the head's output is `output()`, a view of the weight that only the loss reads (never in place):
    # FSDP2's warning about in-place ops on a view returned by a unit does not apply to it
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPRMSNorm, FSDPOutputProjection\) "
                            r"returned a view tensor")
    fully_shard(head, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored_params)
    fully_shard(root, mesh=mesh, mp_policy=mp, ignored_params=ignored_params)
    # Gradients are summed, never averaged (the loss is normalised by the step's global token count). With
    # one rank FSDP2 reduces nothing and already sums; a divide factor there only makes torch 2.11-2.13's
    # foreach_reduce divide each unit's fp32 gradients by 1.0 into a temporary before its copy (one kernel
    # and one unit's gradients of memory per unit: 9 ms of a 289 ms `small` 2 x 4K step on one H100).
    summed_over_ranks = mesh.size() > 1
    for module in root.modules():
        if isinstance(module, FSDPModule):
            if summed_over_ranks:
                module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM/AVG
    if not summed_over_ranks:  # no copy of each unit's gradients from the reduction's input to its output
        for unit in [model.tok_embeddings, *blocks, model.norm]:       # (root holds no parameters)
            unit.set_custom_reduce_scatter(OneRankReduce())
    return [model.tok_embeddings, model.norm]
