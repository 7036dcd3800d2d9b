"""Causal self-attention of the MoE decoder: GQA or DeepSeek-V3 MLA, around a swappable core.

Both variants project the hidden state to per-head q/k/v, rotate (part of) q and k with RoPE at
the tokens' global positions, and call `self.sdpa(q, k, v)` (or `self.sdpa(q, k, v, doc_ids)` with
a document mask, see document_mask.py): the core attention, a submodule that
sequence parallelism replaces with a wrapper (all-to-all heads <-> sequence around the same core),
so the core takes and returns head-major-last tensors [B, S, heads, d] and does the GQA
repeat itself. The core can keep its output and log-sum-exp for backward, so that a block's
activation-checkpoint recompute skips the attention kernel (keep_attention.py), and can run one
named kernel instead of F.scaled_dot_product_attention's own choice (attention_backends.py).
The projections (and RoPE) are one row-wise function, `project(ops, x, rope, w)`: the untiled forward
runs it over all positions, `forward_tiled` over token tiles with the block's norm folded in, and the
output projection after the core likewise ([mop.tiling] block_tokens, mop_train.ops.tiling).
MLA (DeepSeek-V3 / Kimi-K2) compresses k/v through a rank-`kv_lora_rank`
latent and gives every head a shared rotated key part; YaRN rescaling is not modelled.

Legend: B batch, S sequence, H hidden, h heads, h_kv kv heads, d head width, r rotated width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mop_train.models.args import MoEModelArgs
from mop_train.models.attention_backends import AttentionCall, sdpa_choice
from mop_train.models.document_mask import _check as document_attention_check
from mop_train.models.document_mask import default_impl, document_attention
from mop_train.models.keep_attention import KeepableCore, can_keep, explicit_attention
from mop_train.ops.tiling import PLAIN, TileOps, tiled_rows


def rope_inv_freq(rope_dim: int, theta: float, device=None) -> torch.Tensor:
    """[r/2] fp32 inverse frequencies of RoPE."""
    exponents = torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim
    return 1.0 / (theta ** exponents)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[S, r/2, 2] fp32 (cos, sin) of angle position * inv_freq. A position's row depends on that
    position only, so a sequence shard at an offset gets exactly the rows of the full sequence."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [S, r/2]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x [B, S, h, r] by rope [S, r/2, 2] (fp32 math, x's dtype out)."""
    pairs = x.float().unflatten(-1, (x.shape[-1] // 2, 2))          # [B, S, h, r/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]  # [1, S, 1, r/2]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class ScaledDotProductAttention(KeepableCore):
    """Causal core attention: q [B, S, h, d_qk], k [B, S, h_kv, d_qk], v [B, S, h_kv, d_v]
    -> [B, S, h, d_v]. Scale 1/sqrt(d_qk). GQA (h_kv < h) is handled here, not by the caller.
    With doc_ids [B, S] a query also sees only its own document (`document_attention` with
    `document_impl`: None picks by device).

    Plain attributes set from outside (between steps):
        keep: keep the output and log-sum-exp for backward, so an activation-checkpoint recompute
            skips the kernel (keep_attention.py; `keep_attention(model)` sets it on every core).
            Applies when an autograd graph is built; FlexAttention (CUDA document mask) is replayed.
        backend: None lets F.scaled_dot_product_attention pick its kernel; a name from
            attention_backends.BACKENDS runs that kernel explicitly (a per-shape choice plugs in here).
    """

    def __init__(self, document_impl: str | None = None):
        super().__init__()                                              # keep = False
        self.document_impl = document_impl
        self.backend: str | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        call = self._explicit_call(q, k, v, doc_ids)
        if call is not None:
            return explicit_attention(q, k, v, doc_ids, call, owner=self)
        if doc_ids is not None:
            return document_attention(q, k, v, doc_ids, impl=self.document_impl)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))           # [B, heads, S, d]
        gqa = k.shape[1] != q.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2)                                  # [B, S, h, d_v]

    def _explicit_call(self, q, k, v, doc_ids) -> AttentionCall | None:
        """The explicit-kernel call for these inputs, or None for the plain path."""
        if self.backend is None and not self.keep:
            return None
        if doc_ids is not None:
            if (self.document_impl or default_impl(q.device)) != "sdpa_mask":
                return None                                         # FlexAttention: not kept
            document_attention_check(q, k, v, doc_ids)
        builds_graph = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        keep = self.keep and builds_graph
        if self.backend is None and not keep:
            return None
        gqa = k.shape[2] != q.shape[2]
        backend = self.backend
        if backend is None:
            B, S = q.shape[:2]
            mask = None if doc_ids is None else torch.ones((), dtype=torch.bool, device=q.device).expand(B, 1, S, S)
            backend = sdpa_choice(*(t.transpose(1, 2) for t in (q, k, v)), mask)
            if not can_keep(backend, masked=doc_ids is not None):
                return None
        return AttentionCall(backend=backend, is_causal=True, gqa=gqa, keep=keep)


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class _ProjectedAttention(nn.Module):
    """Projections -> core -> output projection. Subclasses give `project(ops, x, rope, w)`, a
    row-wise map of x [B, s, H] and its RoPE rows to (q, k, v) through the tile ops (ops.tiling), and
    `projection_weights()`, the names and weights it reads: the untiled forward runs it once with the
    plain ops, `forward_tiled` over token tiles together with the block's attention norm."""

    def projection_weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def project(self, ops: TileOps, x: torch.Tensor, rope: torch.Tensor, w: dict):
        raise NotImplementedError

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, H] (normed), rope [S, r/2, 2], doc_ids None or [B, S_full] (see ScaledDotProductAttention)."""
        B, S, _ = x.shape
        q, k, v = self.project(PLAIN, x, rope, self.projection_weights())
        out = self.sdpa(q, k, v) if doc_ids is None else self.sdpa(q, k, v, doc_ids)  # [B, S, h, d_v]
        return self.wo(out.reshape(B, S, -1))                                       # [B, S, H]

    def forward_tiled(self, x: torch.Tensor, norm: nn.RMSNorm, rope: torch.Tensor, doc_ids: torch.Tensor | None,
                      tile_tokens: int) -> torch.Tensor:
        """`forward(norm(x), rope, doc_ids)` with the norm, projections and RoPE run over token tiles
        before the core and the output projection after it (ops.tiling.tiled_rows): x [B, S, H] is
        the block's input (not normed). The core's q, k, v and output are whole tensors."""
        weights = {"attention_norm": norm.weight, **self.projection_weights()}

        def stage_in(ops, s, rows, w):
            return self.project(ops, ops.rms_norm(rows[0], w["attention_norm"], norm.eps), rope[s], w)

        q, k, v = tiled_rows(stage_in, (x,), weights, tile_tokens)
        out = self.sdpa(q, k, v) if doc_ids is None else self.sdpa(q, k, v, doc_ids)  # [B, S, h, d_v]

        def stage_out(ops, s, rows, w):
            return (ops.linear(rows[0].reshape(*rows[0].shape[:2], -1), w["wo"]),)

        (y,) = tiled_rows(stage_out, (out,), {"wo": self.wo.weight}, tile_tokens)
        return y                                                                     # [B, S, H]


class GroupedQueryAttention(_ProjectedAttention):
    """GQA: h query heads share h_kv key/value heads; every head is rotated over its full width."""

    def __init__(self, args: MoEModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def projection_weights(self) -> dict[str, torch.Tensor]:
        return {"wq": self.wq.weight, "wk": self.wk.weight, "wv": self.wv.weight}

    def project(self, ops, x, rope, w):
        """x [B, S, H], rope [S, r/2, 2] -> q [B, S, h, d], k, v [B, S, h_kv, d]."""
        B, S, _ = x.shape
        q = ops.linear(x, w["wq"]).view(B, S, self.n_heads, self.head_dim)     # [B, S, h, d]
        k = ops.linear(x, w["wk"]).view(B, S, self.n_kv_heads, self.head_dim)  # [B, S, h_kv, d]
        v = ops.linear(x, w["wv"]).view(B, S, self.n_kv_heads, self.head_dim)  # [B, S, h_kv, d]
        return apply_rope(q, rope), apply_rope(k, rope), v

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal(linear.weight, 0.02)
        _trunc_normal(self.wo.weight, init_std)


class MultiHeadLatentAttention(_ProjectedAttention):
    """MLA: queries (optionally through a rank-q_lora_rank bottleneck) and keys/values through a
    rank-kv_lora_rank latent; the rotated key part (width r) is one head broadcast to all h."""

    def __init__(self, args: MoEModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def projection_weights(self) -> dict[str, torch.Tensor]:
        q = ({"wq": self.wq.weight} if hasattr(self, "wq") else
             {"wq_a": self.wq_a.weight, "q_norm": self.q_norm.weight, "wq_b": self.wq_b.weight})
        return {**q, "wkv_a": self.wkv_a.weight, "kv_norm": self.kv_norm.weight, "wkv_b": self.wkv_b.weight}

    def project(self, ops, x, rope, w):
        """x [B, S, H], rope [S, r/2, 2] -> q, k [B, S, h, d_qk], v [B, S, h, d_v] (a view)."""
        B, S, _ = x.shape
        if "wq" in w:
            q = ops.linear(x, w["wq"])
        else:
            q = ops.linear(ops.rms_norm(ops.linear(x, w["wq_a"]), w["q_norm"], self.q_norm.eps), w["wq_b"])
        q = q.view(B, S, self.n_heads, self.nope_dim + self.rope_dim)     # [B, S, h, d_qk]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, rope)], dim=-1)

        kv, k_pe = ops.linear(x, w["wkv_a"]).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), rope)                        # [B, S, 1, r]
        kv = ops.linear(ops.rms_norm(kv, w["kv_norm"], self.kv_norm.eps), w["wkv_b"])
        kv = kv.view(B, S, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)  # [B, S, h, d_qk]
        return q, k, v

    def init_weights(self, init_std: float) -> None:
        linears = [self.wkv_a, self.wkv_b] + ([self.wq] if hasattr(self, "wq") else [self.wq_a, self.wq_b])
        for linear in linears:
            _trunc_normal(linear.weight, 0.02)
        _trunc_normal(self.wo.weight, init_std)
        self.kv_norm.reset_parameters()
        if hasattr(self, "q_norm"):
            self.q_norm.reset_parameters()


def build_attention(args: MoEModelArgs) -> nn.Module:
    if args.attention == "mla":
        return MultiHeadLatentAttention(args)
    return GroupedQueryAttention(args)
