"""The memory plan's `block` term: one checkpointed decoder block while it runs backward.

A block's backward first recomputes it, then runs the FFN half's backward with everything the block
saved alive, then attention's, after the FFN half's tensors are freed; the peak is the larger phase,
plus the two incoming gradients [N, H] (the block's output's and the residual stream's):

  FFN phase        attention saved + FFN norm (2H) + router (E fp32) + the FFN's own saved bytes,
                   plus the larger backward working set (routed experts, or the SwiGLU)
  attention phase  attention saved + its gradients + the core backward kernel's workspace (cuDNN's or
                   FlashAttention-2's fp32 dq accumulator: models.memory.core_workspace_bytes)
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
                                     core_saved_bytes, core_workspace_bytes, kept_core_bytes,
                                     tiled_attention_phase_bytes)
from mop_train.ops.bound import DeviceBound
from mop_train.ops.tiling import TilingOptions
from mop_train.ops.tiling import memory as tiling_memory

GIB = 2**30


def _attention(a: MoEModelArgs, tokens: int, act: int, tile: int, keep: bool = False) -> tuple[int, int, str]:
    """(saved, phase, how) of the attention half. With `keep` the core's output and log-sum-exp are the
    plan's `kept attn` line (every layer's), so they leave this block's own count."""
    kept = kept_core_bytes(a, tokens, act) if keep else 0
    workspace = core_workspace_bytes(a, tokens, act)
    kept_how = ", out and lse in kept attn" if keep else ""
    if tile and tokens > tile:
        saved = core_saved_bytes(a, tokens, act)
        phase = tiled_attention_phase_bytes(a, tokens, tile, act) + 2 * tokens * a.dim * act
        how = (f"attention tiled by {tile:,}: core q, k, v, out, lse {saved // tokens:,} B/token + their grads "
               f"{core_gradient_bytes(a, tokens, act) // tokens:,} B/token whole{kept_how}, the backward kernel's "
               f"workspace {workspace // tokens:,} B/token")
        return saved - kept, phase - kept, how
    saved = attention_saved_bytes(a, tokens, act)
    phase = saved + block_gradient_bytes(a, tokens, act) + workspace
    return (saved - kept, phase - kept, f"attention {(saved - kept) / GIB:.2f} GiB saved{kept_how}, kernel "
            f"workspace {workspace / GIB:.2f} GiB in backward")


def moe_block_bound(a: MoEModelArgs, tokens: int, act: int, tiling: TilingOptions,
                    routed: DeviceBound, keep: bool = False) -> tuple[int, int, str]:
    """(peak in backward, saved, how) of a MoE block, given its routed experts' bound."""
    attention, attention_phase, attention_how = _attention(a, tokens, act, tiling.block_tokens, keep)
    incoming, norm = 2 * tokens * a.dim * act, 2 * tokens * a.dim * act   # grads in; ffn_norm's input and output
    shared_width = a.n_shared_experts * a.moe_inter_dim
    shared = (tiling_memory.device_bound(tiling.ffn_tokens, tiling_memory.SwiGLUShapes(tokens, a.dim, shared_width, act))
              if shared_width else DeviceBound(0, 0, "no shared expert"))
    router = tokens * a.num_experts * FP32_BYTES
    saved = attention + norm + router + shared.saved + routed.saved
    ffn_phase = saved + max(routed.working, shared.working)
    how = (f"MoE block: {attention_how}; FFN norm + router {(norm + router) / GIB:.2f}, shared {shared.saved / GIB:.2f} "
           f"+ routed {routed.saved / GIB:.2f} saved, {max(routed.working, shared.working) / GIB:.2f} in backward "
           f"({routed.how}; {shared.how}), grads in {incoming / GIB:.2f} GiB")
    return max(ffn_phase, attention_phase) + incoming, saved, _binds(how, ffn_phase, attention_phase)


def dense_block_bound(a: MoEModelArgs, tokens: int, act: int, tiling: TilingOptions,
                      keep: bool = False) -> tuple[int, int, str]:
    """(peak in backward, saved, how) of a dense-FFN block."""
    attention, attention_phase, attention_how = _attention(a, tokens, act, tiling.block_tokens, keep)
    incoming, norm = 2 * tokens * a.dim * act, 2 * tokens * a.dim * act
    dense = tiling_memory.device_bound(tiling.ffn_tokens, tiling_memory.SwiGLUShapes(tokens, a.dim, a.dense_ffn_dim, act))
    saved = attention + norm + dense.saved
    how = (f"dense-FFN block: {attention_how}; FFN norm {norm / GIB:.2f} GiB, {dense.how}: {dense.saved / GIB:.2f} "
           f"saved + {dense.working / GIB:.2f} in backward, grads in {incoming / GIB:.2f} GiB")
    ffn_phase = saved + dense.working
    return max(ffn_phase, attention_phase) + incoming, saved, _binds(how, ffn_phase, attention_phase)


def _binds(how: str, ffn_phase: int, attention_phase: int) -> str:
    return f"{how} ({'FFN' if ffn_phase >= attention_phase else 'attention'} phase binds)"


def block_bound(a: MoEModelArgs, tokens: int, act: int, tiling: TilingOptions,
                routed: DeviceBound, keep: bool = False) -> tuple[int, int, str]:
    """(peak bytes of one checkpointed block in backward, bytes a non-checkpointed block saves, how):
    the larger of the MoE and the dense-FFN block (when the model has both), given the routed
    experts' bound of the dispatch schedule. `saved` is a MoE block's. `keep`: [mop.attention] keep (the
    core's output and log-sum-exp counted once, in the plan's kept attn line)."""
    peak, saved, how = moe_block_bound(a, tokens, act, tiling, routed, keep)
    if a.n_dense_layers:
        dense_peak, _, dense_how = dense_block_bound(a, tokens, act, tiling, keep)
        if dense_peak > peak:
            peak, how = dense_peak, dense_how
    return peak, saved, how
