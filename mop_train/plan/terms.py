"""Pre-launch memory plan: a term-by-term estimate of one rank's device memory, and the host
memory the offloading operators will pin, checked against what the node has before they allocate.

    terms = memory_plan(MemoryPlanInputs(model=args, world_size=8, ..., ops=OperatorPlan(...)))
    print(format_plan(terms))
    host = host_memory_plan(local_params, offload_optimizer=True, host_fraction=0.4, sco_host_budget=b)
    check_host_memory(host, local_ranks=8, available_bytes=available_host_bytes())

Each term is (name, bytes, how it was computed); where an operator is on, its line is the operator's
own bound (`device_bound(settings, shapes) -> DeviceBound`, mop_train.ops.bound), so the plan changes
when the operator does:
  parameters   this rank's fp32 shards                                   4 * local params
  gradients    their fp32 gradients                                      4 * local params
  optimizer    AdamW's moments on the device (8 B / param), or OffloadStreamAdamW's staging
               (offload_adamw.memory.device_bound: staging plus its device share)
  gathered     FSDP2: two blocks unsharded in the compute dtype (prefetch); in the loss also the head
               unit (final norm + projection unless vocab-sharded), gathered from the final norm's
               forward to the end of the loss's backward; the embedding unit only for its forward.
               With [parallelism] fsdp_reshard_after_forward = "never" every block stays unsharded
               from its forward to its backward: all of them at the loss and the first block's backward
  boundaries   checkpointed block inputs B*S/D*H, less what SCO offloads (sco.budget.device_bound)
  kept attn    attention outputs and log-sum-exps kept across the recompute ([mop.attention] keep)
  block        one block in backward (plan.block): what attention and the FFN save (mop_train.models.memory),
               the routed experts' share (moe_dispatch.memory.device_bound of the schedule), the
               gradients alive beside them, one tile of each tiled stage ([mop.tiling]: ops.tiling.memory);
               blocks that are not checkpointed keep theirs all step
  head         the final norm's saved input and output and the fp32 gradient of the hidden states
  loss         chunked cross-entropy: one chunk's logits, softmax and grad (3 * chunk * V fp32); or
               Ring-DTP's bound (ring_dtp.memory.device_bound)

Legend: W ranks, D sequence degree, E_p expert degree, P vocab degree, L blocks, B local batch,
S sequence, H hidden, V vocab, k top-k. A rank holds B * S/D token positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mop_train.models.args import MoEModelArgs
from mop_train.models.keep_attention import kept_attention_bytes
from mop_train.models.zoo import HOST_INIT_MAX_PARAMS
from mop_train.ops.bound import DeviceBound
from mop_train.ops.moe_dispatch import memory as dispatch_memory
from mop_train.ops.moe_dispatch.options import DispatchOptions
from mop_train.ops.offload_adamw import memory as offload_memory
from mop_train.ops.offload_adamw.buckets import host_state_bytes
from mop_train.ops.offload_adamw.host_update import host_share_bytes
from mop_train.ops.ring_dtp import memory as ring_dtp_memory
from mop_train.ops.sco import budget as sco_memory
from mop_train.ops.tiling import TilingOptions
from mop_train.plan.block import block_bound

GIB = 2**30


@dataclass(frozen=True)
class OperatorPlan:
    """The operator settings the plan needs (from [mop.*]; defaults are the operators' own)."""
    dispatch: DispatchOptions | None = None
    """The MoE layers' dispatch options (None: "local"); their settings size the routed line."""
    ring_dtp: bool = False
    ring_dtp_mode: str = "auto"
    ring_dtp_schedule: str = "recompute"
    """Resolved: "auto" plans as "recompute" unless its budget admits grad_in_forward."""
    ring_dtp_block_size: int = 8192
    ring_dtp_token_chunk: int | None = None
    loss_chunk: int = 1024
    sco_host_budget: int = 0
    """SCO host bytes per rank for checkpoint boundaries (0: SCO off)."""
    offload_optimizer: bool = False
    offload_bucket_params: int = 25_000_000
    offload_slots: int = 3
    offload_host_share: bool = False
    offload_device_fraction: float = 0.0
    offload_weights: str = "device"
    """[mop.offload_adamw] weights: "device" (fp32 shards), "bf16" or "stream" (offload_adamw.memory)."""
    offload_gradients: str = "device"
    offload_weight_window: int = 2
    offload_host_init: bool = False     # [mop.offload_adamw] host_init in effect (plan.job.host_init_applies)
    micro_batches: int = 1
    reshard_after_forward: str = "default"
    """[parallelism] fsdp_reshard_after_forward (parallel.parallelize.block_reshard_after_forward)."""
    keep_attention: bool = False
    tiling: TilingOptions = field(default_factory=TilingOptions)
    """[mop.tiling], resolved: token tiles of the FFNs and attention's row-wise stages (0: untiled)."""


@dataclass(frozen=True)
class MemoryPlanInputs:
    model: MoEModelArgs
    world_size: int
    local_batch: int
    seq_len: int
    total_params: int
    """P: every parameter of the model."""
    largest_block_params: int
    """Parameters FSDP2 gathers for the largest decoder block (those kept out of it excluded)."""
    root_params: int
    """Parameters of FSDP2's root unit, unsharded all step: those outside the blocks, the embedding and
    the head (none for MoETransformer; parallel.parallelize.apply_fsdp)."""
    checkpointed_layers: int
    """Blocks under activation checkpointing (their inputs are the retained boundaries)."""
    first_grad_params: int
    """This rank's parameters whose gradients the loss's backward makes, before the first block's: the
    head unit's shard (final norm, the projection unless P > 1) and the vocab shard (P > 1)."""
    local_params: int
    """This rank's parameters: dense / W + routed experts / E_p + the projection / P when sharded."""
    seq_degree: int = 1
    expert_degree: int = 1
    vocab_degree: int = 1
    act_bytes: int = 2
    """Bytes per activation / compute-dtype weight element (2 for bf16, 4 for fp32)."""
    ops: OperatorPlan = field(default_factory=OperatorPlan)
    head_params: int = 0
    """Parameters of FSDP2's head unit (final norm, the projection unless P > 1), unsharded in the loss."""
    embedding_params: int = 0
    """The token embedding's parameters (V x H): its unsharded gradient forms at the end of backward."""
    blocks_params: int = 0
    """Parameters FSDP2 gathers for all decoder blocks together: what stays unsharded through the loss with
    fsdp_reshard_after_forward = "never"."""


def compute_dtype(act_bytes: int) -> torch.dtype:
    return torch.bfloat16 if act_bytes == 2 else torch.float32


def _optimizer_bound(x: MemoryPlanInputs) -> DeviceBound:
    o, mine = x.ops, x.local_params
    if not o.offload_optimizer:
        return DeviceBound(8 * mine, 0, "AdamW moments: 8 B x local params")
    settings = offload_memory.OffloadSettings(o.offload_bucket_params, o.offload_slots, o.offload_host_share,
                                              o.offload_device_fraction)
    # weights = "device": the working weights are FSDP2's fp32 shards, their own masters (8 B per element
    # kept here); otherwise the masters of the share are separate (12 B).
    return offload_memory.device_bound(settings, mine, fp32_weights=o.offload_weights == "device")


def _weight_shapes(x: MemoryPlanInputs) -> offload_memory.WeightShapes:
    """The largest block unit's shard, the largest block kept out of FSDP2 (a MoE layer's expert shards,
    or the vocab shard) and the vocab shard, on this rank."""
    a, o = x.model, x.ops
    experts = (3 * -(-a.num_experts // x.expert_degree) * a.moe_inter_dim * a.dim
               if o.dispatch is not None and a.n_moe_layers else 0)
    vocab = -(-a.vocab_size // x.vocab_degree) * a.dim if x.vocab_degree > 1 else 0
    return offload_memory.WeightShapes(x.local_params, -(-x.largest_block_params // x.world_size),
                                       max(experts, vocab), vocab, x.act_bytes)


def _stream_settings(o: OperatorPlan) -> offload_memory.StreamSettings:
    return offload_memory.StreamSettings(o.offload_weights, o.offload_gradients, o.offload_weight_window)


def _block_term(x: MemoryPlanInputs, tokens: int) -> tuple[int, int, str]:
    """(peak bytes of one checkpointed block in backward, bytes a non-checkpointed block saves, how).

    With keep, a checkpointed block's kept output and log-sum-exp are the plan's `kept attn` line, so
    its peak leaves them out; a block that is not checkpointed holds them all step like any saved
    tensor (kept on its autograd node instead of saved, the same bytes), so its `saved` keeps them,
    and with no block checkpointed keep changes nothing."""
    a, o, act = x.model, x.ops, x.act_bytes
    expert_degree = x.expert_degree if o.dispatch is not None else 1
    routed = dispatch_memory.device_bound(o.dispatch, dispatch_memory.RoutedShapes(
        tokens=tokens, hidden=a.dim, inter=a.moe_inter_dim, top_k=a.top_k, group_size=expert_degree,
        local_experts=a.num_experts // expert_degree, act_bytes=act))
    kept_in_recompute = o.keep_attention and x.checkpointed_layers > 0
    peak, _, how = block_bound(a, tokens, act, o.tiling, routed, keep=kept_in_recompute)
    _, saved, _ = block_bound(a, tokens, act, o.tiling, routed, keep=False)
    return peak, saved, how


def loss_bound(o: OperatorPlan, a: MoEModelArgs, *, tokens: int, vocab_degree: int, act_bytes: int) -> DeviceBound:
    """The loss's working set on a rank of `tokens` tokens: the chunked cross-entropy's, or Ring-DTP's bound
    for its (resolved) schedule."""
    if not o.ring_dtp:  # mop_train.train.loss.chunked_cross_entropy_sum: one chunk's logits, softmax, grad
        return DeviceBound(0, 3 * min(o.loss_chunk, tokens) * a.vocab_size * 4, "one loss chunk: 3 * chunk * V fp32")
    settings = ring_dtp_memory.RingDTPSettings(mode=o.ring_dtp_mode, schedule=o.ring_dtp_schedule,
                                               block_size=o.ring_dtp_block_size, token_chunk=o.ring_dtp_token_chunk)
    return ring_dtp_memory.device_bound(settings, ring_dtp_memory.VocabShapes(
        tokens, a.dim, a.vocab_size, vocab_degree, compute_dtype(act_bytes),
        vocab_shard_dtype(vocab_degree, o.offload_weights)))


def vocab_shard_dtype(vocab_degree: int, offload_weights: str) -> torch.dtype | None:
    """The dtype of the projection Ring-DTP is handed where it is not the compute dtype: at P > 1 the vocab
    shard is kept out of FSDP2 as an fp32 master unless OffloadStreamAdamW keeps it as bf16 working weights
    ("bf16", "stream"); at P = 1 FSDP2 hands over its compute-dtype copy (None)."""
    return torch.float32 if vocab_degree > 1 and offload_weights == "device" else None


PHASES = ("loss", "first block backward", "last block backward", "embedding backward")


def _grads_held(phase: str, x: MemoryPlanInputs) -> str:
    """Which gradients the device holds at `phase` when they stay there (gradients = "device")."""
    head = "the head unit's" + (" and the vocab shard's" if x.vocab_degree > 1 else "")
    return {"loss": f"{head}, formed by the loss's backward",
            "first block backward": f"{head} (reduced after the loss's backward)",
            "last block backward": "every local param (the embedding's forms last)",
            "embedding backward": "every local param, and the embedding's unsharded gradient + fp32 reduce-scatter input",
            }[phase]


def _gathered_how(phase: str, x: MemoryPlanInputs) -> str:
    """What FSDP2 holds unsharded at `phase` (parallel.parallelize.apply_fsdp's units)."""
    blocks = ("every block (fsdp_reshard_after_forward = \"never\": unsharded from its forward to its backward)"
              if _all_blocks_gathered(phase, x) else "2 blocks unsharded (prefetch)")
    how = {"loss": f"{blocks} + the head unit's {x.head_params:,} params (final norm, projection unless "
                   "vocab-sharded)",
           "embedding backward": "none (the embedding is not gathered in backward)"}.get(
        phase, f"{blocks}; the head unit resharded after the loss's backward")
    return how + (f" + the root unit's {x.root_params:,} params" if x.root_params else "")


def _all_blocks_gathered(phase: str, x: MemoryPlanInputs) -> bool:
    """With "never", no block is resharded before its own backward: until the first block's backward has
    run, every block is unsharded (after it, each one's post-backward reshards it: 2 at most, as prefetched)."""
    return x.ops.reshard_after_forward == "never" and phase in ("loss", "first block backward")


def memory_plan(x: MemoryPlanInputs) -> list[tuple[str, int, str]]:
    """Per-rank device bytes at the step's peak, term by term: [(name, bytes, formula)].

    Four moments compete for the peak: the loss (every boundary retained, the loss's working set, the
    head unit gathered and its gradients forming), the first block's backward (still every boundary;
    the head's gradients: FSDP2 reduced them right after the loss's and the norm's backward, and with
    gradients = "stream" they have left), the last block's (all gradients but the embedding's, one
    boundary) and the embedding's backward at the very end (its unsharded gradient and FSDP2's fp32
    reduce-scatter input, nothing else of backward alive). Gradients are allocated by backward and
    freed by zero_grad (or leave as they are final), so they and the boundaries trade places through
    backward; the plan is the largest of the four, and its `gradients` line says which one it is.
    """
    a, o, act, mine = x.model, x.ops, x.act_bytes, x.local_params
    tokens = x.local_batch * x.seq_len // x.seq_degree
    boundary = tokens * a.dim * act
    L_ckpt = x.checkpointed_layers
    boundaries = sco_memory.device_bound(o.sco_host_budget, [boundary] * L_ckpt)
    offloaded = L_ckpt - (boundaries.saved // boundary if boundary else 0)
    kept_layer = kept_attention_bytes(a, 1, tokens, 1, act) if o.keep_attention else 0
    block_peak, block_saved, block_how = _block_term(x, tokens)
    plain_blocks = (a.n_layers - L_ckpt) * block_saved                # not checkpointed: saved all step
    the_loss = loss_bound(o, a, tokens=tokens, vocab_degree=x.vocab_degree, act_bytes=act)
    loss, loss_how = the_loss.device_bytes, the_loss.how
    optimizer_bound = _optimizer_bound(x)
    optimizer, optimizer_how = optimizer_bound.device_bytes, optimizer_bound.how
    head = tokens * a.dim * (2 * act + 4)
    streamed = o.offload_gradients == "stream"
    head_grads = 4 * x.first_grad_params                              # formed by the loss's backward
    # the embedding's own backward: its unsharded gradient (compute dtype), FSDP2's fp32 reduce-scatter
    # input and this rank's fp32 shard of the result (counted in 4 * mine when the gradients stay); at one
    # rank the input is the shard (parallel/one_rank_reduce.py)
    shard = -(-x.embedding_params // x.world_size)
    reduce_input = 4 * x.embedding_params if x.world_size > 1 or streamed else 0
    embedding_grad = x.embedding_params * act + reduce_input + (4 * shard if streamed and x.world_size > 1 else 0)
    blocks_gathered = (2 * x.largest_block_params + x.root_params) * act
    if x.ops.reshard_after_forward == "never" and x.blocks_params < x.largest_block_params:
        raise ValueError(f"MemoryPlanInputs.blocks_params = {x.blocks_params:,} is below the largest block's "
                         f"{x.largest_block_params:,}: pass the sum over every block (plan.job.fsdp_block_params)")
    early_gathered = ((x.blocks_params + x.root_params) * act if _all_blocks_gathered("loss", x)
                      else blocks_gathered)
    early = dict(boundaries=boundaries.device_bytes, kept=L_ckpt * kept_layer)
    candidates = {
        "loss": {**early, "grads": head_grads, "block": plain_blocks, "head": head, "loss": loss,
                 "gathered": early_gathered + x.head_params * act},
        "first block backward": {**early, "grads": 0 if streamed else head_grads, "block": plain_blocks + block_peak,
                                 "head": 0, "loss": 0, "gathered": early_gathered},
        "last block backward": dict(boundaries=boundary if L_ckpt else 0, kept=kept_layer if L_ckpt else 0,
                                    grads=0 if streamed else 4 * mine, block=block_peak, head=0, loss=0,
                                    gathered=blocks_gathered),
        "embedding backward": dict(boundaries=0, kept=0, grads=(0 if streamed else 4 * mine) + embedding_grad,
                                   block=0, head=0, loss=0, gathered=x.root_params * act),
    }
    phase = max(PHASES, key=lambda name: sum(candidates[name].values()))
    at = candidates[phase]
    shapes, stream = _weight_shapes(x), _stream_settings(o)
    weights = offload_memory.weights_bound(stream, shapes)
    grads = offload_memory.gradients_bound(stream, shapes, device_grads=at["grads"], retained_grads=at["grads"],
                                           micro_batches=o.micro_batches)
    grads_how = (f"fp32, at the peak ({phase}): {_grads_held(phase, x)}" if not streamed
                 else f"at the peak ({phase}): {grads.how}")
    gathered_how = _gathered_how(phase, x)
    step = [
        ("parameters", weights.device_bytes, weights.how),
        ("gradients", grads.device_bytes, grads_how),
        ("optimizer", optimizer, optimizer_how),
        ("gathered", at["gathered"], gathered_how),
        ("boundaries", at["boundaries"], "the first block's input, B*S/D*H" if phase == "last block backward"
         else "none: backward is over" if phase == "embedding backward"
         else f"{L_ckpt} checkpointed block inputs of B*S/D*H" + (
             f", {offloaded} offloaded by SCO (2 in flight in backward)" if o.sco_host_budget else "")),
        ("kept attn", at["kept"], "B*S/D*heads*(d_v*act+4) per kept layer" if kept_layer
         else "attention replayed in the recompute"),
        ("block", at["block"], (f"{a.n_layers - L_ckpt} block(s) not checkpointed, saved all step; " if plain_blocks
                                else "") + ("none in backward yet" if phase == "loss" else "none left"
                                            if phase == "embedding backward" else f"one in backward: {block_how}")),
        ("head", at["head"], "final norm input and output, fp32 grad of the hidden states"),
        ("loss", at["loss"], loss_how),
    ]
    return step + [_startup_term(x, stream, optimizer_bound, sum(b for _, b, _ in step))]


def _startup_term(x: MemoryPlanInputs, stream, optimizer_bound: DeviceBound, step_bytes: int):
    """The start-up peak's excess over the step's (0 when the step's is larger), so that the plan's
    total is the process's peak either way."""
    o = x.ops
    shapes = _weight_shapes(x)
    piece = max(shapes.unit_shard + shapes.kept_out_block, -(-x.embedding_params // x.world_size),
                shapes.vocab_shard or -(-x.head_params // x.world_size))
    start = offload_memory.startup_bound(
        stream, local_params=x.local_params,
        optimizer_bytes=optimizer_bound.device_bytes if o.offload_optimizer else 0,
        whole_model_params=x.total_params if x.total_params <= HOST_INIT_MAX_PARAMS else 0,
        piece_params=piece if o.offload_host_init else 0)
    excess = max(0, start.device_bytes - step_bytes)
    gib = 2 ** 30
    verdict = (f"exceeds the step's {step_bytes / gib:.2f} GiB by this" if excess
               else "below the step's peak")
    return ("start-up", excess, f"before the first step {start.device_bytes / gib:.2f} GiB ({start.how}): {verdict}")


def host_memory_plan(local_params: int, *, offload_optimizer: bool, host_fraction: float = 0.0,
                     sco_host_budget: int = 0, device_fraction: float = 0.0, weights: str = "device",
                     gradients: str = "device", act_bytes: int = 2,
                     host_init: bool = False) -> list[tuple[str, int, str]]:
    """Per-rank host bytes the operators pin: OffloadStreamAdamW's fp32 master and moments of this
    rank's parameters not kept on the device (`device_fraction`; 0 is the upper bound while "auto"
    is unresolved) plus its host share's fp32 gradient buffer, and SCO's boundary budget. Terms
    are 0 for operators that are off. With `host_init` the parameters' initial values wait in
    (pageable) host memory beside all of that until the masters take them: a start-up term."""
    state = share = 0
    streamed = local_params - round(device_fraction * local_params)
    if offload_optimizer:
        state = host_state_bytes(streamed)
        # streamed gradients: the CPU share reads them where they landed ("streamed grads" below)
        share = 0 if gradients == "stream" else host_share_bytes(streamed, host_fraction)
    return [
        ("optimizer state", state, f"OffloadStreamAdamW: fp32 master + 2 moments, 12 B x {streamed:,} params "
         f"off the device" if offload_optimizer else "on the device (not offloaded)"),
        ("host share grads", share, f"fp32 gradients of the CPU-updated share ({host_fraction:g})"
         + (": none of its own, it reads the streamed ones" if gradients == "stream" and host_fraction else "")),
        ("sco boundaries", sco_host_budget, "[mop.sco] host_budget per rank"),
    ] + ([("working weights", act_bytes * local_params, f"weights = \"stream\": {act_bytes} B x local params, "
           "the copies each block streams in")] if offload_optimizer and weights == "stream" else []) + (
        [("streamed grads", 4 * local_params, "gradients = \"stream\": 4 B x local params, where they leave to")]
        if offload_optimizer and gradients == "stream" else []) + (
        [("start-up values", 4 * local_params, "host_init: 4 B x local params initialised into host memory, "
          "held until the masters take them (start-up only)")] if offload_optimizer and host_init else [])


_HOST_FIXES = {
    "optimizer state": "keep more of it on the device ([mop.offload_adamw] device_fraction)",
    "host share grads": "lower [mop.offload_adamw] host_fraction",
    "working weights": "keep the working weights on the device ([mop.offload_adamw] weights = \"bf16\")",
    "streamed grads": "keep the gradients on the device ([mop.offload_adamw] gradients = \"device\")",
    "start-up values": "initialise on the device ([mop.offload_adamw] host_init = false)",
}


def host_memory_fix(terms: list[tuple[str, int, str]], *, local_ranks: int, available_bytes: int) -> str:
    """What binds when `local_ranks` ranks needing `terms` each exceed `available_bytes`, and a fix: the
    largest term; when SCO's boundary budget is on and the other terms leave room, the budget that fits
    (SCO's "auto" takes its share of the node before the optimizer and the streams pin theirs);
    otherwise what frees the largest of the others ("" when it fits)."""
    per_rank = sum(b for _, b, _ in terms)
    if per_rank * local_ranks <= available_bytes:
        return ""
    name, biggest, _ = max(terms, key=lambda t: t[1])
    sco = next((b for n, b, _ in terms if n == "sco boundaries"), 0)
    left = available_bytes // local_ranks - (per_rank - sco)    # what the other terms leave SCO per rank
    head = f"the largest host term is {name} ({biggest / GIB:.1f} GiB per rank); "
    if sco and left >= 2**20:
        return head + (f"set [mop.sco] host_budget = \"{left >> 20}MiB\" or less per rank (what the other terms "
                       f"leave of {available_bytes / GIB:.1f} GiB over {local_ranks} ranks), e.g. --mop.sco.host_budget "
                       f"{left >> 20}MiB")
    others = max((t for t in terms if t[0] != "sco boundaries"), key=lambda t: t[1])
    fix = _HOST_FIXES.get(others[0], "lower it")
    return head + (f"without SCO's budget the rest still needs {(per_rank - sco) * local_ranks / GIB:.1f} GiB: "
                   f"{fix} for {others[0]}, or spread the model over more ranks or nodes")


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
        f"but {available_bytes / GIB:.1f} GiB are available; "
        + host_memory_fix(terms, local_ranks=local_ranks, available_bytes=available_bytes)
        + "; or keep the optimizer on the device (optimizer.name = \"AdamW\")")


DEVICE_PLAN_REFUSED = 1.10
"""A per-rank device plan above this multiple of the GPU's memory is refused before the first step.
Measured peaks (torch.cuda.max_memory_allocated, without the CUDA context and the allocator's reserve)
have been 0.93 to 1.03 of the plan (benchmarks/RESULTS.md: `small` at 524K and 1M, the fake world's
ranks of mop-37b to mop-667b), so a run planned at 1.10x peaks above the GPU's memory."""


def check_device_memory(terms: list[tuple[str, int, str]], *, capacity_bytes: int, refuse: bool = True) -> str | None:
    """Raise ValueError (naming "out of memory", which sweeps count as such) when the plan's total exceeds
    DEVICE_PLAN_REFUSED x `capacity_bytes` and `refuse`; return a warning line when it exceeds the capacity
    but not that (the plan may overestimate), or when refusal is off; None when it fits."""
    total = sum(b for _, b, _ in terms)
    if total <= capacity_bytes:
        return None
    ratio = total / capacity_bytes
    largest = sorted(((b, name) for name, b, _ in terms), reverse=True)[:3]
    head = (f"device memory: the per-rank plan totals {total / GIB:.1f} GiB, {ratio:.2f}x this GPU's "
            f"{capacity_bytes / GIB:.1f} GiB (largest terms: "
            + ", ".join(f"{name} {b / GIB:.1f} GiB" for b, name in largest) + ")")
    fix = ("lower training.seq_len or training.local_batch_size, raise the layout's degrees, or let "
           "`mop-train plan --auto --gpu-memory ... --host-memory ...` choose the operators that fit")
    if refuse and ratio > DEVICE_PLAN_REFUSED:
        raise ValueError(f"{head}: measured peaks have been 0.93-1.03x the plan, so this run would run out of memory; "
                         f"{fix}; or set mop.reliability.refuse_over_memory_plan = false to try it anyway")
    return f"warning: {head}: it may run out of memory (measured peaks have been 0.93-1.03x the plan); {fix}"


def format_plan(terms: list[tuple[str, int, str]], *, title: str = "per-rank memory plan") -> str:
    total = sum(b for _, b, _ in terms)
    width = max(len(n) for n, _, _ in terms)
    lines = [f"{title} (estimate):"]
    lines += [f"  {name:<{width}}  {b / GIB:>10.3f} GiB  {how}" for name, b, how in terms]
    lines.append(f"  {'total':<{width}}  {total / GIB:>10.3f} GiB")
    return "\n".join(lines)
