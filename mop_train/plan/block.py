"""The memory plan's `block` term: one checkpointed decoder block while it runs backward.

A block's backward first recomputes it, then runs the FFN half's backward with everything the block
saved alive, then attention's, after the FFN half's tensors are freed; the peak is the larger phase,
plus the two incoming gradients [N, H] (the block's output's and the residual stream's):

  FFN phase        attention saved + FFN norm (2H) + router (E fp32) + the FFN's own saved bytes,
                   plus the larger backward working set (routed experts, or the SwiGLU)
  attention phase  attention saved + its gradients
Dense-FFN blocks (the first n_dense_layers) and MoE blocks compete; the larger is the term.

With [mop.tiling] the row-wise stages hold one tile instead of N tokens (mop_train.ops.tiling):
  ffn_tokens       the SwiGLU (dense FFN, shared expert) saves nothing and holds one tile in backward
                   (ops.tiling.memory.device_bound);
  block_tokens     attention saves only the core's q, k, v, output and log-sum-exp (whole, by design),
                   and its phase is those, their gradients and one tile of the input stage's backward
                   (models.memory.tiled_attention_phase_bytes).
The residual adds save nothing; the router's fp32 scores (E x 4 B per token) stay whole.

Legend: N = B*S/D tokens on the rank, H hidden, F dense FFN width, I_s shared-expert width, E experts.
"""

from __future__ import annotations

from mop_train.models.args import MoEModelArgs
from mop_train.models.memory import (FP32_BYTES, attention_saved_bytes, block_gradient_bytes, core_gradient_bytes,
                                     core_saved_bytes, tiled_attention_phase_bytes)
from mop_train.ops.bound import DeviceBound
from mop_train.ops.tiling import TilingOptions
from mop_train.ops.tiling import memory as tiling_memory

GIB = 2**30


def _attention(a: MoEModelArgs, tokens: int, act: int, tile: int) -> tuple[int, int, str]:
    """(saved, phase, how) of the attention half."""
    if tile and tokens > tile:
        saved = core_saved_bytes(a, tokens, act)
        phase = tiled_attention_phase_bytes(a, tokens, tile, act) + 2 * tokens * a.dim * act
        how = (f"attention tiled by {tile:,}: core q, k, v, out, lse {saved // tokens:,} B/token + their grads "
               f"{core_gradient_bytes(a, tokens, act) // tokens:,} B/token whole (kernel workspace not counted)")
        return saved, phase, how
    saved = attention_saved_bytes(a, tokens, act)
    return saved, saved + block_gradient_bytes(a, tokens, act), f"attention {saved / GIB:.2f} GiB saved"


def block_bound(a: MoEModelArgs, tokens: int, act: int, tiling: TilingOptions,
                routed: DeviceBound) -> tuple[int, int, str]:
    """(peak bytes of one checkpointed block in backward, bytes a non-checkpointed block saves, how),
    given the routed experts' bound of the dispatch schedule."""
    attention, attention_phase, attention_how = _attention(a, tokens, act, tiling.block_tokens)
    incoming = 2 * tokens * a.dim * act
    norm = 2 * tokens * a.dim * act                                  # ffn_norm's input and output
    shared_width = a.n_shared_experts * a.moe_inter_dim
    shared = (tiling_memory.device_bound(tiling.ffn_tokens, tiling_memory.SwiGLUShapes(tokens, a.dim, shared_width, act))
              if shared_width else DeviceBound(0, 0, "no shared expert"))
    router = tokens * a.num_experts * FP32_BYTES
    saved = attention + norm + router + shared.saved + routed.saved
    peak = max(saved + max(routed.working, shared.working), attention_phase) + incoming
    how = (f"MoE block: {attention_how}; FFN norm + router {(norm + router) / GIB:.2f}, shared {shared.saved / GIB:.2f} "
           f"+ routed {routed.saved / GIB:.2f} saved, {max(routed.working, shared.working) / GIB:.2f} in backward "
           f"({routed.how}; {shared.how}), grads in {incoming / GIB:.2f} GiB")
    if a.n_dense_layers:
        dense = tiling_memory.device_bound(tiling.ffn_tokens, tiling_memory.SwiGLUShapes(tokens, a.dim, a.dense_ffn_dim,
                                                                                          act))
        dense_peak = max(attention + norm + dense.saved + dense.working, attention_phase) + incoming
        if dense_peak > peak:
            peak = dense_peak
            how = (f"dense-FFN block: {attention_how}; FFN norm {norm / GIB:.2f} GiB, {dense.how}: "
                   f"{dense.saved / GIB:.2f} saved + {dense.working / GIB:.2f} in backward, grads in "
                   f"{incoming / GIB:.2f} GiB")
    phase = "attention phase binds" if peak == attention_phase + incoming else "FFN phase binds"
    return peak, saved, f"{how} ({phase})"
