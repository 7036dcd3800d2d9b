"""The explicit kernel pairs on CPU: "cpu_flash" and "math" give bitwise F.scaled_dot_product_attention's
output and gradients (GQA, d_v != d_qk, document masks, fp32 and bf16); `sdpa_choice` names the
kernel F.sdpa runs; a backend that cannot take the inputs is a ValueError before any kernel runs.
The CUDA pairs are checked in test_keep_attention.py under the `gpu` marker."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mop_train.models.attention_backends import (AttentionCall, attention_backward, attention_forward,
                                                 check_call, sdpa_choice)
from mop_train.models.document_mask import dense_document_mask
from tests.utils import assert_bitwise_equal, fresh_seed

SHAPES = {"mha": (4, 4, 16, 16), "gqa": (4, 2, 16, 16), "mla": (4, 4, 24, 16)}  # h, h_kv, d_qk, d_v


def _inputs(shape, dtype, masked, seed):
    h, h_kv, d_qk, d_v = shape
    g = torch.Generator().manual_seed(seed)
    B, S = 2, 19
    q, k, v = (torch.randn(B, S, n, d, generator=g).to(dtype).transpose(1, 2)   # the core's views
               for n, d in ((h, d_qk), (h_kv, d_qk), (h_kv, d_v)))
    gout = torch.randn(B, h, S, d_v, generator=g).to(dtype)
    doc_ids = torch.cumsum(torch.rand(B, S, generator=g) < 0.2, dim=1)
    return q, k, v, gout, (dense_document_mask(doc_ids) if masked else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_cpu_pairs_are_bitwise_f_sdpa(name, masked, dtype):
    q, k, v, gout, mask = _inputs(SHAPES[name], dtype, masked, fresh_seed(100))
    gqa = k.shape[1] != q.shape[1]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    ref.backward(gout)
    backend = sdpa_choice(q, k, v, mask)
    assert backend == ("math" if name == "mla" else "cpu_flash")
    call = AttentionCall(backend=backend, gqa=gqa)
    check_call(call, q, v, mask)
    out, lse, aux = attention_forward(call, q, k, v, mask)
    grads = attention_backward(call, gout, q, k, v, mask, out, lse, aux)
    assert_bitwise_equal(out, ref.detach(), name=f"{backend} out")
    for t, ours, leaf in zip("qkv", grads, leaves):
        assert_bitwise_equal(ours, leaf.grad, name=f"{backend} d{t}")
    if backend == "cpu_flash":
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32


def test_calls_a_backend_cannot_take_are_value_errors():
    q, k, v, _, mask = _inputs(SHAPES["mla"], torch.float32, True, fresh_seed(101))
    with pytest.raises(ValueError, match="unknown"):
        check_call(AttentionCall(backend="fast"), q, v, None)
    with pytest.raises(ValueError, match="does not run on cpu"):
        check_call(AttentionCall(backend="efficient"), q, v, None)
    with pytest.raises(ValueError, match="needs d_v == d_qk"):
        check_call(AttentionCall(backend="cpu_flash"), q, v, None)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="takes no mask"):
            check_call(AttentionCall(backend="efficient"), q.cuda(), v.cuda(), mask.cuda())
