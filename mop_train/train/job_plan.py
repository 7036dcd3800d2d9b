"""A job's memory plan: the per-rank device and host terms of `mop_train.train.plan`, assembled from
a configuration and either the built parts (at launch) or a meta model (`mop-train plan`).

    device_terms, host_terms = run_plans(cfg, layout, parts)          # the launch
    device_terms, host_terms = memory_plans(cfg, world=..., ...)      # on paper

Legend: W ranks, D sequence degree, E_p expert degree, P vocab degree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mop_train.models import zoo
from mop_train.models.keep_attention import kept_attention_bytes
from mop_train.parallel.precision import MixedPrecision
from mop_train.parallel.sharding import local
from mop_train.train.optim import OFFLOAD_ADAMW, parse_device_fraction
from mop_train.train.plan import MemoryPlanInputs, host_memory_plan, memory_plan

if TYPE_CHECKING:
    from mop_train.train.build import ModelParts


def fsdp_block_params(block, kept_out: set[int]) -> int:
    """Parameters FSDP2 all-gathers for one block: all of them but those kept out of it (by id)."""
    return sum(p.numel() for p in block.parameters() if id(p) not in kept_out)


def memory_plans(cfg, *, world: int, total_params: int, largest_block_params: int, checkpointed_layers: int,
                 local_params: int, sco_host_budget: int, precision: MixedPrecision):
    """(device terms, host terms) of one rank (mop_train.train.plan) before the optimizer exists; the
    host terms count OffloadStreamAdamW's state of the local shards not kept on the device (all of
    them while device_fraction = "auto" is unresolved: an upper bound) and SCO's budget. Shared by
    the launch (the built parts) and `mop-train plan` (a meta model)."""
    args, t, D = zoo.get_model_args(cfg.model.flavor), cfg.training, cfg.mop.layout.seq_degree
    offload = cfg.optimizer.name == OFFLOAD_ADAMW
    kept = kept_attention_bytes(args, t.local_batch_size, t.seq_len, D, precision.activation_bytes)
    device_terms = memory_plan(MemoryPlanInputs(
        total_params=total_params, largest_block_params=largest_block_params, world_size=world,
        local_batch=t.local_batch_size, seq_len=t.seq_len, seq_degree=D, hidden=args.dim,
        vocab=args.vocab_size, top_k=args.top_k, n_layers=args.n_layers, checkpointed_layers=checkpointed_layers,
        act_bytes=precision.activation_bytes, loss_chunk=cfg.mop.data.loss_chunk_tokens,
        optimizer_on_device=not offload, sco_host_budget=sco_host_budget,
        kept_attention_per_layer=kept if cfg.mop.attention.keep else 0, local_params=local_params))
    device_share = parse_device_fraction(cfg.mop.offload_adamw.device_fraction)
    host_terms = host_memory_plan(local_params, offload_optimizer=offload,
                                  host_fraction=cfg.mop.offload_adamw.host_fraction,
                                  device_fraction=0.0 if device_share == "auto" else device_share,
                                  sco_host_budget=sco_host_budget)
    return device_terms, host_terms


def run_plans(cfg, layout, parts: ModelParts):
    """`memory_plans` of the built parts: their local shards, what FSDP2 gathers per block (the
    expert shards are kept out of it), SCO's resolved budget."""
    experts = {id(p) for p in parts.expert_params}
    return memory_plans(
        cfg, world=layout.plan.world_size, total_params=zoo.param_counts(cfg.model.flavor)["total"],
        largest_block_params=max(fsdp_block_params(b, experts) for b in parts.module.model.layers.values()),
        checkpointed_layers=len(parts.checkpointed),
        local_params=sum(local(p).numel() for p in parts.module.parameters()),
        sco_host_budget=parts.sco.host_budget_bytes if parts.sco is not None else 0, precision=parts.precision)
