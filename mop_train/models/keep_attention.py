"""Keep, don't replay, attention: the core attention's output and log-sum-exp outlive the forward,
so a block's activation-checkpoint recompute skips the attention kernel.

    keep_attention(model, enabled=True)         # every ScaledDotProductAttention core in `model`
    loss = model(tokens).sum(); loss.backward()   # per-block checkpointing (plain or SCO) as before
    kept_attention_bytes(model_args, B, S, D)   # the memory plan's term: bytes per layer per rank

Under per-block checkpointing a block's backward first re-runs its forward (the recompute), which
runs the attention kernel a second time: at long context about a fifth of all attention work.
With keep on, the core runs as one autograd.Function (`_KeptAttention`, kernels from
attention_backends.py):
  forward    run the kernel; save q, k, v (and doc ids) as ordinary saved tensors, which the
             checkpoint drops and recomputes as before; keep out and lse on the autograd node.
  recompute  (a forward inside backward) find the node of the SAME core in the graph being
             differentiated, by walking from the node autograd is executing (the one whose saved
             tensor started the recompute) to its inputs; return the kept output without running
             the kernel, and save the recomputed q, k, v for that node.
  backward   the backend's backward kernel on q, k, v and the kept out, lse; then drop them.
Pairing is by graph, not by order: the node found is the one this backward will run, so layers,
micro-steps, a second forward before the first backward, and forwards never differentiated
(their graph frees the kept tensors) cannot mix. With no autograd graph (no_grad, inference) the
plain path runs and nothing is kept. A second backward through a retained graph finds the kept
tensors gone and runs the kernel again. Exact: the same kernels as F.scaled_dot_product_attention
on the same q, k, v, so on CPU gradients are bitwise those of plain checkpointing.
Not kept: FlexAttention (the CUDA document mask); masks on the CUDA backends (plain path).
Kept tensors stay on the device (no SCO host placement yet).

Legend: B batch, S sequence, D sequence-group size (Ulysses), h query heads, d_v value width.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch
from torch import nn

from mop_train.models.attention_backends import (MASKED_BACKENDS, AttentionCall, attention_backward,
                                                 attention_forward, check_call)
from mop_train.models.document_mask import dense_document_mask

_LIVE: "weakref.WeakSet[_Kept]" = weakref.WeakSet()
"""Every kept (out, lse) still referenced by an autograd node: `kept_entries` reads it (tests, leaks)."""

_MAX_WALK = 1 << 16
"""Nodes visited at most while looking for the original node (a block has a few hundred)."""


class _Kept:
    """One core call's kept forward results; `out` shares storage (and version) with the output."""

    __slots__ = ("out", "lse", "aux", "version", "owner", "__weakref__")

    def __init__(self, out: torch.Tensor, lse: torch.Tensor | None, aux: tuple, owner: nn.Module):
        self.out, self.lse, self.aux = out.detach(), lse, aux
        self.version = out._version
        self.owner = weakref.ref(owner)
        _LIVE.add(self)

    def intact(self) -> bool:
        """False if the output was modified in place since the kernel wrote it."""
        return self.out._version == self.version

    @property
    def nbytes(self) -> int:
        lse = 0 if self.lse is None else self.lse.numel() * self.lse.element_size()
        return self.out.numel() * self.out.element_size() + lse


def _in_backward() -> bool:
    # True while autograd runs a backward pass (where checkpoints recompute), as in moe.py.
    return torch._C._current_graph_task_id() != -1


def _original_node(owner: nn.Module):
    """The `_KeptAttention` node of `owner` reachable from the node autograd is executing, or None."""
    start = torch._C._current_autograd_node()
    if start is None:
        return None
    backward_cls = _KeptAttention._backward_cls
    seen = {id(start): start}   # values keep the wrappers alive, so ids stay unique
    frontier = deque([start])
    while frontier and len(seen) < _MAX_WALK:
        node = frontier.popleft()
        if type(node) is backward_cls and node.owner() is owner:
            return node
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                frontier.append(nxt)
    return None


class _KeptAttention(torch.autograd.Function):
    """q [B, h, S, d_qk], k [B, h_kv, S, d_qk], v [B, h_kv, S, d_v], doc_ids None or [B, S]
    -> [B, h, S, d_v]; see the module docstring. `owner` (the core module) pairs the recompute
    with its forward; call.keep False saves out/lse as ordinary saved tensors (replayed)."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, call: AttentionCall, owner: nn.Module):
        mask = None if doc_ids is None else dense_document_mask(doc_ids)
        ctx.call, ctx.owner = call, weakref.ref(owner)
        if not call.keep:
            out, lse, ctx.aux = attention_forward(call, q, k, v, mask)
            ctx.save_for_backward(q, k, v, doc_ids, out, lse)
            return out
        original = _original_node(owner) if _in_backward() else None
        kept = None if original is None else original.kept
        if kept is None or not kept.intact():
            out, lse, aux = attention_forward(call, q, k, v, mask)
            kept = _Kept(out, lse, aux, owner)
            if original is not None:  # its kept tensors are gone (a second backward): refill them
                original.kept = kept
        else:
            out = kept.out.detach()   # the recompute: no kernel
        ctx.kept = kept
        ctx.save_for_backward(q, k, v, doc_ids)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        call = ctx.call
        if not call.keep:
            q, k, v, doc_ids, out, lse = ctx.saved_tensors
            mask = None if doc_ids is None else dense_document_mask(doc_ids)
            aux = ctx.aux
        else:
            q, k, v, doc_ids = ctx.saved_tensors   # may start the checkpoint's recompute: read first
            mask = None if doc_ids is None else dense_document_mask(doc_ids)
            kept, ctx.kept = ctx.kept, None        # released once used
            if kept is None or not kept.intact():
                out, lse, aux = attention_forward(call, q, k, v, mask)
            else:
                out, lse, aux = kept.out, kept.lse, kept.aux
            del kept
        dq, dk, dv = attention_backward(call, grad_out, q, k, v, mask, out, lse, aux)
        return dq, dk, dv, None, None, None


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None,
                       call: AttentionCall, owner: nn.Module) -> torch.Tensor:
    """The core attention through explicit kernels: q [B, S, h, d_qk], k [B, S, h_kv, d_qk],
    v [B, S, h_kv, d_v], doc_ids None or [B, S] -> [B, S, h, d_v] (the core's layout).

    Args:
        call: the backend and whether to keep out/lse (AttentionCall).
        owner: the module this call belongs to; one call per owner per forward of a block.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                    # [B, heads, S, d]
    if doc_ids is not None:
        doc_ids = doc_ids.to(q.device)
    check_call(call, q, v, doc_ids)
    out = _KeptAttention.apply(q, k, v, doc_ids, call, owner)          # [B, h, S, d_v]
    return out.transpose(1, 2)                                          # [B, S, h, d_v]


def can_keep(backend: str, masked: bool) -> bool:
    """Whether `backend` can run the kept path (masks only on MASKED_BACKENDS)."""
    return not masked or backend in MASKED_BACKENDS


class KeepableCore(nn.Module):
    """A core attention module whose output and log-sum-exp can be kept across the recompute: the
    switch `keep` is set from outside, between steps (`keep_attention`). attention.py's
    ScaledDotProductAttention is one; this module needs no more of it than that."""

    def __init__(self):
        super().__init__()
        self.keep = False


def attention_cores(model: nn.Module) -> list[KeepableCore]:
    """Every core attention module (ScaledDotProductAttention) in `model`, Ulysses-wrapped or not."""
    return [m for m in model.modules() if isinstance(m, KeepableCore)]


def keep_attention(model: nn.Module, enabled: bool = True) -> int:
    """Switch keeping attention on or off for every core of `model`; returns how many cores.

    Call it between steps (not between a forward and its backward): a recompute must take the
    path its forward took."""
    cores = attention_cores(model)
    for core in cores:
        core.keep = bool(enabled)
    return len(cores)


def kept_entries(model: nn.Module | None = None) -> list[_Kept]:
    """Kept (out, lse) pairs still alive (of `model`'s cores, or all): empty once backward ran."""
    owners = None if model is None else {id(c) for c in attention_cores(model)}
    live = [e for e in list(_LIVE) if e.owner() is not None]
    return live if owners is None else [e for e in live if id(e.owner()) in owners]


def kept_attention_bytes(model_args, local_batch_size: int, seq_len: int, seq_degree: int = 1,
                         dtype_bytes: int = 2) -> int:
    """Device bytes one layer's kept attention holds from its forward to its backward, per rank.

    out B x S/D x h x d_v x dtype_bytes + lse B x S/D x h x 4 (fp32): under Ulysses the core
    sees S positions of h/D heads, the same count. Plain checkpointing holds neither between a
    block's forward and its backward, so the plan adds this for every checkpointed layer (a layer
    that is not checkpointed already saves out and lse for SDPA's own backward: no change).
    """
    v_dim = model_args.v_head_dim if model_args.attention == "mla" else model_args.head_dim
    positions = local_batch_size * (seq_len // seq_degree) * model_args.n_heads
    return positions * v_dim * dtype_bytes + positions * 4
