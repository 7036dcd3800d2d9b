"""Parallelism applied to the model from outside: per-layer activation checkpointing, FSDP2.

    check_layout_fits(layout.plan, cfg.training, model_args)   # before anything is built
    apply_activation_checkpointing(model, cfg.activation_checkpoint, sco)
    apply_fsdp(train_module, model, layout.mesh, param_dtype=..., reduce_dtype=...,
               ignored_params=expert_and_vocab_shards)

Activation checkpointing wraps each decoder block (non-reentrant): its input is the retained
boundary and everything inside is recomputed in backward. With an SCO host budget the block is
wrapped by `SelectiveCheckpointOffload.wrap` instead, which also offloads boundaries to host.
FSDP2 shards each block as one unit and the root (embeddings, final norm, output projection) as
another, over all W ranks; weights sharded by a MoP group (experts over E_p, the projection
over P; see mop_train.parallel.apply) stay out of FSDP. Gradients are summed over ranks, not averaged: the loop divides the
summed token loss by the global token count, so the sum is the exact gradient of the mean.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def check_layout_fits(layout_plan, training, model_args) -> None:
    """Pre-launch checks of the MoP degrees against the batch and the model (ValueError with the fix)."""
    from mop_train.parallel.apply import check_model_fits_layout

    D = layout_plan.seq_degree
    if training.seq_len % D:
        raise ValueError(f"training.seq_len ({training.seq_len}) must be divisible by mop.layout.seq_degree "
                         f"({D}): each rank of a sequence group holds seq_len / D positions")
    check_model_fits_layout(model_args, D, layout_plan.expert_degree)


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


def _checkpointed_layer_ids(ac, n_layers: int) -> list[int]:
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


def apply_activation_checkpointing(model: nn.Module, ac, sco=None) -> list[int]:
    """Wrap the chosen blocks of `model.layers` in place; return their indices.

    Args:
        ac: the `[activation_checkpoint]` section (mode "full" | "selective" N | "none").
        sco: a `SelectiveCheckpointOffload` or None; when given it wraps the blocks instead.
    """
    ids = _checkpointed_layer_ids(ac, len(model.layers))
    for i, (name, block) in enumerate(list(model.layers.items())):
        if i not in ids:
            continue
        if sco is not None:
            wrapped = sco.wrap(block)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=ac.preserve_rng_state)
        model.layers.register_module(name, wrapped)
    return ids


def apply_fsdp(root: nn.Module, model: nn.Module, mesh, *, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, ignored_params: set | None = None) -> None:
    """FSDP2 over `mesh`: one unit per block of `model.layers`, then `root` (which holds `model`).

    `root` must be the module whose forward also uses `model.output.weight`, so that the root
    unit has every remaining parameter unsharded during its forward.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block is needed again first in backward: keep it unsharded after forward.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1,
                    ignored_params=ignored_params)
    fully_shard(root, mesh=mesh, mp_policy=mp, ignored_params=ignored_params)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM/AVG
