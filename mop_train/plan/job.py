"""A job's memory plan: the per-rank device and host terms of `mop_train.plan.terms`, assembled from
a configuration and either the built parts (at launch) or a meta model (`mop-train plan`).

    device_terms, host_terms = plan_from_parts(cfg, layout.plan, parts, args, total)   # the launch
    plan = plan_for_config(cfg, world=64, ranks_per_node=8)                            # on paper

Both take this rank's share of the weights the same way: FSDP2 shards the dense weights over W, the
routed experts are sharded over E_p (unless dispatch = "local") and the output projection over P
(P > 1); FSDP2 gathers each of its units' weights but those a MoP group shards: the token embedding
(for its forward), each block, the head (final norm + projection unless P > 1, from the final norm's
forward to the end of the loss's backward), and the root's own (none here; parallel.parallelize).

Legend: W ranks, D sequence degree, E_p expert degree, P vocab degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from mop_train.layout import LayoutPlan, plan_layout
from mop_train.models import zoo
from mop_train.models.args import MoEModelArgs
from mop_train.models.memory import tiling_options
from mop_train.models.model import MoETransformer
from mop_train.ops.moe_dispatch.options import dispatch_options
from mop_train.ops.offload_adamw import OFFLOAD_ADAMW
from mop_train.ops.ring_dtp.memory import ring_dtp_peak_bytes
from mop_train.ops.sco import resolve_host_budget
from mop_train.parallel.parallelize import check_layout_fits, check_titan_parallelism, checkpointed_layer_ids
from mop_train.parallel.precision import MixedPrecision
from mop_train.parallel.sharding import local
from mop_train.plan.terms import (MemoryPlanInputs, OperatorPlan, compute_dtype, host_memory_plan, memory_plan,
                                 vocab_shard_dtype)
from mop_train.units import parse_bytes, parse_device_fraction


class BuiltModel(Protocol):
    """What the launch's plan reads off the built model (mop_train.train.build.ModelParts is one)."""
    module: nn.Module                  # the FSDP root: model + loss
    model: MoETransformer
    sco: object | None                 # SelectiveCheckpointOffload (its host_budget_bytes) or None
    checkpointed: list[int]            # block indices under activation checkpointing
    expert_params: list                # sharded over the expert group, out of FSDP2
    vocab_params: list                 # sharded over the vocab group, out of FSDP2
    precision: MixedPrecision


def fsdp_block_params(block, kept_out: set[int]) -> int:
    """Parameters FSDP2 all-gathers for one block: all of them but those kept out of it (by id)."""
    return sum(p.numel() for p in block.parameters() if id(p) not in kept_out)


def root_unit_params(model) -> list:
    """The parameters outside every block: embeddings, final norm, the output projection."""
    in_blocks = {id(p) for block in model.layers.values() for p in block.parameters()}
    return [p for p in model.parameters() if id(p) not in in_blocks]


def head_unit_params(model) -> list:
    """The parameters of FSDP2's head unit [final norm, output projection] (the projection's whether or
    not a vocab group shards it)."""
    return [*model.norm.parameters(), *model.output.parameters()]


def fsdp_root_params(model, kept_out: set[int]) -> int:
    """Parameters of FSDP2's root unit: those outside every block, the embedding and the head (0 here)."""
    units = {id(p) for p in [*model.tok_embeddings.parameters(), *head_unit_params(model)]}
    return sum(p.numel() for p in root_unit_params(model) if id(p) not in kept_out and id(p) not in units)


def fsdp_head_params(model, kept_out: set[int]) -> int:
    """Parameters FSDP2 gathers for the head unit: the final norm, and the projection unless kept out."""
    return sum(p.numel() for p in head_unit_params(model) if id(p) not in kept_out)


def ring_dtp_plan_schedule(cfg, *, tokens: int, hidden: int, vocab: int, vocab_degree: int, act_bytes: int) -> str:
    """The schedule Ring-DTP will run: "auto" takes grad_in_forward exactly when that schedule's bound
    fits [mop.ring_dtp] memory_budget (as the operator decides at run time, here for N = B*S/D)."""
    rd = cfg.mop.ring_dtp
    if rd.schedule != "auto":
        return rd.schedule
    if rd.memory_budget.strip() == "0" or rd.mode == "move_weights":
        return "recompute"
    budget = parse_bytes(rd.memory_budget, key="mop.ring_dtp.memory_budget")
    weights = cfg.mop.offload_adamw.weights if cfg.optimizer.name == OFFLOAD_ADAMW else "device"
    bound = ring_dtp_peak_bytes(tokens, hidden, vocab, vocab_degree, dtype=compute_dtype(act_bytes),
                                block_size=rd.block_size, schedule="grad_in_forward",
                                token_chunk=rd.token_chunk or None,
                                weight_dtype=vocab_shard_dtype(vocab_degree, weights))
    return "grad_in_forward" if bound <= budget else "recompute"


def operator_plan(cfg, args: MoEModelArgs, *, layout_plan, act_bytes: int, sco_host_budget: int,
                  device_fraction: float, host_init: bool = False) -> OperatorPlan:
    """The operators' settings as the plan needs them, from the job's [mop.*] sections."""
    t, m, rd = cfg.training, cfg.mop.moe, cfg.mop.ring_dtp
    one_step = t.local_batch_size * layout_plan.world_size // layout_plan.seq_degree
    micro_batches = 1 if t.global_batch_size == -1 else max(1, t.global_batch_size // one_step)
    ring = layout_plan.vocab_degree > 1 or rd.enable
    tokens = t.local_batch_size * t.seq_len // layout_plan.seq_degree
    offload = cfg.optimizer.name == OFFLOAD_ADAMW
    return OperatorPlan(
        dispatch=dispatch_options(m.dispatch, m), ring_dtp=ring, ring_dtp_mode=rd.mode, ring_dtp_block_size=rd.block_size,
        ring_dtp_token_chunk=rd.token_chunk or None,
        ring_dtp_schedule=ring_dtp_plan_schedule(cfg, tokens=tokens, hidden=args.dim, vocab=args.vocab_size,
                                                 vocab_degree=layout_plan.vocab_degree, act_bytes=act_bytes)
        if ring else "recompute",
        loss_chunk=cfg.mop.data.loss_chunk_tokens, sco_host_budget=sco_host_budget,
        offload_optimizer=offload, offload_bucket_params=cfg.mop.offload_adamw.bucket_params,
        offload_slots=cfg.mop.offload_adamw.slots, offload_host_share=cfg.mop.offload_adamw.host_fraction > 0,
        offload_device_fraction=device_fraction if offload else 0.0, keep_attention=cfg.mop.attention.keep,
        offload_weights=cfg.mop.offload_adamw.weights if offload else "device",
        offload_gradients=cfg.mop.offload_adamw.gradients if offload else "device",
        offload_weight_window=cfg.mop.offload_adamw.weight_window, micro_batches=micro_batches,
        offload_host_init=host_init, reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
        tiling=tiling_options(cfg.mop.tiling, args, tokens=tokens, act_bytes=act_bytes))


def memory_plans(cfg, args: MoEModelArgs, *, layout_plan, total_params: int, largest_block_params: int,
                 blocks_params: int, root_params: int, first_grad_params: int, checkpointed_layers: int,
                 local_params: int, sco_host_budget: int, precision: MixedPrecision,
                 device_fraction: float | None = None, head_params: int = 0, embedding_params: int = 0):
    """(device terms, host terms) of one rank (mop_train.plan.terms). OffloadStreamAdamW's share kept on
    the device is `device_fraction` when known (the launch resolves "auto" first); otherwise the
    configured number, and for an unresolved "auto" 0 on the device and all of it in the host terms
    (an upper bound there). Shared by the launch (the built parts) and `mop-train plan` (a meta model)."""
    t = cfg.training
    if device_fraction is None:
        configured = parse_device_fraction(cfg.mop.offload_adamw.device_fraction)
        device_fraction = 0.0 if configured == "auto" else configured
    act = precision.activation_bytes
    host_init = host_init_applies(cfg, initialised_whole=total_params <= zoo.HOST_INIT_MAX_PARAMS)
    device_terms = memory_plan(MemoryPlanInputs(
        model=args, world_size=layout_plan.world_size, local_batch=t.local_batch_size, seq_len=t.seq_len,
        total_params=total_params, largest_block_params=largest_block_params, blocks_params=blocks_params,
        root_params=root_params, first_grad_params=first_grad_params, checkpointed_layers=checkpointed_layers, local_params=local_params,
        seq_degree=layout_plan.seq_degree, expert_degree=layout_plan.expert_degree,
        vocab_degree=layout_plan.vocab_degree, act_bytes=act, head_params=head_params,
        embedding_params=embedding_params,
        ops=operator_plan(cfg, args, layout_plan=layout_plan, act_bytes=act, sco_host_budget=sco_host_budget,
                          device_fraction=device_fraction, host_init=host_init)))
    host_terms = host_memory_plan(local_params, offload_optimizer=cfg.optimizer.name == OFFLOAD_ADAMW,
                                  host_fraction=cfg.mop.offload_adamw.host_fraction,
                                  device_fraction=device_fraction, sco_host_budget=sco_host_budget,
                                  weights=cfg.mop.offload_adamw.weights, gradients=cfg.mop.offload_adamw.gradients,
                                  act_bytes=act, host_init=host_init)
    return device_terms, host_terms


def host_init_applies(cfg, *, initialised_whole: bool) -> bool:
    """[mop.offload_adamw] host_init takes effect (mop_train.train.build.init_pieces_to_host): OffloadStreamAdamW
    with weights off the device, and a model initialised by shards (one initialised whole starts on the host)."""
    oa = cfg.mop.offload_adamw
    return (cfg.optimizer.name == OFFLOAD_ADAMW and bool(oa.host_init) and oa.weights != "device"
            and not initialised_whole)


def plan_from_parts(cfg, layout_plan: LayoutPlan, parts: BuiltModel, args: MoEModelArgs, total_params: int,
                    device_fraction: float | None = None):
    """`memory_plans` of the built parts: their local shards, what FSDP2 gathers per block and for the
    root (the expert and vocab shards are kept out of it), SCO's resolved budget."""
    kept_out = {id(p) for p in parts.expert_params + parts.vocab_params}
    model = parts.model
    return memory_plans(
        cfg, args, layout_plan=layout_plan, total_params=total_params,
        largest_block_params=max(fsdp_block_params(b, kept_out) for b in model.layers.values()),
        blocks_params=sum(fsdp_block_params(b, kept_out) for b in model.layers.values()),
        root_params=fsdp_root_params(model, kept_out), head_params=fsdp_head_params(model, kept_out),
        first_grad_params=sum(local(p).numel() for p in head_unit_params(model)),
        embedding_params=model.tok_embeddings.weight.numel(),
        checkpointed_layers=len(parts.checkpointed),
        local_params=sum(local(p).numel() for p in parts.module.parameters()),
        sco_host_budget=parts.sco.host_budget_bytes if parts.sco is not None else 0, precision=parts.precision,
        device_fraction=device_fraction)


def kept_out_of_fsdp(model, layout_plan, *, dispatch: str) -> tuple[list, list]:
    """(routed expert weights, the output projection) that a MoP group shards instead of FSDP2:
    the experts over E_p unless dispatch = "local", the projection over P when P > 1."""
    routed = [p for moe in model.moe_layers() for p in moe.experts.parameters()] if dispatch != "local" else []
    return routed, [model.output.weight] if layout_plan.vocab_degree > 1 else []


def local_param_count(model, layout_plan, *, dispatch: str) -> int:
    """This rank's parameters under the layout: FSDP2 shards the dense weights over W, the routed
    experts are sharded over E_p (unless dispatch = "local"), the output projection over P (P > 1)."""
    routed, projection = (sum(p.numel() for p in ps)
                          for ps in kept_out_of_fsdp(model, layout_plan, dispatch=dispatch))
    dense = sum(p.numel() for p in model.parameters()) - routed - projection
    return (-(-dense // layout_plan.world_size) + -(-routed // layout_plan.expert_degree)
            + -(-projection // layout_plan.vocab_degree))


@dataclass(frozen=True)
class JobPlan:
    """One rank's plan for a job on `world` ranks: device and host terms (name, bytes, formula)."""
    layout: LayoutPlan
    total_params: int
    local_params: int
    micro_batches: int
    compute_dtype: str
    ranks_per_node: int
    device_terms: list[tuple[str, int, str]]
    host_terms: list[tuple[str, int, str]]

    @property
    def device_bytes(self) -> int:
        return sum(b for _, b, _ in self.device_terms)

    @property
    def host_bytes_per_node(self) -> int:
        return sum(b for _, b, _ in self.host_terms) * self.ranks_per_node


def local_head_params(model, layout_plan) -> int:
    """This rank's share of the head unit's parameters (the gradients the loss's backward makes): FSDP2
    shards the final norm (and the projection at P = 1) over W; the projection is sharded over P when P > 1."""
    projection = model.output.weight.numel() if layout_plan.vocab_degree > 1 else 0
    rest = sum(p.numel() for p in head_unit_params(model)) - projection
    return -(-rest // layout_plan.world_size) + -(-projection // layout_plan.vocab_degree)


def plan_for_config(cfg, *, world: int, ranks_per_node: int, host_bytes: int | None = None,
                    args: MoEModelArgs | None = None) -> JobPlan:
    """The job's plan on paper: a meta model under the layout, no process group, no GPU. Raises
    ValueError (with the fix) when the layout or batch do not fit the model. `host_bytes` (per
    node) sizes SCO's "auto" budget; `args` replaces model.flavor's (a variant of that zoo model)."""
    lay, t = cfg.mop.layout, cfg.training
    layout = plan_layout(world, lay.seq_degree, lay.expert_degree, lay.vocab_degree)
    args = zoo.get_model_args(cfg.model.flavor) if args is None else args
    check_layout_fits(layout, t, args)
    micro = check_titan_parallelism(cfg.parallelism, t, data_size=world // lay.seq_degree)
    with torch.device("meta"):
        model = MoETransformer(args)
    routed, projection = kept_out_of_fsdp(model, layout, dispatch=cfg.mop.moe.dispatch)
    kept_out = {id(p) for p in routed + projection}                   # sharded by a MoP group, not FSDP2
    precision = MixedPrecision.from_training(t)
    sco_budget = 0 if cfg.mop.sco.host_budget.strip() == "0" else resolve_host_budget(
        cfg.mop.sco.host_budget, ranks_per_node, available_bytes=host_bytes)
    mine = local_param_count(model, layout, dispatch=cfg.mop.moe.dispatch)
    total = sum(p.numel() for p in model.parameters())
    device_terms, host_terms = memory_plans(
        cfg, args, layout_plan=layout, total_params=total,
        largest_block_params=max(fsdp_block_params(b, kept_out) for b in model.layers.values()),
        blocks_params=sum(fsdp_block_params(b, kept_out) for b in model.layers.values()),
        root_params=fsdp_root_params(model, kept_out), head_params=fsdp_head_params(model, kept_out),
        first_grad_params=local_head_params(model, layout), embedding_params=model.tok_embeddings.weight.numel(),
        checkpointed_layers=len(checkpointed_layer_ids(cfg.activation_checkpoint, args.n_layers)),
        local_params=mine, sco_host_budget=sco_budget, precision=precision)
    return JobPlan(layout, total, mine, micro, str(precision.param_dtype).removeprefix("torch."),
                   ranks_per_node, device_terms, host_terms)
