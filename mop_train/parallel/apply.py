"""Apply the MoP layout to a single-device MoE model: Ulysses attention in the sequence group,
expert weights sharded over the expert group, the output projection over the vocab group.

    apply_sequence_parallel(model, layout.seq_group)
    expert_params = apply_expert_parallel(model, layout.expert_mesh, layout.expert_group, cfg.mop.moe)
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

from mop_train.layout import divisors
from mop_train.ops.moe_dispatch import DispatchStats
from mop_train.parallel.sharding import shard_rows
from mop_train.parallel.ulysses import UlyssesAttention, check_heads_divisible

_LLEP_KEYS = ("alpha", "min_tokens_per_gemm", "imbalance_threshold")
_PIPELINED_KEYS = _LLEP_KEYS + ("token_budget", "max_chunks", "membership")


def check_model_fits_layout(args, seq_degree: int, expert_degree: int) -> None:
    """Pre-launch checks of head and expert counts against the degrees (ValueError with the fix)."""
    kv_heads = args.n_kv_heads if args.attention == "gqa" else args.n_heads
    if seq_degree > 1:
        check_heads_divisible(args.n_heads, kv_heads, seq_degree)
    if args.num_experts % expert_degree:
        raise ValueError(f"expert_degree ({expert_degree}) must divide num_experts ({args.num_experts}); "
                         f"set [mop.layout] expert_degree to one of {divisors(args.num_experts)}")


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


def dispatch_options(moe_cfg) -> dict:
    """The `[mop.moe]` options the chosen schedule takes."""
    keys = {"local": (), "ep": (), "llep": _LLEP_KEYS, "pipelined_llep": _PIPELINED_KEYS}[moe_cfg.dispatch]
    return {k: getattr(moe_cfg, k) for k in keys}


def apply_expert_parallel(model: nn.Module, expert_mesh, expert_group, moe_cfg) -> list[nn.Parameter]:
    """Shard each MoE layer's w1/w2/w3 over the expert group and set its dispatch schedule.

    Returns the sharded parameters (to keep out of FSDP). With dispatch "local" nothing changes:
    the experts stay dense weights under FSDP.
    """
    if moe_cfg.dispatch == "local":
        return []
    sharded = []
    for moe in moe_blocks(model):
        for name in ("w1", "w2", "w3"):
            param = shard_rows(getattr(moe.experts, name), expert_mesh)
            setattr(moe.experts, name, param)
            sharded.append(param)
        moe.dispatch = moe_cfg.dispatch
        moe.dispatch_group = expert_group
        moe.dispatch_options = {**dispatch_options(moe_cfg), "stats": DispatchStats()}
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
    stats = [m.dispatch_options["stats"] for m in moe_blocks(model) if "stats" in m.dispatch_options]
    if not stats:
        return {}
    return {"relocated_routes": sum(s.relocated_routes for s in stats),
            "migrated_experts": sum(s.migrated_experts for s in stats),
            "weight_transfer_bytes": sum(s.weight_transfer_bytes for s in stats),
            "num_chunks": max(s.num_chunks for s in stats),
            "max_received_per_chunk": max(s.last_chunk_max_received for s in stats)}
