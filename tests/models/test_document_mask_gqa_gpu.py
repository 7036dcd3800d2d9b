"""FlexAttention document masking on CUDA at short sequences with GQA (found 2026-12-07).

On an H100 with torch 2.11, the compiled FlexAttention raised InductorError ("NoValidChoicesError:
No choices to select") for fp32 GQA inputs of fewer than 128 positions (S = 64 with h_kv = 1,
S = 127 with h_kv = 1 and 2), while S = 5, 128 and 129 ran, so a model with GQA and a document mask
crashed on the GPU for such sequence lengths. document_mask._flex now repeats the key/value heads
there (exact); values and gradients must match the per-document reference.
"""

from __future__ import annotations

import pytest
import torch

from mop_train.models.document_mask import document_attention, document_attention_reference
from tests.utils import assert_close, fresh_seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FlexAttention's compiled path)")
@pytest.mark.parametrize("S,h_kv", [(64, 1), (127, 2), (100, 2), (5, 1), (129, 1)])
def test_flex_gqa_below_one_block_matches_reference_fp32(S, h_kv, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)   # fp32 against the CPU reference
    g = torch.Generator().manual_seed(fresh_seed(7301 + S))
    B, h, d = 2, 4, 16
    doc = torch.cumsum((torch.rand(B, S, generator=g) < 0.1).int(), dim=1).to(torch.int32)
    q, k, v = (torch.randn(B, S, n, d, generator=g) for n in (h, h_kv, h_kv))
    gout = torch.randn(B, S, h, d, generator=g)
    got_in = [t.cuda().requires_grad_() for t in (q, k, v)]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    got = document_attention(*got_in, doc.cuda(), impl="flex")
    ref = document_attention_reference(*ref_in, doc)
    got.backward(gout.cuda())
    ref.backward(gout)
    assert_close(got, ref, rtol=1e-4, atol=1e-5, name=f"S={S} h_kv={h_kv} out")
    for name, a, b in zip("qkv", got_in, ref_in):
        assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, name=f"S={S} h_kv={h_kv} grad {name}")
