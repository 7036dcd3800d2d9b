"""Pre-launch memory plan: a term-by-term estimate of one rank's device memory, and the host
memory the offloading operators will pin, checked against what the node has before they allocate.

    terms = memory_plan(MemoryPlanInputs(...))
    print(format_plan(terms))
    host = host_memory_plan(local_params, offload_optimizer=True, host_fraction=0.4, sco_host_budget=b)
    check_host_memory(host, local_ranks=8, available_bytes=available_host_bytes())

Each term is (name, bytes, how it was computed). The estimate is simple on purpose, one line
per live set, so that each operator can replace its own line with its bound:
  parameters   FSDP shard of the fp32 master weights              4 * P / W
  gradients    FSDP shard of the fp32 gradients                   4 * P / W
  optimizer    AdamW's two fp32 moments (0 on device when offloaded)  8 * P / W
  gathered     one block's weights unsharded in the compute dtype, x2 for prefetch
  boundaries   retained checkpoint inputs: L_ckpt * B * S/D * H * act bytes, minus what SCO's
               host budget takes (whole boundaries, greedy in forward order)
  kept attn    attention outputs and log-sum-exps kept across the recompute ([mop.attention] keep)
  block        one block's recomputed activations (rough: 16 * B * S/D * H act bytes + routed copies)
  logits       one chunk of the loss: chunk * V * 4 bytes, x3 (logits, softmax, grad)

Legend: P parameters, W ranks, D sequence degree, L blocks, B local batch, S sequence, H hidden,
V vocab, k top-k. A rank holds B * S/D token positions (Ulysses splits every sequence over D).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class MemoryPlanInputs:
    total_params: int
    """P: every parameter of the model."""
    largest_block_params: int
    """Parameters of the largest decoder block (what FSDP gathers at once)."""
    world_size: int
    local_batch: int
    seq_len: int
    hidden: int
    vocab: int
    top_k: int
    n_layers: int
    checkpointed_layers: int
    """Blocks under activation checkpointing (their inputs are the retained boundaries)."""
    act_bytes: int = 4
    """Bytes per activation / compute-dtype weight element (2 for bf16, 4 for fp32)."""
    loss_chunk: int = 1024
    optimizer_on_device: bool = True
    """False when OffloadStreamAdamW keeps the moments in host memory."""
    sco_host_budget: int = 0
    """SCO host bytes per rank for checkpoint boundaries (0: SCO off)."""
    seq_degree: int = 1
    """D: each rank holds seq_len / D positions of its group's sequences."""
    kept_attention_per_layer: int = 0
    """Bytes one checkpointed layer keeps of its attention (0: keep off)."""
    local_params: int | None = None
    """This rank's parameters: dense / W + routed experts / E_p + the projection / P when it is
    vocab-sharded. None: P / W (everything FSDP-sharded over W)."""


def memory_plan(x: MemoryPlanInputs) -> list[tuple[str, int, str]]:
    """Per-rank device bytes, term by term: [(name, bytes, formula)]."""
    P, W, tokens = x.total_params, x.world_size, x.local_batch * x.seq_len // x.seq_degree
    mine = x.local_params if x.local_params is not None else P // W
    plain_layers = x.n_layers - x.checkpointed_layers
    boundary = tokens * x.hidden * x.act_bytes
    offloaded = min(x.checkpointed_layers, x.sco_host_budget // boundary) if boundary else 0
    return [
        ("parameters", 4 * mine, f"fp32 shards: 4 B x {mine:,} local params"),
        ("gradients", 4 * mine, f"fp32 shards: 4 B x {mine:,} local params"),
        ("optimizer", 8 * mine if x.optimizer_on_device else 0,
         "AdamW moments: 8 B x local params" if x.optimizer_on_device else "moments in host memory"),
        ("gathered", 2 * x.largest_block_params * x.act_bytes, "2 blocks unsharded (prefetch)"),
        ("boundaries", (x.checkpointed_layers - offloaded) * boundary,
         f"{x.checkpointed_layers} checkpointed block inputs of B*S/D*H, {offloaded} offloaded by SCO"),
        ("kept attn", x.checkpointed_layers * x.kept_attention_per_layer,
         f"{x.checkpointed_layers} layers x B*S/D*heads*(d_v*act+4)" if x.kept_attention_per_layer
         else "attention replayed in the recompute"),
        ("block", (max(plain_layers, 1) * 16 + 2 * x.top_k) * tokens * x.hidden * x.act_bytes,
         f"{max(plain_layers, 1)} block(s) of live activations, ~16 B*S/D*H + 2k routed copies"),
        ("logits", 3 * min(x.loss_chunk, tokens) * x.vocab * 4, "one loss chunk: 3 * chunk * V fp32"),
    ]


def host_memory_plan(local_params: int, *, offload_optimizer: bool, host_fraction: float = 0.0,
                     sco_host_budget: int = 0, device_fraction: float = 0.0) -> list[tuple[str, int, str]]:
    """Per-rank host bytes the operators pin: OffloadStreamAdamW's fp32 master and moments of this
    rank's parameters not kept on the device (`device_fraction`; 0 is the upper bound while "auto"
    is unresolved) plus its host share's fp32 gradient buffer, and SCO's boundary budget. Terms
    are 0 for operators that are off."""
    state = share = 0
    streamed = local_params - round(device_fraction * local_params)
    if offload_optimizer:
        from mop_train.ops.offload_adamw.buckets import host_state_bytes
        from mop_train.ops.offload_adamw.host_update import host_share_bytes
        state, share = host_state_bytes(streamed), host_share_bytes(streamed, host_fraction)
    return [
        ("optimizer state", state, f"OffloadStreamAdamW: fp32 master + 2 moments, 12 B x {streamed:,} params "
         f"off the device" if offload_optimizer else "on the device (not offloaded)"),
        ("host share grads", share, f"fp32 gradients of the CPU-updated share ({host_fraction:g})"),
        ("sco boundaries", sco_host_budget, "[mop.sco] host_budget per rank"),
    ]


def check_host_memory(terms: list[tuple[str, int, str]], *, local_ranks: int, available_bytes: int) -> None:
    """Raise ValueError if `local_ranks` ranks of this node, each needing `terms`, exceed the host
    memory available now (read it on every rank before any rank allocates)."""
    per_rank = sum(b for _, b, _ in terms)
    need = per_rank * local_ranks
    if need <= available_bytes:
        return
    parts = ", ".join(f"{name} {b / GIB:.1f} GiB" for name, b, _ in terms if b)
    raise ValueError(
        f"host memory: {local_ranks} rank(s) on this node need {need / GIB:.1f} GiB pinned ({parts} per rank) "
        f"but {available_bytes / GIB:.1f} GiB are available; spread the model over more ranks or nodes, lower "
        "[mop.sco] host_budget or [mop.offload_adamw] host_fraction, or keep the optimizer on the device "
        "(optimizer.name = \"AdamW\")")


def format_plan(terms: list[tuple[str, int, str]], *, title: str = "per-rank memory plan") -> str:
    total = sum(b for _, b, _ in terms)
    width = max(len(n) for n, _, _ in terms)
    lines = [f"{title} (estimate):"]
    lines += [f"  {name:<{width}}  {b / GIB:>10.3f} GiB  {how}" for name, b, how in terms]
    lines.append(f"  {'total':<{width}}  {total / GIB:>10.3f} GiB")
    return "\n".join(lines)
