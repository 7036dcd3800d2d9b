"""The attention core's backward workspace (models.memory.core_workspace_bytes) against the kernels.

On CPU: the term's dependence on the shape (fp32 dq accumulator per query head and width, FA2's rounding,
GQA's repeated heads), so a wrong factor fails. On CUDA (gpu marker): the bytes the cuDNN backward
actually adds beyond q, k, v, out, lse, the output's gradient and dq, dk, dv, at `small`'s core shape."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mop_train.models import zoo
from mop_train.models.memory import core_workspace_bytes


def test_cudnn_term_is_an_fp32_dq_and_a_row_sum_per_query_head():
    a = zoo.get_model_args("small")                         # MLA: d_qk 192 != d_v 128 -> cuDNN
    h, d_qk = a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
    for n in (1, 1000, 1 << 20):
        assert core_workspace_bytes(a, n) == n * 4 * h * (d_qk + 1)
    wider = replace(a, n_heads=2 * h)
    assert core_workspace_bytes(wider, 4096) == 2 * core_workspace_bytes(a, 4096)


def test_flash_term_rounds_rows_to_128_and_width_to_32_and_gqa_adds_heads():
    g = zoo.get_model_args("gpt-oss-20b-shape")             # GQA 64/8 heads of width 64 (d_qk == d_v)
    h, h_kv, d = g.n_heads, g.n_kv_heads, g.head_dim
    mha = replace(g, n_kv_heads=h)
    n = 1000                                                # 1024 rows after rounding
    flash = 1024 * 4 * h * (d + 1)
    assert core_workspace_bytes(mha, n) == max(n * 4 * h * (d + 1), flash)
    gqa_cudnn = n * 4 * h * (d + 1) + n * 2 * (3 * h - 2 * h_kv) * 2 * d
    gqa_flash = flash + n * 2 * h * 2 * d
    assert core_workspace_bytes(g, n) == max(gqa_cudnn, gqa_flash)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudnn_backward_workspace_matches_the_term_on_the_gpu():
    from mop_train.models.attention_backends import AttentionCall, attention_backward, attention_forward

    a, S = zoo.get_model_args("small"), 65536
    h, d_qk, d_v = a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, h, S, d_qk, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    v = torch.randn(1, h, S, d_v, device="cuda", dtype=torch.bfloat16, generator=gen)
    call = AttentionCall(backend="cudnn")
    out, lse, aux = attention_forward(call, q, k, v)
    grad = torch.randn_like(out)
    attention_backward(call, grad, q, k, v, None, out, lse, aux)      # warm-up (graph build)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dq, dk, dv = attention_backward(call, grad, q, k, v, None, out, lse, aux)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - sum(t.numel() * t.element_size() for t in (dq, dk, dv))
    planned = core_workspace_bytes(a, S)
    assert planned <= extra <= planned + (64 << 20), (extra, planned)
