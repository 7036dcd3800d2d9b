"""The steps that shard a single-device MoE model by the MoP groups: Ulysses attention in the
sequence group, expert weights over the expert group (with the dispatch schedule bound to each MoE
layer), the output projection over the vocab group. `mop_train.parallel.parallelize` runs them in
order, with activation checkpointing and FSDP2.

    apply_sequence_parallel(model, layout.seq_group)
    expert_params = apply_expert_parallel(model, layout.expert_mesh, layout.expert_group, dispatch)
    vocab_params = apply_vocab_parallel(model, layout.vocab_mesh)

All three run on a meta or a materialised model (slicing a materialised model keeps its values,
which is what makes a run layout-invariant). Sharded weights become DTensors [Replicate, Shard(0)]
kept out of FSDP; after backward their gradients are summed over their replica group
(`mop_train.parallel.sharding.reduce_replica_grads`).

Legend: D sequence-group size, E experts, E_p expert-group size, V vocab, P vocab-group size.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from mop_train.ops.moe_dispatch import DispatchOptions, ExpertDispatch
from mop_train.parallel.sharding import shard_rows
from mop_train.parallel.ulysses import UlyssesAttention


def moe_blocks(model: nn.Module):
    """The MoE modules of the decoder, in layer order."""
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "dispatch")]


def apply_sequence_parallel(model: nn.Module, seq_group) -> None:
    """Swap every attention core for its Ulysses wrapper (a no-op for a group of one)."""
    if seq_group is None or dist.get_world_size(seq_group) == 1:
        return
    for module in list(model.modules()):
        core = getattr(module, "sdpa", None)
        if isinstance(core, nn.Module) and not isinstance(core, UlyssesAttention):
            module.sdpa = UlyssesAttention(core, seq_group)


def apply_expert_parallel(model: nn.Module, expert_mesh, expert_group,
                          dispatch: DispatchOptions | None) -> list[nn.Parameter]:
    """Shard each MoE layer's w1/w2/w3 over the expert group and bind it an ExpertDispatch (the
    schedule's options, the group, and stats of its own).

    Returns the sharded parameters (to keep out of FSDP). With `dispatch` None ("local") nothing
    changes: the experts stay dense weights under FSDP.
    """
    if dispatch is None:
        return []
    sharded = []
    for moe in moe_blocks(model):
        for name in ("w1", "w2", "w3"):
            param = shard_rows(getattr(moe.experts, name), expert_mesh)
            setattr(moe.experts, name, param)
            sharded.append(param)
        moe.dispatch = ExpertDispatch(dispatch, expert_group)
    return sharded


def apply_vocab_parallel(model: nn.Module, vocab_mesh) -> list[nn.Parameter]:
    """Shard the output projection [V, H] by rows over the vocab group (for Ring-DTP)."""
    model.output.weight = shard_rows(model.output.weight, vocab_mesh)
    return [model.output.weight]


def dispatch_metrics(model: nn.Module) -> dict:
    """Summed over MoE layers from the last forward: relocated routes, the plan's weight copies
    (owner -> helper, each carrying routes) and their bytes, the largest chunk count K and the
    largest routes any destination received in one chunk (read here: one small device-to-host
    copy per layer, at logging time rather than in the layer)."""
    stats = [m.dispatch.stats for m in moe_blocks(model) if m.dispatch is not None]
    if not stats:
        return {}
    return {"relocated_routes": sum(s.relocated_routes for s in stats),
            "migrated_experts": sum(s.migrated_experts for s in stats),
            "weight_transfer_bytes": sum(s.weight_transfer_bytes for s in stats),
            "num_chunks": max(s.num_chunks for s in stats),
            "max_received_per_chunk": max(s.last_chunk_max_received for s in stats)}
