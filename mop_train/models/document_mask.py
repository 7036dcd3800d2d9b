"""Intra-document attention for packed sequences ("document masking").

Packed training rows are documents laid end to end, each closed by EOS. With the document mask a
token attends only to earlier tokens of its own document, so every document is trained as if it
were alone in its row:

    doc_ids = document_ids(tokens, eos_id)            # [B, S] int32: 0, 0, 0(EOS), 1, 1, ...
    out = document_attention(q, k, v, doc_ids)        # causal AND same document

Document ids are a running count of the EOS tokens before each position (an EOS belongs to the
document it ends; the token after it opens the next one), so they never decrease along a row.
Cores (`impl`):
  "sdpa_mask"  F.scaled_dot_product_attention with a dense boolean [B, 1, S, S] mask: exact,
               O(S^2) memory; the CPU path and the test oracle.
  "flex"       FlexAttention with a BlockMask built from the ids: blocks of no document pair are
               skipped, so the cost falls with the documents' lengths. torch.compile'd (one
               compiled function per process) on CUDA; eager on CPU (forward only: FlexAttention
               has no CPU backward).
Default: "flex" on CUDA, "sdpa_mask" elsewhere. `document_attention_reference` loops over the
documents and runs plain causal softmax attention on each: the test oracle of both cores.
RoPE positions stay global: RoPE is relative, so a document's outputs do not depend on its offset.

Legend: B batch, S sequence, h query heads, h_kv key/value heads, d_qk / d_v head widths.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

IMPLS = ("flex", "sdpa_mask")


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """tokens [B, S] int -> [B, S] int32: the document index of each position within its row.

    A token right after an EOS starts a new document; the EOS belongs to the document it ends.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}")
    is_eos = (tokens == eos_id).to(torch.int32)                      # [B, S]
    return torch.cumsum(is_eos, dim=1, dtype=torch.int32) - is_eos  # EOS tokens strictly before


def default_impl(device: torch.device) -> str:
    """"flex" on CUDA, "sdpa_mask" elsewhere."""
    return "flex" if device.type == "cuda" else "sdpa_mask"


def dense_document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, S] -> [B, 1, S, S] bool: query i may see key j iff j <= i and same document."""
    S = doc_ids.shape[1]
    pos = torch.arange(S, device=doc_ids.device)
    causal = pos[:, None] >= pos[None, :]                              # [S, S]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]                  # [B, S, S]
    return (same & causal)[:, None]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor) -> None:
    B, S, h, d_qk = q.shape
    if k.shape[:2] != (B, S) or v.shape[:3] != k.shape[:3] or k.shape[3] != d_qk or h % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [B, S, h, d_qk], "
                         f"[B, S, h_kv, d_qk], [B, S, h_kv, d_v] with h divisible by h_kv")
    if doc_ids.shape != (B, S):
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)} but the attention sees [B, S] = "
                         f"({B}, {S}); pass one document id per position of the full sequence")
    if doc_ids.is_floating_point() or doc_ids.is_complex():
        raise ValueError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                       impl: str | None = None) -> torch.Tensor:
    """Causal attention restricted to each query's own document.

    Args:
        q: [B, S, h, d_qk]; k: [B, S, h_kv, d_qk]; v: [B, S, h_kv, d_v] (h divisible by h_kv).
        doc_ids: [B, S] integer document id of every position (see `document_ids`).
        impl: "flex" | "sdpa_mask" | None (by device, see `default_impl`).
    Returns:
        [B, S, h, d_v], scale 1/sqrt(d_qk).
    """
    impl = impl or default_impl(q.device)
    if impl not in IMPLS:
        raise ValueError(f"impl = {impl!r} is not a document attention core; use one of {IMPLS}")
    _check(q, k, v, doc_ids)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                 # [B, heads, S, d]
    gqa = k.shape[1] != q.shape[1]
    if impl == "sdpa_mask":
        mask = dense_document_mask(doc_ids.to(q.device))               # [B, 1, S, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        out = _flex(q, k, v, doc_ids.to(q.device), gqa)
    return out.transpose(1, 2)                                         # [B, S, h, d_v]


# ------------------------------------------------------------------------------------------------
# FlexAttention core
# ------------------------------------------------------------------------------------------------

_COMPILED: dict = {}
"""The torch.compile'd flex_attention and create_block_mask, built once per process on first CUDA use."""

_FLEX_GQA_MIN_S = 128
"""Below this many positions the CUDA FlexAttention core repeats key/value heads instead of GQA (`_flex`)."""

_LAST_MASK: list = []
"""One-entry cache [(weakref to doc_ids, its _version, device, BlockMask)]: every layer (and its
checkpoint recompute) of a step passes the same doc_ids tensor, so its BlockMask is built once."""


def _compiled(name: str):
    if not _COMPILED:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _COMPILED["flex_attention"] = torch.compile(flex_attention, dynamic=False)
        _COMPILED["create_block_mask"] = torch.compile(create_block_mask, dynamic=False)
    return _COMPILED[name]


def _block_mask(doc_ids: torch.Tensor):
    """BlockMask of `causal AND same document` for doc_ids [B, S] (cached for the same tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if _LAST_MASK:
        ref, version, device, block_mask = _LAST_MASK[0]
        if ref() is doc_ids and version == doc_ids._version and device == doc_ids.device:
            return block_mask
    _LAST_MASK.clear()  # free the previous step's mask (O((S/128)^2) indices) before building this one
    B, S = doc_ids.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    build = _compiled("create_block_mask") if doc_ids.is_cuda else create_block_mask
    block_mask = build(same_document_causal, B, None, S, S, device=doc_ids.device)
    _LAST_MASK[:] = [(weakref.ref(doc_ids), doc_ids._version, doc_ids.device, block_mask)]
    return block_mask


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, gqa: bool) -> torch.Tensor:
    """q [B, h, S, d_qk], k [B, h_kv, S, d_qk], v [B, h_kv, S, d_v] -> [B, h, S, d_v]."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = _block_mask(doc_ids)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.is_cuda:
        if gqa and q.shape[2] < _FLEX_GQA_MIN_S:
            # torch 2.11's compiled FlexAttention has no kernel for GQA below one 128-row block in fp32
            # (measured on an H100, 2026-12-07: S = 64 and 127 raise InductorError "NoValidChoicesError",
            # S = 5, 128, 129 run): give every query head its own key/value head there. Exact (the same
            # scores and sums; autograd adds the repeated heads' gradients), and at S < 128 the copies
            # are small.
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            gqa = False
        return _compiled("flex_attention")(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("impl = \"flex\" has no backward on CPU (FlexAttention supports it on CUDA "
                         "only); use impl = \"sdpa_mask\" for training on CPU")
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------

def document_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 doc_ids: torch.Tensor) -> torch.Tensor:
    """The spec: every document of every row gets its own causal softmax attention (same shapes
    as `document_attention`). Positions of one document need not be contiguous."""
    _check(q, k, v, doc_ids)
    B, S, h, d_qk = q.shape
    group = h // k.shape[2]
    if B == 0 or S == 0:  # nothing to attend; stay connected to the inputs for backward
        return q.new_zeros(B, S, h, v.shape[3]) + (q.sum() + k.sum() + v.sum()) * 0
    rows = []
    for b in range(B):
        pieces, order = [], []
        for doc in torch.unique(doc_ids[b]).tolist():
            idx = (doc_ids[b] == doc).nonzero().squeeze(1)              # [n] positions of this document
            qd = q[b, idx].transpose(0, 1)                              # [h, n, d_qk]
            kd = k[b, idx].transpose(0, 1).repeat_interleave(group, 0)  # [h, n, d_qk]
            vd = v[b, idx].transpose(0, 1).repeat_interleave(group, 0)  # [h, n, d_v]
            scores = qd @ kd.transpose(1, 2) / math.sqrt(d_qk)          # [h, n, n]
            future = torch.ones(idx.numel(), idx.numel(), dtype=torch.bool, device=q.device).triu(1)
            probs = scores.masked_fill(future, float("-inf")).softmax(-1)
            pieces.append((probs @ vd).transpose(0, 1))                 # [n, h, d_v]
            order.append(idx)
        rows.append(torch.cat(pieces)[torch.cat(order).argsort()])      # [S, h, d_v] in position order
    return torch.stack(rows)                                            # [B, S, h, d_v]
