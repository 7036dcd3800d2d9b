"""One meeting of Ring-DTP: a set of tokens against one vocabulary shard, one block of rows at a time.

forward  (`fold_shard`):     for each block of b shard rows, z = X W_blk^T [n, b] (input dtype, fp32
                             accumulation inside the matmul), folded into the per-token accumulators
                             stats [3, n] = (running max, running sum-exp, target logit), all fp32.
backward (`shard_backward`): the same blocks are recomputed; z becomes g = scale * (softmax - onehot)
                             using the saved per-token log-sum-exp; dX += g W_blk and dW_blk += g^T X,
                             both accumulated in fp32 (dW_blk is written directly when this meeting is
                             the shard's only one, i.e. P = 1).
The largest temporary is one logits block [n, b]; `impl` picks Triton kernels (GPU) or torch ops.
grad_in_forward (`block_stats`, `block_grad_`, `add_dx`, `add_dw`) instead keeps one block
[n, V_r] per token chunk: its partial accumulators first, then, once the chunk's lse is known, the
gradient in place and the two GEMMs (one each on the GPU, b columns at a time on the torch path).

Paper section 3.2. Legend: n tokens in the meeting, H hidden, b block rows, V_r shard rows.
"""

from __future__ import annotations

import torch

_LOW_PRECISION_ROWS = 2048  # rows per fp32 partial product when the cuBLAS fp32-output addmm is missing
FINAL_BLOCK_DIVISOR = 8    # single_shard_backward's last step uses blocks of block_size // 8 rows
_FUSED_FP32_ADDMM: dict[str, bool] = {}  # device type -> whether addmm(out_dtype=fp32, out=acc) works


def _kernels():
    """The Triton block kernels (impl="triton", CUDA), imported at first use: a CPU install has no triton."""
    from mop_train.ops.ring_dtp import kernels
    return kernels


def new_stats(n: int, device: torch.device) -> torch.Tensor:
    """Empty accumulators [3, n] fp32: running max -inf, running sum 0, target logit 0."""
    stats = torch.zeros(3, n, dtype=torch.float32, device=device)
    stats[0].fill_(float("-inf"))
    return stats


def _torch_lse_update(z: torch.Tensor, targets: torch.Tensor, offset: int, stats: torch.Tensor) -> None:
    z = z.float()                                                       # [n, b]
    block_max = z.amax(dim=1)                                           # [n]
    new_max = torch.maximum(stats[0], block_max)
    block_sum = torch.exp(z - new_max[:, None]).sum(dim=1)              # [n]
    stats[1].mul_(torch.exp(stats[0] - new_max)).add_(block_sum)
    stats[0].copy_(new_max)
    local = targets - offset
    hit = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    stats[2].copy_(torch.where(hit, picked, stats[2]))


def _torch_softmax_grad(z: torch.Tensor, targets: torch.Tensor, offset: int, lse: torch.Tensor,
                        scale: torch.Tensor) -> torch.Tensor:
    grad = torch.exp(z.float() - lse[:, None])                          # [n, b] softmax columns
    local = targets - offset
    hit = (local >= 0) & (local < z.shape[1])
    rows = torch.nonzero(hit).squeeze(1)
    grad[rows, local[rows]] -= 1.0
    return (grad * scale[:, None]).to(z.dtype)


def fold_shard(x: torch.Tensor, w: torch.Tensor, offset: int, targets: torch.Tensor, stats: torch.Tensor, *,
               block_size: int, impl: str) -> None:
    """Fold logits x [n, H] @ w [V_r, H]^T (global columns offset..offset+V_r) into stats [3, n]."""
    if x.shape[0] == 0:
        return
    for start in range(0, w.shape[0], block_size):
        z = x @ w[start:start + block_size].t()                         # [n, b] the only logits block
        if impl == "triton":
            _kernels().lse_update_(z, targets, offset + start, stats)
        else:
            _torch_lse_update(z, targets, offset + start, stats)
        del z


def _fused_addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """acc += a @ b with one fp32-output cuBLAS call, if this torch build supports it on acc's device."""
    kind = acc.device.type
    if _FUSED_FP32_ADDMM.get(kind) is False:
        return False
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        _FUSED_FP32_ADDMM[kind] = False
        return False
    _FUSED_FP32_ADDMM[kind] = True
    return True


def matmul_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc [M, K] fp32 += a [M, J] @ b [J, K], accumulating in fp32 whatever the dtype of a and b."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _fused_addmm_fp32(acc, a, b):
        return
    for start in range(0, a.shape[0], _LOW_PRECISION_ROWS):             # bounded fp32 partial products
        rows = slice(start, start + _LOW_PRECISION_ROWS)
        if acc.is_cuda:
            acc[rows].add_(torch.mm(a[rows], b, out_dtype=torch.float32))
        else:
            acc[rows].addmm_(a[rows].float(), b.float())


def shard_backward(x: torch.Tensor, w: torch.Tensor, offset: int, targets: torch.Tensor, lse: torch.Tensor,
                   scale: torch.Tensor, dx: torch.Tensor | None, dw: torch.Tensor | None, *, accumulate_dw: bool,
                   block_size: int, impl: str) -> None:
    """Add this meeting's gradients: dx [n, H] fp32 += g @ w; dw [V_r, H] (+)= g^T @ x.

    lse [n] and scale [n] are fp32 (scale = upstream gradient, 0 for ignored tokens). With
    accumulate_dw=False, dw (w's dtype) is overwritten block by block: the meeting is its only term.
    dx or dw may be None to skip that gradient.
    """
    if x.shape[0] == 0:
        if dw is not None and not accumulate_dw:
            dw.zero_()
        return
    for start in range(0, w.shape[0], block_size):
        w_blk = w[start:start + block_size]                             # [b, H]
        z = x @ w_blk.t()                                               # [n, b] recomputed logits
        if impl == "triton":
            _kernels().softmax_grad_(z, targets, offset + start, lse, scale)
            g = z                                                       # gradient written in place
        else:
            g = _torch_softmax_grad(z, targets, offset + start, lse, scale)
        del z
        if dx is not None:
            matmul_accumulate(dx, g, w_blk)
        if dw is not None and accumulate_dw:
            matmul_accumulate(dw[start:start + block_size], g.t(), x)
        elif dw is not None:
            torch.mm(g.t(), x, out=dw[start:start + block_size])
        del g


def borrowed_rows(n: int, h: int, vocab_rows: int, dtype: torch.dtype) -> int:
    """Rows of a [V_r, H] gradient in `dtype` that can host the fp32 dX accumulator [n, H]; 0 if none.

    Used when the shard has one meeting (P = 1): its dW rows are written once, so the rows not yet
    written can hold dX's fp32 accumulator (only for 2-byte dtypes, where it saves memory).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = 2 * n
    if itemsize != 2 or n == 0 or (h * itemsize) % 4 or rows > vocab_rows:
        return 0
    return rows


def single_shard_backward(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                          scale: torch.Tensor, *, block_size: int, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, dW) when one shard holds the whole vocabulary (P = 1), in the input dtype.

    With a 2-byte dtype the fp32 dX accumulator lives in the last 2n rows of dW's storage:
      1. rows [0, V-2n): dX += g W_blk, dW_blk = g^T X written in place;
      2. rows [V-2n, V): dX += g W_blk only; dX is cast out of the borrowed rows;
      3. rows [V-2n, V) again (recomputed): dW_blk = g^T X overwrites the accumulator, in blocks of
         block_size // 8 rows so that the dX output, alive from step 2 on, is paid for by a smaller
         logits block (FINAL_BLOCK_DIVISOR).
    Same arithmetic as the plain schedule; costs 2n/V of one logits recompute, saves n*H*4 bytes.
    """
    n, h = x.shape
    vocab = w.shape[0]
    dw = torch.empty_like(w)                                            # [V, H]
    rows = borrowed_rows(n, h, vocab, w.dtype)
    opts = dict(block_size=block_size, impl=impl, accumulate_dw=False)
    if rows == 0:
        dx = torch.zeros(n, h, dtype=torch.float32, device=x.device)
        shard_backward(x, w, 0, targets, lse, scale, dx, dw, **opts)
        return dx.to(x.dtype), dw
    split = vocab - rows
    acc = dw[split:].view(torch.float32).view(n, h).zero_()            # [n, H] fp32 inside dW
    shard_backward(x, w[:split], 0, targets, lse, scale, acc, dw[:split], **opts)
    shard_backward(x, w[split:], split, targets, lse, scale, acc, None, **opts)
    dx = acc.to(x.dtype)
    del acc
    opts["block_size"] = max(1, block_size // FINAL_BLOCK_DIVISOR)
    shard_backward(x, w[split:], split, targets, lse, scale, None, dw[split:], **opts)
    return dx, dw


# grad_in_forward: one stored partial-logits block [n, V_r] per (token chunk, shard), read twice.

def block_stats(z: torch.Tensor, targets: torch.Tensor, offset: int, *, block_size: int, impl: str) -> torch.Tensor:
    """Partial accumulators [3, n] (max, sum-exp, target logit) of a stored logits block z [n, V_r]
    whose columns are global rows offset..offset+V_r; the torch path reads b columns at a time."""
    stats = new_stats(z.shape[0], z.device)
    if impl == "triton":
        _kernels().lse_update_(z, targets, offset, stats)
        return stats
    for start in range(0, z.shape[1], block_size):
        _torch_lse_update(z[:, start:start + block_size], targets, offset + start, stats)
    return stats


def block_grad_(z: torch.Tensor, targets: torch.Tensor, offset: int, lse: torch.Tensor, scale: torch.Tensor, *,
                block_size: int, impl: str) -> None:
    """Overwrite the stored block z [n, V_r] with scale * (softmax - onehot), from the final lse [n]."""
    if impl == "triton":
        _kernels().softmax_grad_(z, targets, offset, lse, scale)
        return
    for start in range(0, z.shape[1], block_size):
        cols = slice(start, start + block_size)
        z[:, cols] = _torch_softmax_grad(z[:, cols], targets, offset + start, lse, scale)


def _gemm_columns(w: torch.Tensor, block_size: int, impl: str) -> int:
    """Shard rows per GEMM: the whole shard on the GPU (one large GEMM, fp32 output in cuBLAS), a
    block on the torch path (its fp32 upcasts of the operands stay block-sized)."""
    return max(1, w.shape[0] if impl == "triton" else block_size)


def add_dx(acc: torch.Tensor, g: torch.Tensor, w: torch.Tensor, *, block_size: int, impl: str) -> None:
    """acc [n, H] fp32 += g [n, V_r] @ w [V_r, H]."""
    cols = _gemm_columns(w, block_size, impl)
    for start in range(0, w.shape[0], cols):
        matmul_accumulate(acc, g[:, start:start + cols], w[start:start + cols])


def add_dw(acc: torch.Tensor, g: torch.Tensor, x: torch.Tensor, *, block_size: int, impl: str) -> None:
    """acc [V_r, H] fp32 += g [n, V_r]^T @ x [n, H]."""
    if x.shape[0] == 0:
        return
    cols = _gemm_columns(acc, block_size, impl)
    for start in range(0, acc.shape[0], cols):
        matmul_accumulate(acc[start:start + cols], g[:, start:start + cols].t(), x)
