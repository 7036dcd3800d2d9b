"""A run's parts, built from its configuration, and the plans that describe them at launch.

    parts = build_model(cfg, layout, device)     # zoo model -> MoP layout -> checkpointing -> FSDP2 -> init
    device_terms, host_terms = run_plans(cfg, layout, parts)   # mop_train.train.job_plan
    print(describe_run(cfg, layout, parts, seed, device, host_terms, device_terms))

The model is built on meta, the layout applied (Ulysses cores, expert shards over E_p, the
projection over P), blocks wrapped for activation checkpointing (SCO's wrapper when it has a host
budget), the loss chosen (chunked cross-entropy or Ring-DTP), FSDP2 applied under one
mixed-precision policy, then the weights initialised (whole for small models, so every layout
starts from the same weights; shard by shard for large ones).

Legend: W ranks, D sequence degree, E_p expert degree, P vocab degree, B local batch, S sequence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch

from mop_train.units import parse_bytes
from mop_train.models import zoo
from mop_train.models.keep_attention import keep_attention
from mop_train.models.model import MoETransformer
from mop_train.parallel.apply import apply_expert_parallel, apply_sequence_parallel, apply_vocab_parallel
from mop_train.parallel.precision import MixedPrecision
from mop_train.parallel.sharding import local
from mop_train.train.loss import IGNORE_INDEX, LanguageModelLoss, chunked_cross_entropy_sum
from mop_train.train.parallelize import apply_activation_checkpointing, apply_fsdp
from mop_train.train.plan import format_plan


HOST_INIT_MAX_PARAMS = 2_000_000_000
"""Models up to this size are initialised whole (on the host, then sharded), so every layout
starts from the same weights; larger ones are initialised shard by shard on the device."""


@dataclass
class ModelParts:
    module: LanguageModelLoss          # the FSDP root: model + loss
    model: MoETransformer
    sco: object | None                 # SelectiveCheckpointOffload or None
    checkpointed: list[int]            # block indices under activation checkpointing
    expert_params: list                # DTensors sharded over the expert group (out of FSDP)
    vocab_params: list                 # the projection sharded over the vocab group (out of FSDP)
    init_mode: str                     # "whole" (layout-invariant) or "per-shard"
    precision: MixedPrecision          # one policy for FSDP2's units and the shards kept out of it


def uses_ring_dtp(cfg, layout) -> bool:
    """Ring-DTP is the loss when the projection is sharded (P > 1) or [mop.ring_dtp] enable."""
    return layout.vocab_size > 1 or cfg.mop.ring_dtp.enable


def build_loss_fn(cfg, layout, vocab_size: int):
    """The chunked cross-entropy, or Ring-DTP (`uses_ring_dtp`; same contract)."""
    if not uses_ring_dtp(cfg, layout):
        return partial(chunked_cross_entropy_sum, chunk_size=cfg.mop.data.loss_chunk_tokens)
    from mop_train.ops.ring_dtp import ring_dtp_cross_entropy

    rd, group = cfg.mop.ring_dtp, (layout.vocab_group if layout.vocab_size > 1 else None)
    budget = None if rd.memory_budget.strip() == "0" else parse_bytes(rd.memory_budget,
                                                                        key="mop.ring_dtp.memory_budget")

    def ring_loss(hidden, weight, targets):
        return ring_dtp_cross_entropy(hidden, local(weight), targets, group, vocab_size=vocab_size,
                                      mode=rd.mode, schedule=rd.schedule, memory_budget=budget,
                                      token_chunk=rd.token_chunk or None, ignore_index=IGNORE_INDEX,
                                      reduction="sum", block_size=rd.block_size)
    return ring_loss


def build_model(cfg, layout, device: torch.device) -> ModelParts:
    """Zoo model -> MoP layout (Ulysses, expert and vocab shards) -> checkpointing -> FSDP2 -> init.

    Small models are materialised and initialised whole first (same RNG stream on every rank), so
    the shards are slices of the same weights whatever the layout; large ones stay on meta until
    FSDP has sharded them and are initialised shard by shard.
    """
    args = zoo.get_model_args(cfg.model.flavor)
    whole = zoo.param_counts(cfg.model.flavor)["total"] <= HOST_INIT_MAX_PARAMS
    with torch.device("meta"):
        model = MoETransformer(args)
    if whole:
        model.to_empty(device="cpu")
        model.init_weights(buffer_device="cpu")
        model.to(device)
    apply_sequence_parallel(model, layout.seq_group)
    keep_attention(model, cfg.mop.attention.keep)
    expert_params = apply_expert_parallel(model, layout.expert_mesh, layout.expert_group, cfg.mop.moe)
    vocab_params = apply_vocab_parallel(model, layout.vocab_mesh) if layout.vocab_size > 1 else []
    sco = build_sco(cfg.mop.sco, device)
    checkpointed = apply_activation_checkpointing(model, cfg.activation_checkpoint, sco)
    module = LanguageModelLoss(model, loss_fn=build_loss_fn(cfg, layout, args.vocab_size))
    precision = MixedPrecision.from_training(cfg.training)
    apply_fsdp(module, model, layout.mesh, param_dtype=precision.param_dtype,
               reduce_dtype=precision.reduce_dtype, ignored_params=set(expert_params + vocab_params))
    if not whole:
        module.to_empty(device=device)
        model.init_weights(buffer_device=device)
    return ModelParts(module, model, sco, checkpointed, expert_params, vocab_params,
                      "whole" if whole else "per-shard", precision)


def build_sco(sco_cfg, device: torch.device):
    """A SelectiveCheckpointOffload for a nonzero `[mop.sco] host_budget`, else None."""
    if sco_cfg.host_budget.strip() == "0":
        return None
    try:
        from mop_train.ops.sco import SelectiveCheckpointOffload, resolve_host_budget
    except ImportError as err:
        raise ValueError(f"mop.sco.host_budget = {sco_cfg.host_budget!r} but mop_train.ops.sco is not "
                         f"available ({err}); set it to \"0\"") from None
    budget = resolve_host_budget(sco_cfg.host_budget, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return SelectiveCheckpointOffload(budget, device=device)


def describe_run(cfg, layout, parts: ModelParts, seed: int, device, host_terms, plan) -> str:
    checkpointed = parts.checkpointed
    args, counts = zoo.get_model_args(cfg.model.flavor), zoo.param_counts(cfg.model.flavor)
    t = cfg.training
    micro_batches = 1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * layout.data_size)
    return "\n".join([
        f"model {cfg.model.flavor}: {counts['total']:,} parameters ({counts['active']:,} active per token), "
        f"{args.n_layers} blocks, H={args.dim}, V={args.vocab_size}",
        layout.plan.describe().splitlines()[0],
        f"device {device}, W={layout.plan.world_size}, B={t.local_batch_size}, S={t.seq_len}, "
        f"global batch {micro_batches * t.local_batch_size * layout.data_size} sequences "
        f"({micro_batches} micro-batch{'es' if micro_batches > 1 else ''} per step), "
        f"steps={t.steps}, seed={seed}, checkpointed blocks {checkpointed}, init {parts.init_mode}, "
        f"dispatch {cfg.mop.moe.dispatch}, loss "
        f"{'ring_dtp' if uses_ring_dtp(cfg, layout) else 'chunked cross-entropy'}"
        + (", document mask on" if cfg.mop.data.document_mask else "")
        + (", attention kept across the recompute" if cfg.mop.attention.keep else ""),
        format_plan(plan),
        format_plan(host_terms, title="per-rank pinned host memory")])
