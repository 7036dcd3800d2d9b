"""Attention kernels as explicit (forward, backward) pairs: what F.scaled_dot_product_attention runs.

    call = AttentionCall(backend=sdpa_choice(q, k, v, mask), is_causal=True, gqa=False)
    out, lse, aux = attention_forward(call, q, k, v, mask)        # the kernel, no autograd graph
    dq, dk, dv = attention_backward(call, grad_out, q, k, v, mask, out, lse, aux)

Calling the kernels one by one (rather than through F.scaled_dot_product_attention's autograd
node) lets a caller keep `out` and `lse` wherever it likes (keep_attention.py keeps them across a
checkpoint's recompute) and pick the kernel per shape (`AttentionCall.backend`; issue 24 item 2
plugs a measured table in here). Backends:
  "math"        PyTorch's composite reference (F.sdpa forced to MATH). It has no log-sum-exp: its
                backward replays the composite forward and differentiates it, so its gradients are
                bitwise those of F.sdpa's math autograd (the CPU path when d_v != d_qk).
  "cpu_flash"   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): what F.sdpa runs on
                CPU when d_v == d_qk (bitwise the same calls; GQA native; boolean masks become
                0/-inf additive masks, as F.sdpa does).
  "flash"       CUDA FlashAttention-2 (needs d_v == d_qk; GQA native).
  "flash_pad_v" "flash" with v zero-padded to d_qk, the output sliced back to d_v: exact, since the
                padded columns of the output are p @ 0 = 0; the kept output is the d_v-wide slice.
  "efficient"   CUDA memory-efficient attention (any d_v; k/v repeated to h heads for GQA).
  "cudnn"       CUDA cuDNN attention (k/v repeated to h heads for GQA).
Masks (document masks, [B, 1, S, S] bool) are taken by "math" and "cpu_flash" only; the CUDA
backends here run plain causal attention. Scale is always 1/sqrt(d_qk) (the kernels' default).
The CUDA pairs follow torch's own autograd formulas (derivatives.yaml) but have not yet run on a
GPU: tests/models/test_keep_attention.py checks them there under the `gpu` marker.

Layout [B, heads, S, d] (SDPA's). Legend: B batch, h query heads, h_kv key/value heads, g = h / h_kv,
S sequence, d_qk / d_v head widths, lse log-sum-exp [B, h, S] fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("math", "cpu_flash", "flash", "flash_pad_v", "efficient", "cudnn")
MASKED_BACKENDS = ("math", "cpu_flash")
_ATEN = torch.ops.aten


@dataclass(frozen=True)
class AttentionCall:
    """The non-tensor arguments of one core attention call.

    backend: one of BACKENDS. is_causal: causal mask (ignored when a mask tensor is passed: the
    mask then says everything). gqa: h_kv < h. keep: keep out/lse across a checkpoint recompute
    (keep_attention.py) instead of saving them as ordinary saved tensors.
    """

    backend: str
    is_causal: bool = True
    gqa: bool = False
    keep: bool = True


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                is_causal: bool = True) -> str:
    """The backend F.scaled_dot_product_attention would run for these inputs ([B, heads, S, d])."""
    gqa = k.shape[1] != q.shape[1]
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal and mask is None, enable_gqa=gqa)
    if choice == int(SDPBackend.FLASH_ATTENTION.value):
        return "cpu_flash" if q.device.type == "cpu" else "flash"
    if choice == int(SDPBackend.EFFICIENT_ATTENTION.value):
        return "efficient"
    if choice == int(SDPBackend.CUDNN_ATTENTION.value):
        return "cudnn"
    return "math"


def check_call(call: AttentionCall, q: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """ValueError when `call.backend` cannot run these inputs (checked before any kernel runs)."""
    if call.backend not in BACKENDS:
        raise ValueError(f"attention backend {call.backend!r} is unknown; use one of {BACKENDS}")
    on_cpu = q.device.type == "cpu"
    if on_cpu != (call.backend in ("math", "cpu_flash")):
        raise ValueError(f"attention backend {call.backend!r} does not run on {q.device.type}; on CPU use "
                         f"\"cpu_flash\" or \"math\", on CUDA one of {BACKENDS[2:]} or \"math\"")
    if mask is not None and call.backend not in MASKED_BACKENDS:
        raise ValueError(f"attention backend {call.backend!r} takes no mask here; masked attention runs on "
                         f"{MASKED_BACKENDS}")
    if call.backend in ("cpu_flash", "flash") and q.shape[-1] != v.shape[-1]:
        raise ValueError(f"attention backend {call.backend!r} needs d_v == d_qk, got d_qk {q.shape[-1]}, "
                         f"d_v {v.shape[-1]}; use \"flash_pad_v\" (CUDA), \"efficient\" or \"math\"")


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """bool mask (True = attend) -> 0 / -inf in the query dtype, as F.sdpa converts it."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, h_kv, S, d] -> [B, h, S, d]: each kv head serves `groups` consecutive query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Adjoint of _repeat_kv: [B, h, S, d] -> [B, h_kv, S, d]."""
    return grad if groups == 1 else grad.unflatten(1, (grad.shape[1] // groups, groups)).sum(2)


def attention_forward(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None):
    """Run the forward kernel. q [B, h, S, d_qk], k [B, h_kv, S, d_qk], v [B, h_kv, S, d_v],
    mask None or [B, 1, S, S] bool -> (out [B, h, S, d_v], lse [B, h, S] fp32 or None, aux: what
    the backward kernel needs besides q, k, v, out, lse)."""
    causal = call.is_causal and mask is None
    groups = q.shape[1] // k.shape[1]
    b = call.backend
    if b == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=call.gqa)
        return out, None, ()
    if b == "cpu_flash":
        out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                      attn_mask=_additive(mask, q.dtype))
        return out, lse, ()
    if b in ("flash", "flash_pad_v"):
        d_v = v.shape[-1]
        if b == "flash_pad_v":
            v = F.pad(v, (0, q.shape[-1] - d_v))
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _ATEN._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        if b == "flash_pad_v":
            out = out[..., :d_v].contiguous()
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if b == "efficient":
        out, lse, seed, offset = _ATEN._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        return out, lse, (seed, offset)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _ATEN._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def attention_backward(call: AttentionCall, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor,
                       lse: torch.Tensor | None, aux: tuple):
    """Run the backward kernel on what `attention_forward` returned -> (dq, dk, dv), shaped as q, k, v."""
    causal = call.is_causal and mask is None
    groups = q.shape[1] // k.shape[1]
    b = call.backend
    if b == "math":  # no lse: replay the composite forward and differentiate it
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel([SDPBackend.MATH]):
                replay = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal,
                                                        enable_gqa=call.gqa)
            return torch.autograd.grad(replay, leaves, grad_out)
    if b == "cpu_flash":
        return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype))
    if b in ("flash", "flash_pad_v"):
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        d_v = v.shape[-1]
        if b == "flash_pad_v":
            pad = (0, q.shape[-1] - d_v)
            v, out, grad_out = F.pad(v, pad), F.pad(out, pad), F.pad(grad_out, pad)
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
        return dq, dk, dv[..., :d_v]
    k_full, v_full = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if b == "efficient":
        seed, offset = aux
        dq, dk, dv, _ = _ATEN._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k_full, v_full, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal)
    else:
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = _ATEN._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k_full, v_full, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)
