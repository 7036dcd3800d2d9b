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
