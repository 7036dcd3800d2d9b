"""Per-rank memory bound of Ring-DTP (bytes the op allocates beyond its inputs), for the planner.

The op's live set is fixed by (N, H, V, P, dtype, mode, block size), never by N x V:
  - one logits block [n_meet, b] (n_meet = N when weights move, N_max when activations move),
    plus fp32 temporaries of that block for the torch implementation;
  - two moving-operand buffers (the one in use and the one arriving): [S, H] or [N_max, H];
  - backward: the fp32 gradient of what stays (dW_r [S, H] or dX [N, H]) and two fp32 buffers of the
    travelling gradient, the final casts to the input dtype, bounded fp32 partial products; at P = 1
    in a 2-byte dtype dX accumulates inside dW's unwritten rows (local.single_shard_backward);
  - O(N_max) per-token fp32 accumulators;
  - inputs not in the compute dtype (an fp32 vocab shard under bf16 mixed precision, kept out of FSDP2
    at P > 1): their compute copies, cast whole in each pass, and the gradients' casts back.
That is the recompute schedule. The grad_in_forward schedule (grad_in_forward.py) keeps instead:
  - fp32 dW_r [S, H] and dX [N, H] from forward to backward, then their casts to the input dtypes;
  - per round: every owner's stored logits [c, V_r] (about c x V), its chunk [c, H], and at P > 1
    two fp32 dX accumulators [c, H] in flight; c tokens per chunk (`default_token_chunk`).
`ring_dtp_peak_bytes` sums every term that can be alive at once (an upper bound, not a prediction);
`ring_dtp_largest_tensor_bytes` is the largest single allocation, checked on CPU by the tests.

Paper section 3.2. Legend: N tokens (this rank), N_max (largest in the group), H hidden, V vocab,
P vocab-group size, S = ceil(V/P), b = min(block_size, S), c tokens per grad_in_forward chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mop_train.ops.bound import DeviceBound
from mop_train.ops.ring_dtp.local import FINAL_BLOCK_DIVISOR, borrowed_rows

MODES = ("auto", "move_activations", "move_weights")
SCHEDULES = ("auto", "recompute", "grad_in_forward")
_PARTIAL_ROWS = 2048      # rows of one fp32 partial product (see local.matmul_accumulate)
_PER_TOKEN_BYTES = 96     # stats, lse, loss, scale, targets and their in-flight copies, per token
_MIN_CHUNK_TOKENS = 2048  # grad_in_forward: c/4 flop per byte of dW_r traffic; 512 >> an H200's ~200


def resolve_mode(mode: str, n_max: int, vocab_size: int, group_size: int) -> str:
    """'auto' moves the weights exactly when the largest local token count exceeds ceil(V/P)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if mode != "auto":
        return mode
    shard_rows = -(-vocab_size // group_size)
    return "move_weights" if n_max > shard_rows else "move_activations"


def _grad_accumulator_bytes(n: int, n_max: int, s: int, h: int, p: int, mode: str) -> int:
    """fp32 gradient accumulators: dX always; at P > 1 also dW_r, and two of whichever travels."""
    if p == 1:
        return n * h * 4                                                # dW is written once, directly
    if mode == "move_weights":
        return n * h * 4 + 2 * s * h * 4
    return s * h * 4 + 2 * n_max * h * 4


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _cast_terms(n: int, s: int, h: int, p: int, dtype, hidden_dtype, weight_dtype, schedule: str) -> dict[str, int]:
    """Bytes for inputs not in the compute dtype `dtype` (None: in it): the compute copies of X [N, H] and
    W_r [S, H], cast whole in forward and again in backward (function.per_token_loss, _backward;
    grad_in_forward.RingDTPGradInForward.forward); and, for the recompute schedule, the gradients' casts
    back to their inputs' dtypes beyond the compute-dtype outputs `_terms` counts: at P = 1 dX and dW are
    formed in the compute dtype (local.single_shard_backward), at P > 1 in fp32, so an fp32 input costs
    a new tensor at P = 1 only. grad_in_forward's casts back are in its `outputs` term."""
    hidden_dtype, weight_dtype = hidden_dtype or dtype, weight_dtype or dtype
    it = _size(dtype)
    terms = {"input_casts": n * h * it * (hidden_dtype != dtype) + s * h * it * (weight_dtype != dtype)}
    if schedule == "recompute":
        formed = dtype if p == 1 else torch.float32
        terms["output_casts"] = (n * h * _size(hidden_dtype) * (hidden_dtype not in (formed, dtype))
                                 + s * h * _size(weight_dtype) * (weight_dtype not in (formed, dtype)))
    return terms


def _terms(n, h, v, p, dtype, mode, block_size, n_max, impl) -> dict[str, int]:
    it = torch.empty((), dtype=dtype).element_size()
    n_max = n if n_max is None else max(n_max, n)
    mode = resolve_mode(mode, n_max, v, p)
    s = -(-v // p)
    b = min(block_size, s)
    n_meet = n if mode == "move_weights" else n_max
    moving_rows = s if mode == "move_weights" else n_max
    per_elem = it if impl == "triton" else 2 * it + 12                  # torch: fp32 copies of the block
    terms = {
        "tokens": _PER_TOKEN_BYTES * n_max,
        "logits_block": n_meet * b * per_elem,
        "moving_operand": 2 * moving_rows * h * it if p > 1 else 0,
        "grad_accumulators": _grad_accumulator_bytes(n, n_max, s, h, p, mode),
        "grad_outputs": (n + s) * h * it,                                # dX, dW_r in the input dtype
        "partials": min(_PARTIAL_ROWS, max(n_meet, b)) * h * 4 if it < 4 else 0,
    }
    if p == 1 and borrowed_rows(n, h, v, dtype):  # dX accumulates inside dW's unwritten rows
        b_final = min(b, max(1, block_size // FINAL_BLOCK_DIVISOR))
        terms["grad_accumulators"] = 0
        terms["grad_outputs"] = s * h * it
        terms["logits_block"] = max(n * b * per_elem, n * h * it + n * b_final * per_elem)
    if impl != "triton":  # CPU fp32 upcasts of one block's operands (local.matmul_accumulate)
        terms["partials"] += (n_meet * b + (n_meet + b) * h) * 4
    return terms


def default_token_chunk(n_max: int, v: int, p: int, block_size: int) -> int:
    """c for grad_in_forward: a round's stored logits (P chunks x S columns) hold as many elements as
    one recompute logits block (N_max x b), and c >= _MIN_CHUNK_TOKENS where the tokens allow: every
    round reads and writes the fp32 dW_r once, so its GEMM does 2cSH flops per 8SH bytes."""
    s = -(-v // p)
    return max(1, min(n_max, max(_MIN_CHUNK_TOKENS, n_max * min(block_size, s) // (p * s))))


def _grad_in_forward_terms(n, h, v, p, dtype, block_size, n_max, impl, token_chunk, hidden_dtype, weight_dtype):
    it = _size(dtype)
    it_x, it_w = _size(hidden_dtype or dtype), _size(weight_dtype or dtype)
    n_max = n if n_max is None else max(n_max, n)
    s = -(-v // p)
    b = min(block_size, s)
    c = min(token_chunk or default_token_chunk(n_max, v, p, block_size), max(n_max, 1))
    round_bytes = p * c * s * it + (p + 1) * c * h * it * (p > 1) + 2 * c * h * 4 * (p > 1) + 48 * p * c
    if impl != "triton":  # fp32 temporaries of one [c, b] column block and the upcast GEMM operands
        round_bytes += c * b * (16 + it) + (c * b + (c + b) * h) * 4
    elif it < 4:          # fp32 partial products where the fused fp32-output addmm is missing
        round_bytes += _PARTIAL_ROWS * h * 4
    outputs = n * h * it_x * (it_x < 4) + s * h * it_w * (it_w < 4)  # backward's casts; fp32 scales in place
    return {
        "tokens": _PER_TOKEN_BYTES * n_max,
        "stored_grads": n * h * 4 + s * h * 4,                       # fp32 dX, dW_r: forward -> backward
        "round_or_outputs": max(round_bytes, outputs),
    }


def ring_dtp_peak_bytes(n: int, h: int, v: int, p: int, *, dtype: torch.dtype, mode: str = "auto",
                        block_size: int = 8192, n_max: int | None = None, impl: str = "triton",
                        schedule: str = "recompute", token_chunk: int | None = None,
                        hidden_dtype: torch.dtype | None = None, weight_dtype: torch.dtype | None = None) -> int:
    """Upper bound on the bytes one rank allocates in forward + backward (inputs excluded).

    Args:
        n: this rank's tokens; n_max: the largest count in the group (defaults to n).
        h, v, p: hidden size, vocabulary size, vocab-group size.
        dtype: the compute dtype (hidden's, or autocast's); mode: as for `ring_dtp_cross_entropy`
            ("auto" resolved with n_max; grad_in_forward always moves activations); block_size:
            vocabulary rows per logits block; impl: "triton" or "torch".
        schedule: "recompute" or "grad_in_forward"; token_chunk: c for grad_in_forward (None:
            `default_token_chunk`).
        hidden_dtype, weight_dtype: the inputs' dtypes where not `dtype` (None: `dtype`), e.g. the fp32
            vocab shard under bf16 mixed precision; their casts both ways are counted.
    """
    s = -(-v // p)
    casts = sum(_cast_terms(n, s, h, p, dtype, hidden_dtype, weight_dtype, schedule).values())
    if schedule == "grad_in_forward":
        return casts + sum(_grad_in_forward_terms(n, h, v, p, dtype, block_size, n_max, impl, token_chunk,
                                                  hidden_dtype, weight_dtype).values())
    if schedule != "recompute":
        raise ValueError(f"schedule={schedule!r} must be 'recompute' or 'grad_in_forward' for a bound")
    return casts + sum(_terms(n, h, v, p, dtype, mode, block_size, n_max, impl).values())


def ring_dtp_largest_tensor_bytes(n: int, h: int, v: int, p: int, *, dtype: torch.dtype, mode: str = "auto",
                                  block_size: int = 8192, n_max: int | None = None,
                                  impl: str = "triton", schedule: str = "recompute",
                                  token_chunk: int | None = None) -> int:
    """The largest single tensor the op may allocate (same arguments as `ring_dtp_peak_bytes`)."""
    n_max = n if n_max is None else max(n_max, n)
    s = -(-v // p)
    b = min(block_size, s)
    if schedule == "grad_in_forward":
        it = torch.empty((), dtype=dtype).element_size()
        c = min(token_chunk or default_token_chunk(n_max, v, p, block_size), max(n_max, 1))
        candidates = [c * s * it, n * h * 4, s * h * 4, c * h * 4, 12 * p * c, 12 * n_max]
        if impl != "triton":
            candidates += [c * b * 4, b * h * 4]
        return max(candidates)
    resolved = resolve_mode(mode, n_max, v, p)
    n_meet = n if resolved == "move_weights" else n_max
    candidates = [n_meet * b * 4, n_max * h * 4, s * h * 4, 12 * n_max]  # block, dX, dW, stats
    if impl != "triton":
        candidates += [n_meet * h * 4, b * h * 4]                         # fp32 upcasts of X, W block
    return max(candidates)


@dataclass(frozen=True)
class RingDTPSettings:
    """The [mop.ring_dtp] settings that size the bound (schedule resolved: "recompute" or "grad_in_forward")."""
    mode: str = "auto"
    schedule: str = "recompute"
    block_size: int = 8192
    token_chunk: int | None = None


@dataclass(frozen=True)
class VocabShapes:
    """The loss's sizes on this rank."""
    tokens: int             # N
    hidden: int             # H
    vocab: int              # V
    vocab_degree: int       # P
    dtype: torch.dtype      # the compute dtype
    weight_dtype: torch.dtype | None = None  # the shard's, where not the compute dtype (an fp32 vocab shard)


def device_bound(settings: RingDTPSettings, shapes: VocabShapes) -> DeviceBound:
    """Ring-DTP's working set (`ring_dtp_peak_bytes`): alive only while the loss runs forward and backward."""
    s = shapes
    peak = ring_dtp_peak_bytes(s.tokens, s.hidden, s.vocab, s.vocab_degree, dtype=s.dtype, mode=settings.mode,
                               block_size=settings.block_size, schedule=settings.schedule,
                               token_chunk=settings.token_chunk, weight_dtype=s.weight_dtype)
    return DeviceBound(0, peak, f"Ring-DTP bound ({settings.schedule}, P={s.vocab_degree})")
