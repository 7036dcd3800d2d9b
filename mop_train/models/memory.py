"""What one decoder block keeps for its backward, per token position, from the model's own shapes.

The planner (mop_train.plan.terms) asks these for the activations of the block that is being
recomputed and differentiated; the routed experts' share comes from the dispatch schedule
(mop_train.ops.moe_dispatch.memory), since it depends on how routes reach experts.

Counts follow the modules' forwards (attention.py, moe.py): a linear saves its input, an RMSNorm
its input, SiLU its input, a product both factors, SDPA q, k, v, its output and an fp32 log-sum-exp.
A view keeps its whole base alive (MLA's v is a view of the wkv_b output). Under Ulysses a rank's
attention core sees S positions of h/D heads: the same count as S/D positions of h heads.

Legend: H hidden, h heads, h_kv key/value heads, d head width, r rope width, I_s shared-expert width,
E experts, F dense FFN width.
"""

from __future__ import annotations

from mop_train.models.args import MoEModelArgs
from mop_train.ops.tiling.memory import largest_tile, stage_working_bytes, swiglu_token_bytes
from mop_train.ops.tiling.options import TilingOptions

FP32_BYTES = 4


def attention_saved_bytes(args: MoEModelArgs, positions: int, act_bytes: int) -> int:
    """Bytes the attention sub-block (norm, projections, core) saves over `positions` tokens."""
    h = args.n_heads
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        q_path = 2 * args.q_lora_rank if args.q_lora_rank else 0       # q_norm input, wq_b input
        elements = (args.dim                                            # normed x (wq_a / wkv_a input)
                    + q_path
                    + h * qk                                            # q after rope (SDPA)
                    + args.kv_lora_rank + args.qk_rope_head_dim         # wkv_a output (kv_norm's input view)
                    + args.kv_lora_rank                                 # wkv_b input
                    + h * (args.qk_nope_head_dim + args.v_head_dim)     # wkv_b output: v is a view of it
                    + h * qk                                            # k (SDPA)
                    + 2 * h * args.v_head_dim)                          # SDPA output, wo's input copy
    else:
        d, kv = args.head_dim, args.n_kv_heads
        elements = args.dim + h * d + 2 * kv * d + 2 * h * d            # normed x, q, k, v, out, wo input
    return positions * (elements * act_bytes + h * FP32_BYTES)          # + the log-sum-exp


def ffn_saved_bytes(args: MoEModelArgs, positions: int, act_bytes: int, *, moe: bool) -> int:
    """Bytes the feed-forward sub-block saves besides the routed experts: its norm's input and output, the router's
    fp32 scores and the shared expert (MoE), or the dense SwiGLU (h1, h3, silu(h1), their product)."""
    norm = 2 * args.dim                                                 # ffn_norm's input (the residual) and output
    if not moe:
        return positions * (norm + 4 * args.dense_ffn_dim) * act_bytes
    shared = 4 * args.n_shared_experts * args.moe_inter_dim
    return positions * ((norm + shared) * act_bytes + args.num_experts * FP32_BYTES)


def dense_ffn_gradient_bytes(args: MoEModelArgs, positions: int, act_bytes: int) -> int:
    """The dense SwiGLU's backward beside what it saved: the product's gradient, then h1's and h3's
    while the product itself is already freed: 2F per token at the most."""
    return positions * 2 * args.dense_ffn_dim * act_bytes


def block_gradient_bytes(args: MoEModelArgs, positions: int, act_bytes: int) -> int:
    """The gradients alive besides the saved tensors while a block runs backward: the incoming
    gradient of its output and the residual stream's, plus the largest per-token gradient of one
    projection (attention's q/k/v or the shared expert's h1/h3)."""
    h = args.n_heads
    width = (h * (args.qk_nope_head_dim + args.qk_rope_head_dim) if args.attention == "mla"
             else h * args.head_dim)
    return positions * (2 * args.dim + 3 * width) * act_bytes


# ------------------------------------------------------------------------------------------------
# With sequence tiling ([mop.tiling], mop_train.ops.tiling): what stays whole, what one tile holds
# ------------------------------------------------------------------------------------------------

def _head_widths(args: MoEModelArgs) -> tuple[int, int, int, int]:
    """(h, h_kv, d_qk, d_v) as the core sees them (MLA's keys and values have h heads)."""
    if args.attention == "mla":
        return args.n_heads, args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    return args.n_heads, args.n_kv_heads, args.head_dim, args.head_dim


def core_saved_bytes(args: MoEModelArgs, positions: int, act_bytes: int) -> int:
    """The attention core's q, k, v and output (whole, also when tiled) and its fp32 log-sum-exp."""
    h, h_kv, d_qk, d_v = _head_widths(args)
    return positions * ((h * d_qk + h_kv * d_qk + h_kv * d_v + h * d_v) * act_bytes + h * FP32_BYTES)


def core_gradient_bytes(args: MoEModelArgs, positions: int, act_bytes: int) -> int:
    """The core's backward beside what it saved: the output's gradient and dq, dk, dv (the kernel's
    workspace: core_workspace_bytes; benchmarks/tiling.py --phase core measures both on the GPU)."""
    h, h_kv, d_qk, d_v = _head_widths(args)
    return positions * (h * d_v + h * d_qk + h_kv * d_qk + h_kv * d_v) * act_bytes


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def core_workspace_bytes(args: MoEModelArgs, positions: int, act_bytes: int = 2, batch: int = 1) -> int:
    """Bytes the core's backward kernel allocates on CUDA beyond q, k, v, out, lse, the output's gradient
    and dq, dk, dv: the larger of the kernels F.scaled_dot_product_attention runs on Hopper for this shape
    (measured on H200: cuDNN for MLA, d_qk != d_v; FlashAttention-2 also when d_qk == d_v). Freed when the
    kernel returns. Per query position p of h heads:

      cudnn  cudnn-frontend's CompositeSDPABackwardNode (include/cudnn_frontend/node/
             scaled_dot_product_flash_attention.h, get_fe_workspace_size_node): from cuDNN 9.0 on (no dBias,
             not deterministic) the dP workspace is off, so dQ accumulates in an fp32 workspace tensor
             dQ_accum [b, h, s_q, d_qk] and softmax_sum = rowsum(dO * O) is fp32 [b, h, s_q]:
             4 h (d_qk + 1); torch's run_cudnn_SDP_bprop (aten/src/ATen/native/cudnn/MHA.cpp) allocates
             mha_graph->get_workspace_size() from the caching allocator (the engine's own share, not
             modelled, is small). With h_kv < h our explicit path (attention_backends._repeat_kv) also
             holds k, v repeated to h heads and dk, dv of h heads: 2 (h (d_qk + d_v) - h_kv (d_qk + d_v)) +
             h (d_qk + d_v) more, in the activation dtype, i.e. 3 h - 2 h_kv head widths.
      flash  FlashAttention-2's mha_bwd (flash_api.cpp, as vendored in aten/src/ATen/native/transformers/
             cuda/flash_attn): dq_accum fp32 [b, s_q rounded to 128, h, d rounded (to 32 up to 192, else
             256)] and softmax_d fp32 [b, h, s_q rounded]; with h_kv < h, dk_expanded and dv_expanded
             [b, s_k, h, d] in the activation dtype.
    `positions` = batch x S/D query positions (Ulysses: S positions of h/D heads, the same count)."""
    h, h_kv, d_qk, d_v = _head_widths(args)
    act = act_bytes
    cudnn = positions * FP32_BYTES * h * (d_qk + 1)
    if h_kv < h:
        cudnn += positions * act * (3 * h - 2 * h_kv) * (d_qk + d_v)
    if d_qk != d_v:
        return cudnn
    per_sequence = positions // max(batch, 1)
    rounded = max(batch, 1) * _round_up(per_sequence, 128)
    d_round = _round_up(d_qk, 32) if d_qk <= 192 else 256
    flash = rounded * FP32_BYTES * h * (d_round + 1)
    if h_kv < h:
        flash += positions * act * h * (d_qk + d_v)
    return max(cudnn, flash)


def kept_core_bytes(args: MoEModelArgs, positions: int, act_bytes: int) -> int:
    """The core's output and fp32 log-sum-exp: what [mop.attention] keep holds for every layer (its own
    plan line), so a block's saved set does not count them again."""
    h, _, _, d_v = _head_widths(args)
    return positions * h * (d_v * act_bytes + FP32_BYTES)


def projection_elements(args: MoEModelArgs) -> int:
    """Elements per token the norm, projections and RoPE save untiled (attention_saved_bytes without
    the core's output and wo's input copy)."""
    h, _, _, d_v = _head_widths(args)
    return (attention_saved_bytes(args, 1, 1) - h * FP32_BYTES) - 2 * h * d_v


def attention_stage_token_bytes(args: MoEModelArgs, act_bytes: int) -> int:
    """One tile token's bytes in the backward of attention's tiled input stage (norm, projections,
    RoPE): the recomputed graph, its gradients and the captured ones (3x what the stage saves), RoPE's
    fp32 temporaries (5 per rotated element), and one linear's fp32 upcast for its weight gradient
    (CPU, bf16). Checked against the CPU path in tests/models/test_tiled_block.py."""
    h, h_kv, _, _ = _head_widths(args)
    rotated = (h + (1 if args.attention == "mla" else h_kv)) * args.rope_dim
    upcast = 0 if act_bytes == 4 else FP32_BYTES * max(out + inp for out, inp in _projection_shapes(args))
    return 3 * projection_elements(args) * act_bytes + 5 * FP32_BYTES * rotated + upcast


def _projection_shapes(args: MoEModelArgs) -> list[tuple[int, int]]:
    """(out, in) of the input stage's linears."""
    h, h_kv, d_qk, d_v = _head_widths(args)
    H = args.dim
    if args.attention == "gqa":
        return [(h * d_qk, H), (h_kv * d_qk, H), (h_kv * d_v, H)]
    q = [(h * d_qk, H)] if not args.q_lora_rank else [(args.q_lora_rank, H), (h * d_qk, args.q_lora_rank)]
    return q + [(args.kv_lora_rank + args.qk_rope_head_dim, H), (h * (args.qk_nope_head_dim + d_v), args.kv_lora_rank)]


def attention_stage_weights(args: MoEModelArgs) -> list[int]:
    """Elements of each weight of the input stage (norms included) and of wo."""
    h, _, _, d_v = _head_widths(args)
    norms = [args.dim, args.kv_lora_rank] if args.attention == "mla" else [args.dim]
    norms += [args.q_lora_rank] if args.attention == "mla" and args.q_lora_rank else []
    return [out * inp for out, inp in _projection_shapes(args)] + norms + [h * d_v * args.dim]


def tiled_attention_phase_bytes(args: MoEModelArgs, positions: int, tile: int, act_bytes: int) -> int:
    """The attention half of a block-tiled block in backward: the core whole (saved + gradients), and
    the larger of the core kernel's workspace (core_workspace_bytes, while the kernel runs) and the
    input stage's backward that follows it (its input gradient [N, H], one tile, its weight gradients)."""
    h, _, _, d_v = _head_widths(args)
    stage = stage_working_bytes(positions, tile, in_elements=args.dim, tile_elements=0, weight_elements=
                                attention_stage_weights(args), act_bytes=act_bytes)
    stage += largest_tile(positions, tile) * attention_stage_token_bytes(args, act_bytes)
    return (core_saved_bytes(args, positions, act_bytes) + core_gradient_bytes(args, positions, act_bytes)
            + max(stage, core_workspace_bytes(args, positions, act_bytes)))


def tiling_options(section, args: MoEModelArgs, *, tokens: int, act_bytes: int) -> TilingOptions:
    """[mop.tiling] resolved for `tokens` per rank: "auto" sized by the widest FFN and attention's
    input stage (ops.tiling.memory.auto_tile_tokens)."""
    widths = ([args.dense_ffn_dim] if args.n_dense_layers else []) + \
        ([args.n_shared_experts * args.moe_inter_dim] if args.n_moe_layers and args.n_shared_experts else [])
    return TilingOptions.resolve(section.ffn_tokens, section.block_tokens, tokens=tokens,
                                 ffn_token_bytes=swiglu_token_bytes(args.dim, max(widths, default=0), act_bytes),
                                 block_token_bytes=attention_stage_token_bytes(args, act_bytes))
