"""Shared numerical assertions and seeds for mop_train tests."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SEED_ENV = "MOP_TEST_SEED"


def fresh_seed(offset: int = 0) -> int:
    """A seed for random test inputs that changes from one test session to the next.

    conftest.py draws the session's base seed once (or takes $MOP_TEST_SEED, to reproduce a run;
    pytest prints it in its header) and exports it, so spawned ranks derive the same seeds. Tests
    pass a distinct `offset` per use; the same offset gives the same seed within a session."""
    return (int(os.environ.get(SEED_ENV, "0")) + offset) % (1 << 62)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-5,
                 atol: float = 1e-6, name: str = "tensor") -> None:
    """`torch.testing.assert_close` that reports the max and mean absolute error on failure."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().float().cpu()
    e = expected.detach().float().cpu()
    try:
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
    except AssertionError as err:
        diff = (a - e).abs()
        raise AssertionError(
            f"{name}: max abs err {diff.max().item():.3e}, mean abs err {diff.mean().item():.3e}, "
            f"max |expected| {e.abs().max().item():.3e} (rtol={rtol}, atol={atol})\n{err}"
        ) from None


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-5,
                          name: str = "tensor") -> None:
    """Within rtol of the expected tensor's largest magnitude, element by element.

    For results that are sums of many terms (gradients, matmul outputs): reordering such a sum
    moves an element by ulps of its terms, which can dwarf a near-zero element itself."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    assert_close(actual, expected, rtol=rtol, atol=rtol * scale + 1e-12, name=name)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "tensor") -> None:
    """Exact equality (same dtype, shape and bits), with the error statistics on failure."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(f"{name}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}")
    if not torch.equal(actual, expected):
        diff = (actual.float() - expected.float()).abs()
        raise AssertionError(f"{name}: not bitwise equal; max abs err {diff.max().item():.3e}, "
                             f"{int((diff > 0).sum())} of {diff.numel()} elements differ")


def low_precision_errors(actual: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """(rms, max) absolute error of `actual` against the fp32 `truth`."""
    if actual.numel() == 0:
        return 0.0, 0.0
    diff = (actual.detach().float() - truth.detach().float()).abs()
    return diff.pow(2).mean().sqrt().item(), diff.max().item()


def assert_no_worse_than_torch(ours: torch.Tensor, theirs: torch.Tensor, truth: torch.Tensor, *,
                               name: str, slack: float = 0.0, max_factor: float = 2.0) -> None:
    """The low-precision rule: our error against an fp32 ground truth is no worse than PyTorch's own
    error in that dtype (`theirs`, computed from the same rounded inputs) against it.

    rms within 1.25x and max within `max_factor` (2x) of PyTorch's (max is a noisy statistic), plus
    0.2% / 0.4% of the truth's largest magnitude (about one bf16 ulp of it), or slack / 2 / slack when
    larger: an error the caller states, e.g. one ulp of a rounded logit that two correct matmuls round
    apart, or the extra roundings of partial sums a chunked op makes by design.
    """
    scale = float(truth.detach().abs().max()) if truth.numel() else 0.0
    ours_rms, ours_max = low_precision_errors(ours, truth)
    torch_rms, torch_max = low_precision_errors(theirs, truth)
    assert ours_rms <= 1.25 * torch_rms + max(2e-3 * scale, slack / 2) and \
        ours_max <= max_factor * torch_max + max(4e-3 * scale, slack), (
            f"{name}: our low-precision error (rms {ours_rms:.3e}, max {ours_max:.3e}) exceeds PyTorch's "
            f"(rms {torch_rms:.3e}, max {torch_max:.3e}); scale {scale:.3e}")


@contextlib.contextmanager
def no_host_syncs():
    """CUDA work inside raises if it makes the host wait for the device (set_sync_debug_mode("error")).

    Garbage collection is held off meanwhile: an object of an earlier test collected inside (an
    OffloadStreamAdamW's finalizer synchronizes its streams) would raise there, in a finalizer, where
    the error is only printed and its cleanup is left half done."""
    gc.disable()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
        gc.enable()


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.overloadpacket.__name__, tree_flatten((args, kwargs or {}))[0]))
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn) -> list[tuple[str, list]]:
    """(op name, flattened arguments) of every op `fn()` dispatches, in order (a TorchDispatchMode,
    which sees DTensor arguments before DTensor's own dispatch unwraps them)."""
    with _OpRecorder() as mode:
        fn()
    return mode.calls


def bf16_moe_layer(gen: torch.Generator, N: int, H: int, I: int, E: int, k: int) -> tuple[torch.Tensor, ...]:
    """Random inputs of one MoE layer at group size one, leaves requiring grad: x [N, H], w1 and w3
    [E, I, H], w2 [E, H, I] in bf16, the top-k routing weights [N, k] (fp32) and their expert indices."""
    x = torch.randn(N, H, generator=gen).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(E, I, H, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    w2 = torch.randn(E, H, I, generator=gen).bfloat16().requires_grad_()
    weights, indices = torch.rand(N, E, generator=gen).topk(k, dim=1)
    return x, w1, w2, w3, weights.requires_grad_(), indices


class AllocatedBytes(TorchDispatchMode):
    """Storages freshly allocated by ops while active (views and out=/in-place writes, which share an
    argument's storage, are not allocations): `largest`, the largest one, and `peak`, the most bytes
    of them alive at once (each counted until the storage itself is freed)."""

    def __enter__(self):
        self.largest = self.live = self.peak = 0
        self._alive = set()
        return super().__enter__()

    def _freed(self, ptr, nbytes):
        self.live -= nbytes
        self._alive.discard(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shared = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:
                storage = t.untyped_storage()
                self.largest = max(self.largest, storage.nbytes())
                if storage.nbytes() and storage.data_ptr() not in self._alive:
                    self._alive.add(storage.data_ptr())
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, storage.data_ptr(), storage.nbytes())
        return out
