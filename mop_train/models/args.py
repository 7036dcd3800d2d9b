"""Hyperparameters of the MoE decoder family (one dataclass; the named configs live in `zoo`).

A model is `n_layers` decoder blocks: the first `n_dense_layers` use a dense SwiGLU FFN of width
`dense_ffn_dim`, the rest a routed MoE of `num_experts` SwiGLU experts (width `moe_inter_dim`,
top-`top_k`) plus `n_shared_experts` always-on experts. Attention is GQA or DeepSeek-V3 MLA.

Legend: H hidden (`dim`), V vocab, E experts, I expert width, k top-k, h heads, h_kv kv heads.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KINDS = ("gqa", "mla")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEModelArgs:
    """Shape of one MoE decoder. Call `validate()` before building a model."""

    dim: int = 64
    """Hidden width H."""
    n_layers: int = 2
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention (query) heads h."""
    n_kv_heads: int = 2
    """Key/value heads h_kv of GQA (must divide n_heads); unused by MLA, whose k/v have h heads."""
    attention: str = "gqa"
    """"gqa" (grouped-query attention) or "mla" (DeepSeek-V3 multi-head latent attention)."""
    head_dim: int = 16
    """GQA head width (need not equal dim / n_heads; must be even for RoPE)."""
    q_lora_rank: int = 0
    """MLA query low-rank width; 0 projects queries directly from the hidden state."""
    kv_lora_rank: int = 32
    """MLA compressed key/value width."""
    qk_nope_head_dim: int = 16
    """MLA per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 8
    """MLA per-head query/key width with rotary embedding (shared key part; must be even)."""
    v_head_dim: int = 16
    """MLA per-head value width."""
    vocab_size: int = 2048
    """Vocabulary size V (rows of the output projection)."""
    n_dense_layers: int = 1
    """Leading blocks with a dense FFN instead of a MoE."""
    dense_ffn_dim: int = 256
    """Width of the dense FFN of the leading dense blocks."""
    num_experts: int = 8
    """Routed experts per MoE block, E."""
    top_k: int = 2
    """Experts each token is routed to, k."""
    moe_inter_dim: int = 64
    """Routed (and shared) expert width I."""
    n_shared_experts: int = 0
    """Always-on experts per MoE block, fused into one SwiGLU of width n_shared_experts * I."""
    score_func: str = "sigmoid"
    """Router score: "softmax" over experts or per-expert "sigmoid" (DeepSeek-V3)."""
    route_norm: bool = True
    """Normalise the k selected gate weights to sum to 1 (before route_scale)."""
    route_scale: float = 1.0
    """Multiplier on the gate weights."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_seq_len: int = 4096
    """Longest sequence (per forward call) the model accepts."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    aux_loss_coef: float = 0.0
    """Weight of the optional load-balancing auxiliary loss; 0 turns it off (bias balancing only)."""

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width seen by the core attention."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def validate(self) -> "MoEModelArgs":
        """Raise ValueError naming the first bad field; return self so calls can chain."""
        positive = ["dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"]
        if self.attention == "gqa":
            positive += ["n_kv_heads", "head_dim"]
        elif self.attention == "mla":
            positive += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        else:
            raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTION_KINDS}")
        if self.n_dense_layers > 0:
            positive.append("dense_ffn_dim")
        if self.n_moe_layers > 0:
            positive += ["num_experts", "top_k", "moe_inter_dim"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        for name in ("q_lora_rank", "n_shared_experts", "n_dense_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} exceeds n_layers={self.n_layers}")
        if self.attention == "gqa" and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.rope_dim % 2:
            field = "qk_rope_head_dim" if self.attention == "mla" else "head_dim"
            raise ValueError(f"{field}={self.rope_dim} must be even (RoPE rotates pairs)")
        if self.n_moe_layers > 0:
            if self.top_k > self.num_experts:
                raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
            if self.score_func not in SCORE_FUNCS:
                raise ValueError(f"score_func={self.score_func!r}; expected one of {SCORE_FUNCS}")
            if not self.route_scale > 0:
                raise ValueError(f"route_scale={self.route_scale} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be > 0")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"aux_loss_coef={self.aux_loss_coef} must be >= 0 (0 turns it off)")
        return self
