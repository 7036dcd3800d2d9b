"""OffloadStreamAdamW's streams on CUDA: the streamed buckets' copy-in (h2d), update, write-back (d2h)
and weight refresh each wait for what they must (checked by making each of them slow in turn: the
result must not change by a bit), run on their own streams without blocking the host, and time the
step; the pinned host state is unregistered when the optimizer is collected."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mop_train.ops.offload_adamw import OffloadStreamAdamW, buckets
from tests.ops.test_offload_adamw import HP, SHAPES, _grads, _groups, _params
from tests.utils import assert_bitwise_equal, fresh_seed

_SPIN = 50_000_000  # GPU clock cycles per stall: >= 25 ms at the H200's top clock, far past the host's
                    # queueing of the rest of a step (a few ms)
STREAMED = {"h2d", "update", "d2h", "refresh"}


class _StreamSpy(TorchDispatchMode):
    """Notes, for each copy into or out of a staging slot and each fused AdamW call, its kind, the
    stream it was queued on and whether a host copy was blocking; before each operation of kind
    `stall` it spins the current stream, so that whatever should wait for that operation but does
    not reads stale data.

    Kinds: "h2d" host -> slot (copy-in), "d2h" slot -> host (write-back), "refresh" slot -> working
    weight, "update" torch's fused AdamW."""

    def __init__(self, opt, stall=None):
        super().__init__()
        self._slots = {b.untyped_storage().data_ptr() for b in opt._slot_buffers if b.numel()}
        self._stall = stall
        self.seen = []  # (kind, stream handle, blocking)

    def _in_slot(self, t) -> bool:
        return t.is_cuda and t.numel() > 0 and t.untyped_storage().data_ptr() in self._slots

    def _kind(self, func, args):
        if func.overloadpacket is torch.ops.aten._fused_adamw_:
            return "update"
        if func.overloadpacket is not torch.ops.aten.copy_:
            return None
        dst, src = args[0], args[1]
        if self._in_slot(dst) and not src.is_cuda:
            return "h2d"
        if self._in_slot(src) and not self._in_slot(dst):
            return "refresh" if dst.is_cuda else "d2h"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args)
        if kind is not None:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self.seen.append((kind, torch.cuda.current_stream().cuda_stream,
                              kind in ("h2d", "d2h") and not non_blocking))
            if kind == self._stall:
                torch.cuda._sleep(_SPIN)
        return func(*args, **kwargs)

    def check(self, streams, kinds: set[str]) -> None:
        on = {"h2d": streams.h2d, "d2h": streams.d2h, "refresh": streams.update, "update": streams.update}
        assert {kind for kind, _, _ in self.seen} == kinds
        for kind, stream, blocking in self.seen:
            assert stream == on[kind].cuda_stream, f"a {kind} operation was queued on another stream"
            assert not blocking, f"a blocking {kind} copy: the host waits for the device in step()"


def _checked_step(opt, params, stall, kinds):
    """One step under _StreamSpy: the weights as the compute stream reads them right after step()
    (before any host synchronisation), the state as state_dict() returns it, copied at once (its
    entries are live views); the streams checked, step_seconds() within the wall time around it."""
    spy = _StreamSpy(opt, stall)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    with spy:
        opt.step()
    weights = [p.detach().clone() for p in params]
    state = {i: {key: value.detach().cpu().clone() for key, value in entry.items()}
             for i, entry in opt.state_dict()["state"].items()}
    seconds = opt.step_seconds()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    spy.check(opt._streams, kinds)
    assert 0.0 <= seconds <= wall + 1e-3, (seconds, wall)
    return weights, state


@pytest.mark.gpu
@pytest.mark.parametrize("stall", ["h2d", "update", "d2h", "refresh"])
def test_cuda_streamed_step_waits_for_each_stream(stall):
    """Every bucket streamed (7 buckets over 3 slots: each slot is reused within a step, and the last
    bucket's slot is not the one before it), against everything device-resident (no transfer, the
    same CUDA kernel: the same bits). With the copy-in, the AdamW update, the write-back or the
    weight refresh made slow in turn, the weights the compute stream reads after step() and the state
    state_dict() returns stay bitwise the device-resident path's, which is itself made slow in its
    update (so its forward must wait for its pieces too). Copies run non-blocking on the h2d / d2h
    streams, AdamW and the refresh on the update stream, of the parameters' device."""
    seed = fresh_seed(113)
    ours_p, ref_p = _params(seed, torch.float32, "cuda"), _params(seed, torch.float32, "cuda")
    ours = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=12, slots=3, piece_align=1)
    ref = OffloadStreamAdamW(_groups(ref_p), **HP, bucket_params=12, device_fraction=1.0, piece_align=1)
    assert len(ours._buckets) == 7 and not ours._device_buckets and len(ref._device_buckets) == 7 and not ref._buckets
    assert ours._streams.device == ours_p[0].device
    torch.cuda._sleep(1)  # the spin kernel is loaded before the host's queueing is raced against it
    for step in range(3):
        for p, q, g in zip(ours_p, ref_p, _grads(step, SHAPES, torch.float32, seed)):
            p.grad = None if g is None else g.cuda()
            q.grad = None if g is None else g.cuda()
        want_w, want_state = _checked_step(ref, ref_p, stall, {"update"})
        got_w, got_state = _checked_step(ours, ours_p, stall, STREAMED)
        for i, (got, want) in enumerate(zip(got_w, want_w)):
            assert_bitwise_equal(got, want, name=f"step {step} weight {i}")
        for i, entry in want_state.items():
            for key, want in entry.items():
                assert_bitwise_equal(got_state[i][key], want, name=f"step {step} param {i} {key}")


@pytest.mark.gpu
def test_cuda_host_state_is_unregistered_once_the_optimizer_is_collected(monkeypatch):
    """The host state is registered with CUDA at construction (pinned for the copy engines) and
    unregistered, at its own address, by the optimizer's finalizer when the optimizer is collected."""
    gc.collect()  # earlier tests' optimizers release their buffers now, not inside this test
    released, unregister = [], buckets.unregister_host_state

    def spy(data_ptr):
        released.append(data_ptr)
        unregister(data_ptr)
    monkeypatch.setattr(buckets, "unregister_host_state", spy)
    seed = fresh_seed(117)
    params = _params(seed, torch.float32, "cuda")
    opt = OffloadStreamAdamW(_groups(params), **HP, bucket_params=12, slots=3, piece_align=1)
    for p, g in zip(params, _grads(0, SHAPES, torch.float32, seed)):
        p.grad = None if g is None else g.cuda()
    opt.step()
    host = opt._host.data_ptr()
    assert host != 0 and host not in released
    del opt
    gc.collect()
    assert host in released, (host, released)
