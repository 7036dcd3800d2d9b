"""Document masking: document ids, the masked cores against the per-document reference (values and
gradients), the unchanged default path, Ulysses with document ids, and the model-level promise
that a packed document sees nothing of the document before it."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mop_train.models import zoo
from mop_train.models.attention import ScaledDotProductAttention
from mop_train.models.document_mask import (document_attention, document_attention_reference,
                                            document_ids)
from mop_train.parallel.ulysses import UlyssesAttention
from tests.dist_utils import run_distributed
from tests.utils import assert_bitwise_equal, assert_close, fresh_seed

EOS = 1
SHAPES = {  # (h, h_kv, d_qk, d_v)
    "gqa": (4, 2, 16, 16),
    "mla": (4, 4, 24, 16),
}


def _layouts(S: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Document ids [2, S] for several packings: one document, all length 1, random boundaries."""
    random_eos = torch.rand(2, S, generator=g) < 0.25
    tokens = torch.where(random_eos, EOS, 5)
    tokens[0, 0] = EOS                                               # an EOS first: a length-1 document
    return {
        "one_document": torch.zeros(2, S, dtype=torch.int32),
        "length_one": torch.arange(S, dtype=torch.int32).expand(2, S).contiguous(),
        "random": document_ids(tokens, EOS),
        "mixed_rows": torch.stack([torch.zeros(S, dtype=torch.int32), torch.arange(S, dtype=torch.int32) // 3]),
    }


def _qkv(B, S, h, h_kv, d_qk, d_v, g):
    return (torch.randn(B, S, h, d_qk, generator=g), torch.randn(B, S, h_kv, d_qk, generator=g),
            torch.randn(B, S, h_kv, d_v, generator=g))


# ------------------------------------------------------------------------------------------------
# document_ids
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, expected", [
    ([1, 5, 6, 1, 7], [0, 1, 1, 1, 2]),           # EOS first
    ([5, 6, 1, 7, 1], [0, 0, 0, 1, 1]),           # EOS last
    ([5, 1, 1, 1, 6], [0, 0, 1, 2, 3]),           # consecutive EOS: length-1 documents
    ([5, 6, 7, 8, 9], [0, 0, 0, 0, 0]),           # no EOS
    ([1], [0]),
])
def test_document_ids_hand_cases(tokens, expected):
    ids = document_ids(torch.tensor([tokens]), eos_id=EOS)
    assert ids.dtype == torch.int32
    assert ids.tolist() == [expected]


def test_document_ids_random_match_a_loop():
    g = torch.Generator().manual_seed(fresh_seed(1))
    tokens = torch.randint(0, 4, (3, 50), generator=g)
    ids = document_ids(tokens, eos_id=2)
    for row, got in zip(tokens.tolist(), ids.tolist()):
        doc, expected = 0, []
        for t in row:
            expected.append(doc)
            doc += t == 2
        assert got == expected


def test_document_ids_rejects_a_flat_tensor():
    with pytest.raises(ValueError, match=r"tokens must be \[B, S\]"):
        document_ids(torch.tensor([1, 2, 3]), eos_id=1)


# ------------------------------------------------------------------------------------------------
# The masked cores
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("S", [13, 40])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sdpa_mask_matches_per_document_reference(shape, S):
    h, h_kv, d_qk, d_v = SHAPES[shape]
    g = torch.Generator().manual_seed(fresh_seed(10 + S))
    for name, doc_ids in _layouts(S, g).items():
        q, k, v = _qkv(2, S, h, h_kv, d_qk, d_v, g)
        gout = torch.randn(2, S, h, d_v, generator=g)
        got_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        got = document_attention(*got_in, doc_ids, impl="sdpa_mask")
        ref = document_attention_reference(*ref_in, doc_ids)
        got.backward(gout)
        ref.backward(gout)
        assert_close(got, ref, rtol=1e-5, atol=1e-6, name=f"{name} out")
        for t, a, b in zip("qkv", got_in, ref_in):  # atol: a length-1 document's q gradient is 0 +- roundoff
            assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, name=f"{name} grad {t}")


def test_flex_forward_matches_reference_on_cpu():
    """FlexAttention has no CPU backward: its gradients are checked by the GPU test below."""
    g = torch.Generator().manual_seed(fresh_seed(20))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                               # "flex_attention called without compile"
        for shape, (h, h_kv, d_qk, d_v) in SHAPES.items():
            for S in (13, 150):
                for name, doc_ids in _layouts(S, g).items():
                    if S > 128 and name != "random":
                        continue                                      # eager flex is slow on CPU
                    q, k, v = _qkv(2, S, h, h_kv, d_qk, d_v, g)
                    with torch.no_grad():
                        got = document_attention(q, k, v, doc_ids, impl="flex")
                    assert_close(got, document_attention_reference(q, k, v, doc_ids), rtol=1e-5, atol=1e-6,
                                 name=f"{shape} S={S} {name}")


@pytest.mark.parametrize("B, S", [(0, 4), (2, 0)])
def test_empty_inputs(B, S):
    q, k, v = (t.requires_grad_() for t in _qkv(B, S, 4, 2, 8, 6, torch.Generator().manual_seed(0)))
    doc_ids = torch.zeros(B, S, dtype=torch.int32)
    for out in (document_attention(q, k, v, doc_ids, impl="sdpa_mask"), document_attention_reference(q, k, v, doc_ids)):
        assert out.shape == (B, S, 4, 6)
        out.sum().backward()
        assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_flex_mask_cache_follows_new_and_changed_doc_ids():
    """The BlockMask is reused only for the very same, unchanged doc_ids tensor."""
    q, k, v = _qkv(1, 9, 2, 2, 8, 8, torch.Generator().manual_seed(fresh_seed(25)))
    doc_ids = torch.zeros(1, 9, dtype=torch.int32)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for _ in range(2):
            assert_close(document_attention(q, k, v, doc_ids, impl="flex"),
                         document_attention_reference(q, k, v, doc_ids), name="one document")
            doc_ids[0, 4:] = 1                                        # in place: a new version
            assert_close(document_attention(q, k, v, doc_ids, impl="flex"),
                         document_attention_reference(q, k, v, doc_ids), name="two documents")
            doc_ids = torch.zeros(1, 9, dtype=torch.int32)            # a new tensor


def test_flex_refuses_a_cpu_backward_with_a_clear_error():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 5, 2, 2, 8, 8, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="sdpa_mask"):
        document_attention(q, k, v, torch.zeros(1, 5, dtype=torch.int32), impl="flex")


def test_bad_arguments_are_value_errors():
    q, k, v = _qkv(1, 6, 2, 2, 8, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"doc_ids has shape \(1, 5\)"):
        document_attention(q, k, v, torch.zeros(1, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="integer"):
        document_attention(q, k, v, torch.zeros(1, 6))
    with pytest.raises(ValueError, match="impl = 'triton'"):
        document_attention(q, k, v, torch.zeros(1, 6, dtype=torch.int32), impl="triton")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_without_doc_ids_the_core_is_the_plain_causal_call(shape):
    h, h_kv, d_qk, d_v = SHAPES[shape]
    g = torch.Generator().manual_seed(fresh_seed(30))
    q, k, v = _qkv(2, 17, h, h_kv, d_qk, d_v, g)
    got = ScaledDotProductAttention()(q, k, v)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=h != h_kv).transpose(1, 2)
    assert_bitwise_equal(got, ref)
    masked = ScaledDotProductAttention()(q, k, v, torch.zeros(2, 17, dtype=torch.int32))
    assert_close(masked, ref, name="one document = plain causal")


def _check_flex_on_cuda(h, h_kv, d_qk, d_v, S, g):
    """Flex (CUDA, fp32) against the per-document reference: output and the grads of q, k, v."""
    for name, doc_ids in _layouts(S, g).items():
        q, k, v = _qkv(2, S, h, h_kv, d_qk, d_v, g)
        gout = torch.randn(2, S, h, d_v, generator=g)
        got_in = [t.cuda().requires_grad_() for t in (q, k, v)]
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        got = document_attention(*got_in, doc_ids.cuda(), impl="flex")
        ref = document_attention_reference(*ref_in, doc_ids)
        got.backward(gout.cuda())
        ref.backward(gout)
        tag = f"h={h} h_kv={h_kv} S={S} {name}"
        assert_close(got, ref, rtol=1e-4, atol=1e-5, name=f"{tag} out")
        for t, a, b in zip("qkv", got_in, ref_in):
            assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, name=f"{tag} grad {t}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_flex_on_cuda_matches_reference_with_gradients(shape, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)   # fp32 against the CPU reference
    g = torch.Generator().manual_seed(fresh_seed(40))
    for S in (300, 1024):
        _check_flex_on_cuda(*SHAPES[shape], S, g)


@pytest.mark.gpu
@pytest.mark.parametrize("S,h_kv", [(64, 1), (127, 2), (100, 2), (5, 1), (129, 1)])
def test_flex_on_cuda_gqa_below_one_block(S, h_kv, monkeypatch):
    """GQA under 128 positions (found 2026-12-07 on an H100, torch 2.11): the compiled FlexAttention raised
    InductorError "NoValidChoicesError" for fp32 GQA at S = 64 (h_kv = 1) and 127 (h_kv = 1, 2), while
    S = 5, 128 and 129 ran; `_flex` repeats the key/value heads there (exact)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    _check_flex_on_cuda(4, h_kv, 16, 16, S, torch.Generator().manual_seed(fresh_seed(7301 + S)))


# ------------------------------------------------------------------------------------------------
# Ulysses
# ------------------------------------------------------------------------------------------------

def _ulysses_with_doc_ids(rank, world_size, seed):
    g = torch.Generator().manual_seed(seed)
    S_l = 3
    S = S_l * world_size
    for h, h_kv, d_qk, d_v in ((2 * world_size, world_size, 16, 16), (world_size, world_size, 24, 16)):
        for name, doc_ids in _layouts(S, g).items():
            q, k, v = _qkv(2, S, h, h_kv, d_qk, d_v, g)
            gout = torch.randn(2, S, h, d_v, generator=g)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = document_attention(*full, doc_ids, impl="sdpa_mask")
            ref.backward(gout)
            sl = slice(rank * S_l, (rank + 1) * S_l)
            mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
            out = UlyssesAttention(ScaledDotProductAttention(), dist.group.WORLD)(*mine, doc_ids)
            out.backward(gout[:, sl])
            assert_close(out, ref[:, sl], name=f"{name} h={h} out")
            for t, a, b in zip("qkv", mine, full):
                assert_close(a.grad, b.grad[:, sl], atol=1e-5, name=f"{name} h={h} grad {t}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_with_doc_ids_equals_the_single_rank_core(world_size):
    run_distributed(_ulysses_with_doc_ids, world_size, fresh_seed(50 + world_size))


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------

def _model_variants():
    debug = zoo.get_model_args("debug")
    return {"mla": debug, "gqa": replace(debug, attention="gqa", n_heads=4, n_kv_heads=2, head_dim=16)}


@pytest.mark.parametrize("variant", list(_model_variants()))
def test_packed_document_sees_only_itself(variant):
    """[doc A, EOS, doc B, EOS] with the mask: doc B's hidden states are those of doc B alone at
    the same global positions; without the mask they are not."""
    args = _model_variants()[variant]
    g = torch.Generator().manual_seed(fresh_seed(60))
    torch.manual_seed(fresh_seed(61))
    model = zoo.build_model(args, dtype=torch.float32)
    doc_a, doc_b = torch.randint(2, args.vocab_size, (7,), generator=g), torch.randint(2, args.vocab_size, (9,), generator=g)
    eos = torch.tensor([EOS])
    packed = torch.cat([doc_a, eos, doc_b, eos])[None]                    # [1, 18]
    start = doc_a.numel() + 1
    alone = packed[:, start:]                                             # [1, 10]
    with torch.no_grad():
        masked = model(packed, doc_ids=document_ids(packed, EOS))
        plain = model(packed)
        ref = model(alone, positions=torch.arange(start, packed.shape[1]))
    assert_close(masked[:, start:], ref, rtol=1e-5, atol=1e-5, name="doc B with the mask")
    assert not torch.allclose(plain[:, start:], ref, rtol=1e-3, atol=1e-3), "the mask changed nothing"
    assert_close(masked[:, :start], plain[:, :start], rtol=1e-5, atol=1e-5, name="doc A")


def test_model_rejects_doc_ids_of_the_wrong_shape():
    model = zoo.build_model("debug", dtype=torch.float32)
    tokens = torch.randint(2, 100, (2, 8))
    for bad in (torch.zeros(1, 8, dtype=torch.int32), torch.zeros(2, 7, dtype=torch.int32),
                torch.zeros(8, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"doc_ids must be \[B, S_full\]"):
            model(tokens, doc_ids=bad)
