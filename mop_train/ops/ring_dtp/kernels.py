"""Triton kernels for one vocabulary block of Ring-DTP: online log-sum-exp and softmax gradient.

A block of logits z [n, b] (one vocab block of one shard, formed by a cuBLAS matmul) is read row by
row. Forward folds it into the per-token accumulators (running max, running sum of exponentials,
target logit); backward overwrites it in place with the loss gradient wrt the logits, ready for the
two matmuls that produce dX and dW. Both kernels read the block once in fp32 and never allocate.

    forward:  m' = max(m, max_j z_j);  s' = s exp(m - m') + sum_j exp(z_j - m');  tgt += z_t  (t in block)
    backward: z_j <- scale * (exp(z_j - lse) - [j == t])

Paper section 3.2. Legend: n tokens in the block, b vocabulary rows in the block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COLUMNS = 1024  # logits read per inner step of a row


@triton.jit
def _lse_update_kernel(z_ptr, z_stride, targets_ptr, stats_ptr, n, b, offset, COLUMNS: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * z_stride
    running_max = tl.max(tl.full([COLUMNS], float("-inf"), tl.float32), 0)
    running_sum = tl.sum(tl.zeros([COLUMNS], tl.float32), 0)
    for start in range(0, b, COLUMNS):
        cols = start + tl.arange(0, COLUMNS)
        z = tl.load(z_row + cols, mask=cols < b, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), 0)
        running_max = new_max
    old_max = tl.load(stats_ptr + row)
    old_sum = tl.load(stats_ptr + n + row)
    merged_max = tl.maximum(old_max, running_max)
    merged_sum = old_sum * tl.exp(old_max - merged_max) + running_sum * tl.exp(running_max - merged_max)
    tl.store(stats_ptr + row, merged_max)
    tl.store(stats_ptr + n + row, merged_sum)
    local = tl.load(targets_ptr + row) - offset
    hit = (local >= 0) & (local < b)
    z_target = tl.load(z_row + tl.where(hit, local, 0), mask=hit, other=0.0).to(tl.float32)
    old_target = tl.load(stats_ptr + 2 * n + row)
    tl.store(stats_ptr + 2 * n + row, tl.where(hit, z_target, old_target))


@triton.jit
def _softmax_grad_kernel(z_ptr, z_stride, targets_ptr, lse_ptr, scale_ptr, b, offset, COLUMNS: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * z_stride
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    local = tl.load(targets_ptr + row) - offset
    for start in range(0, b, COLUMNS):
        cols = start + tl.arange(0, COLUMNS)
        mask = cols < b
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(z - lse) - tl.where(cols == local, 1.0, 0.0)) * scale
        tl.store(z_row + cols, grad.to(z_ptr.dtype.element_ty), mask=mask)


def _check_block(z: torch.Tensor, targets: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"logits block must be a row-major [n, b] tensor, got shape {tuple(z.shape)} "
                         f"strides {z.stride()}")
    if targets.shape != (z.shape[0],) or not targets.is_contiguous():
        raise ValueError(f"targets must be contiguous [{z.shape[0]}], got {tuple(targets.shape)}")


def lse_update_(z: torch.Tensor, targets: torch.Tensor, offset: int, stats: torch.Tensor) -> None:
    """Fold the logits block z [n, b] (global columns offset..offset+b) into stats [3, n] in place."""
    _check_block(z, targets)
    n, b = z.shape
    if stats.shape != (3, n) or stats.dtype != torch.float32 or not stats.is_contiguous():
        raise ValueError(f"stats must be contiguous fp32 [3, {n}], got {stats.dtype} {tuple(stats.shape)}")
    if n == 0 or b == 0:
        return
    _lse_update_kernel[(n,)](z, z.stride(0), targets, stats, n, b, offset, COLUMNS=_COLUMNS, num_warps=4)


def softmax_grad_(z: torch.Tensor, targets: torch.Tensor, offset: int, lse: torch.Tensor,
                  scale: torch.Tensor) -> None:
    """Overwrite z [n, b] with scale * (softmax - onehot), the loss gradient wrt these logits."""
    _check_block(z, targets)
    n, b = z.shape
    for name, t in (("lse", lse), ("scale", scale)):
        if t.shape != (n,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32 [{n}], got {t.dtype} {tuple(t.shape)}")
    if n == 0 or b == 0:
        return
    _softmax_grad_kernel[(n,)](z, z.stride(0), targets, lse, scale, b, offset, COLUMNS=_COLUMNS, num_warps=4)
