"""SCO: selective offload of activation-checkpoint boundaries to host memory.

Under non-reentrant activation checkpointing a checkpointed layer keeps one tensor on the device
from its forward until its recompute in backward: its input h_l [N, H], the checkpoint boundary.
SCO leaves the checkpoint itself untouched and intercepts only that saved input, through a
saved-tensor hook around the checkpoint call:
  1. forward, wrapped calls in order: if the boundary still fits in what is left of the host
     budget, copy it into the next free bytes of a host arena (host_buffer.py: allocated once,
     reused every step) on a side stream. The device copy is dropped at the next wrapped call
     (or when backward starts), after the compute stream has been told to wait for that copy
     (a stream wait: no host synchronisation).
  2. backward: when call l's boundary is unpacked (its recompute starts), call l-1's boundary is
     copied host->device on the side stream, so it is resident one layer ahead; the compute stream
     waits on that copy's event only when it needs the tensor.
Bytes go through both copies unchanged and the recompute sees the same shape, dtype and strides,
so every gradient is bitwise that of plain checkpointing (reference.py); a boundary changed in
place before its backward raises, as autograd's version check does under plain checkpointing.
The selection rule and the device bytes it leaves are written out in budget.py.

Steps. The budget is spent in forward order; it is whole again as soon as no offloaded boundary
is referenced by autograd (the previous step's graph was freed by its backward), so it restarts
with every step and is never exceeded, even with a retained graph. The per-step records
(offloaded_layers, host_bytes, waits) restart at `begin_step()`, or by themselves at the first
wrapped forward after a backward has begun, or when no boundary of the current step is alive any
more. With gradient accumulation a step is therefore one micro-batch's forward + backward.

Exposed wait (`last_step_stats()["wait_s"]`): on CUDA, the time the compute stream spent stalled
in SCO's stream waits (forward: a boundary's device->host copy not finished when the next wrapped
call starts; backward: a boundary not yet back when its recompute starts), measured with CUDA
timing events around each wait. On CPU, the copies are synchronous; the time spent fetching
boundaries that had not been prefetched is counted.

Paper: section 3.3 (SCO). Legend: N tokens, H hidden, L wrapped calls per step, S offloaded set.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from mop_train.ops.sco.host_buffer import CHUNK_BYTES, HostArena
from mop_train.ops.sco.reference import CheckpointedLayer


@dataclass(eq=False)
class _BoundaryState:
    """One wrapped call's boundary: either kept on the device or held in the host arena."""

    step: int
    seq: int                                # position among this step's wrapped calls
    layer: int                              # wrap index of the layer
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    device_tensor: torch.Tensor | None = None   # kept on the device (not offloaded)
    offset: int | None = None                   # offloaded: its bytes start here in the arena
    fetched: torch.Tensor | None = None         # device copy brought back (maybe still in flight)
    ready: torch.cuda.Event | None = None       # side-stream event after the host->device copy
    fetch_stream: torch.cuda.Stream | None = None   # compute stream `fetched` was allocated on
    loads: int = 0                              # times autograd unpacked it
    version: int | None = None                  # the boundary's version counter when saved
    source: weakref.ref | None = None           # offloaded: the device tensor it was copied from


class _Boundary:
    """The saved-tensor hook's packed value; the state is released when autograd drops it."""

    __slots__ = ("state", "__weakref__")

    def __init__(self, state: _BoundaryState):
        self.state = state


class OffloadedCheckpoint(CheckpointedLayer):
    """`layer` under non-reentrant checkpointing, its first positional input managed by `sco`."""

    def __init__(self, layer: nn.Module, sco: "SelectiveCheckpointOffload", layer_index: int,
                 preserve_rng_state: bool = True):
        super().__init__(layer, preserve_rng_state)
        self.sco = sco
        self.layer_index = layer_index

    def forward(self, *args, **kwargs):
        with self.sco.saving_boundary(self.layer_index, args, kwargs):
            return super().forward(*args, **kwargs)


class SelectiveCheckpointOffload:
    """Offloads checkpoint boundaries of the layers it wraps within `host_budget_bytes` per step.

    Args:
        host_budget_bytes: host bytes per rank for boundaries (0: plain checkpointing).
        device: the device the wrapped layers' inputs live on (None: whatever they are on).
        chunk_bytes: size of the host arena's chunks (a power of two).
    """

    def __init__(self, host_budget_bytes: int, device: torch.device | str | None = None, *,
                 chunk_bytes: int = CHUNK_BYTES):
        if isinstance(host_budget_bytes, bool) or not isinstance(host_budget_bytes, int) or host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes = {host_budget_bytes!r} must be an int >= 0; "
                             "resolve [mop.sco] host_budget with resolve_host_budget()")
        self.host_budget_bytes = host_budget_bytes
        self.device = torch.device(device) if device is not None else None
        self._lock = threading.RLock()
        self._num_wrapped = 0
        self._arena = HostArena(host_budget_bytes, chunk_bytes)
        self._arena_used = 0             # bump pointer: end of the last offloaded boundary
        self._live_offloaded = 0         # offloaded boundaries autograd still holds (any step)
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[tuple[torch.Tensor, torch.cuda.Stream, torch.cuda.Event]] = []
        self._step = 0
        self._start_step()

    # ---- public API -------------------------------------------------------------------------

    def wrap(self, layer: nn.Module, preserve_rng_state: bool = True) -> OffloadedCheckpoint:
        """Checkpoint `layer` (non-reentrant) and let SCO manage its input; call in forward order.

        The layer must take its input hidden state (the boundary) as its first positional argument;
        other arguments (positions, RoPE tables, masks) are kept as plain checkpointing keeps them.
        """
        wrapped = OffloadedCheckpoint(layer, self, self._num_wrapped, preserve_rng_state)
        self._num_wrapped += 1
        return wrapped

    def begin_step(self) -> None:
        """Start a new step: the budget and the per-step records restart (see the module doc)."""
        with self._lock:
            self._start_step()

    @property
    def offloaded_layers(self) -> list[int]:
        """Wrap indices whose boundary was offloaded in the last forward, in forward order."""
        return list(self._offloaded)

    @property
    def host_bytes(self) -> int:
        """Bytes of boundaries the last forward put on the host."""
        return self._host_bytes

    @property
    def pinned_bytes(self) -> int:
        """Host bytes allocated for boundaries (the arena's high-water mark; <= host_budget_bytes)."""
        return self._arena.capacity

    def last_step_stats(self) -> dict:
        """{offloaded_layers: int, host_bytes: int, wait_s: float} of the last step.

        On CUDA this waits for the step's timing events (call it when logging, after backward).
        """
        with self._lock:
            waits = list(self._waits)
            stats = {"offloaded_layers": len(self._offloaded), "host_bytes": self._host_bytes}
        wait_s = 0.0
        for wait in waits:
            if isinstance(wait, float):
                wait_s += wait
            else:
                start, end = wait
                end.synchronize()
                wait_s += start.elapsed_time(end) / 1000.0
        return {**stats, "wait_s": wait_s}

    @contextlib.contextmanager
    def saving_boundary(self, layer_index: int, args: tuple, kwargs: dict):
        """Route the saved copy of `args[0]` through SCO while a wrapped checkpoint runs forward."""
        if not args or not isinstance(args[0], torch.Tensor):
            got = type(args[0]).__name__ if args else "no positional argument"
            raise ValueError(f"SCO-wrapped layer {layer_index} was called with {got} first; pass the "
                             "layer's input hidden state [N, H] as its first positional argument")
        boundary = args[0]
        if self.device is not None and not _same_device(boundary.device, self.device):
            raise ValueError(f"SCO-wrapped layer {layer_index} got its input on {boundary.device} but "
                             f"SelectiveCheckpointOffload(device={self.device}); pass the device the "
                             "layers run on, or device=None")
        # A boundary that is also passed elsewhere stays referenced on the device: moving it frees nothing.
        shared = any(a is boundary for a in args[1:]) or any(v is boundary for v in kwargs.values())
        # autograd keeps `pack` as long as the saved tensor: it must not keep the boundary alive.
        target = [boundary]
        del boundary

        def pack(t: torch.Tensor):
            if not target or t is not target[0]:
                return t  # other saved inputs are kept exactly as plain checkpointing keeps them
            target.clear()
            return self._save(layer_index, t, offloadable=not shared)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._load):
                yield
        finally:
            target.clear()

    # ---- forward: saving ------------------------------------------------------------------------

    def _start_step(self) -> None:
        self._release_pending()
        self._step += 1
        self._records: list[weakref.ref] = []   # this step's _Boundary objects, forward order
        self._offloaded: list[int] = []
        self._host_bytes = 0
        self._alive = 0                          # this step's boundaries still held by autograd
        self._backward_started = False
        self._waits: list = []                   # (start, end) CUDA events or CPU seconds

    def _save(self, layer_index: int, x: torch.Tensor, offloadable: bool) -> _Boundary:
        with self._lock:
            if self._alive == 0 or self._backward_started:
                self._start_step()
            self._release_pending()
            state = _BoundaryState(step=self._step, seq=len(self._records), layer=layer_index,
                                   shape=x.shape, stride=x.stride(), dtype=x.dtype, device=x.device,
                                   nbytes=x.numel() * x.element_size())
            state.offset = self._reserve(x) if offloadable else None
            state.version = None if x.is_inference() else x._version
            if state.offset is None:
                state.device_tensor = x
            else:
                state.source = weakref.ref(x)
                self._copy_out(state, x)
                self._offloaded.append(layer_index)
                self._host_bytes += state.nbytes
            saved = _Boundary(state)
            self._records.append(weakref.ref(saved))
            self._alive += 1
            weakref.finalize(saved, self._on_release, state).atexit = False
            return saved

    def _reserve(self, x: torch.Tensor) -> int | None:
        """Arena offset for `x` if it still fits in the budget, else None (x stays on the device)."""
        nbytes = x.numel() * x.element_size()
        if nbytes == 0 or self._arena_used + nbytes > self.host_budget_bytes:
            return None
        # Only plain dense tensors that own the start of their storage: the copy brought back
        # then has the same layout, so the recompute runs the same kernels.
        if type(x) is not torch.Tensor or not x.is_contiguous() or x.storage_offset() != 0:
            return None
        offset = self._arena_used
        self._arena.grow_to(offset + nbytes, pinned=x.is_cuda)
        self._arena_used += nbytes
        self._live_offloaded += 1
        return offset

    def _copy_out(self, state: _BoundaryState, x: torch.Tensor) -> None:
        """Device -> host copy of `x`; on CUDA async on the side stream, `x` kept until waited on."""
        if not x.is_cuda:
            self._arena.write(state.offset, x)
            return
        compute = torch.cuda.current_stream(x.device)
        copy = self._copy_stream(x.device)
        copy.wait_stream(compute)  # x is written by work already queued on the compute stream
        with torch.cuda.stream(copy):
            self._arena.write(state.offset, x)
            done = torch.cuda.Event()
            done.record(copy)
        self._pending.append((x, compute, done))

    def _release_pending(self) -> None:
        """Let the compute stream wait for queued device->host copies, then drop the device copies.

        After the wait, the freed blocks can only be reused by compute work queued behind it."""
        for _, compute, done in self._pending:
            self._wait(compute, done)
        self._pending = []

    # ---- backward: loading ----------------------------------------------------------------------

    def _load(self, saved):
        if not isinstance(saved, _Boundary):
            return saved
        state = saved.state
        with self._lock:
            if state.step == self._step and not self._backward_started:
                self._backward_started = True
                self._release_pending()
            state.loads += 1
            _check_unmodified(state)
            if state.offset is None:
                self._prefetch_previous(state)
                return state.device_tensor
            on_demand = state.fetched is None
            if on_demand:
                started = time.perf_counter()
                self._fetch(state)
                fetch_s = time.perf_counter() - started   # before the prefetch, which is not this wait
            self._prefetch_previous(state)
            tensor, state.fetched = state.fetched, None
            if state.ready is not None:
                self._wait(torch.cuda.current_stream(tensor.device), state.ready)
                state.ready = None
            elif on_demand:
                self._waits.append(fetch_s)
            return tensor

    def _prefetch_previous(self, state: _BoundaryState) -> None:
        """Start bringing back the boundary of the wrapped call before `state` (recomputed next)."""
        if state.step != self._step or state.seq == 0:
            return
        previous = self._records[state.seq - 1]()
        if previous is None:
            return
        prev = previous.state
        if prev.offset is not None and prev.fetched is None and prev.loads == 0:
            self._fetch(prev)

    def _fetch(self, state: _BoundaryState) -> None:
        """Host -> device copy into a new tensor allocated on the current (compute) stream."""
        dst = torch.empty_strided(state.shape, state.stride, dtype=state.dtype, device=state.device)
        if not dst.is_cuda:
            self._arena.read_into(state.offset, dst)
            state.fetched = dst
            return
        compute = torch.cuda.current_stream(dst.device)
        copy = self._copy_stream(dst.device)
        copy.wait_stream(compute)  # dst's block may have been used by compute work still queued
        with torch.cuda.stream(copy):
            self._arena.read_into(state.offset, dst)
            ready = torch.cuda.Event()
            ready.record(copy)
        state.fetched, state.ready, state.fetch_stream = dst, ready, compute

    def _on_release(self, state: _BoundaryState) -> None:
        """Autograd dropped a boundary (its graph was freed): give its buffer and bytes back."""
        with self._lock:
            if state.fetched is not None and state.ready is not None:
                # A prefetched copy never used: its block returns to the compute stream's pool, so
                # that stream must not run past the copy into it.
                state.fetch_stream.wait_event(state.ready)
            state.fetched = state.device_tensor = None
            if state.offset is not None:
                self._live_offloaded -= 1
                if self._live_offloaded == 0:
                    self._arena_used = 0  # every boundary in the arena is dead: reuse it from the start
            if state.step == self._step:
                self._alive -= 1

    # ---- streams ----------------------------------------------------------------------------------

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device=device)
        return self._copy_streams[device]

    def _wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """stream waits for event; the stall is bracketed by timing events for wait_s."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self._waits.append((start, end))


def _check_unmodified(state: _BoundaryState) -> None:
    """Raise as autograd does for a saved tensor modified in place after it was saved.

    A saved-tensor hook bypasses autograd's version check, so without this a boundary kept on the
    device and changed in place between forward and backward was silently recomputed from the new
    values (wrong gradients) where plain checkpointing raises; an offloaded one still alive is
    checked too (its copy holds the saved values, but plain checkpointing would raise, and on CUDA
    the in-place write may race the copy)."""
    tensor = state.device_tensor if state.offset is None else (state.source() if state.source else None)
    if tensor is None or state.version is None or tensor._version == state.version:
        return
    raise RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: the input {tuple(state.shape)} {state.dtype} of SCO-wrapped layer {state.layer} is at "
        f"version {tensor._version}; expected version {state.version} instead (the same check as plain "
        f"checkpointing: do not modify a checkpointed layer's input in place before its backward, or "
        f"clone it first)")


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    # torch has one CPU device: a tensor made on "cpu:0" reports "cpu"
    return actual.type == "cpu" or expected.index is None or actual.index == expected.index
