"""Where every parameter lives in the flat host state, how the step cuts it into buckets, and the
staging-memory bound that follows from the cut.

All local parameter shards are laid end to end in one flat fp32 index space of N elements, in the
order the optimizer was given them (`forward_order` gives the order the forward consumes them).
The head [0, N_d) stays on the device (device_share.py); the host keeps three rows over the rest,
[3, N - N_d]: master weights, exp_avg, exp_avg_sq. A bucket is a contiguous range of at most `bucket_params` elements of
the flat space; a bucket may start or end inside a tensor, so it is described by segments, each one
piece of one parameter. The device holds `slots` buffers of [3, bucket] fp32 plus one [bucket] fp32
buffer for the gradients upcast to fp32.

Legend: N local elements over all parameters, N_d of them device-resident, B bucket capacity
(elements), s slots.
"""

from __future__ import annotations

import bisect
import mmap
from dataclasses import dataclass

import torch

STATE_ROWS = 3  # master, exp_avg, exp_avg_sq (fp32 each)
FP32_BYTES = 4
HOST_CHUNK = 1 << 22  # elements per CPU update of the host share: ~1 ms of CPU work, so its first
                      # download and last upload stay short


@dataclass(frozen=True)
class Segment:
    """One piece of one parameter inside a bucket."""

    param: int         # index in the optimizer's flat parameter list
    param_start: int   # first element inside the parameter's (local, flattened) shard
    bucket_start: int  # first element inside the bucket / staging slot
    numel: int


@dataclass(frozen=True)
class Bucket:
    start: int  # first element in the flat host index space
    numel: int
    segments: tuple[Segment, ...]


def param_offsets(numels: list[int]) -> list[int]:
    """Start of each parameter in the flat index space (exclusive prefix sum)."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    return offsets


PIECE_ALIGN = 64
"""Cuts inside a parameter fall on a multiple of this many elements from the parameter's start. torch's
CPU fused AdamW computes a piece in vector lanes from its start and its last (len mod lane) elements in
scalar code, which rounds differently; a cut at a multiple of the lane width (16 fp32 with AVX-512; 64
covers any SIMD width torch builds for and its 16-element work units) keeps every element in the lane it
has in the whole parameter, so the bits do not depend on where buckets, the device share or the host
share cut (torch's CUDA kernel treats every element alike)."""


def aligned_cut(offsets: list[int], numels: list[int], flat: int, align: int = PIECE_ALIGN) -> int:
    """The cut at or before flat element `flat` that lies on a multiple of `align` from the start of the
    parameter holding it (`offsets` = param_offsets(numels); a parameter's boundaries are cuts already)."""
    p = bisect.bisect_right(offsets, flat) - 1          # the last parameter starting at or before `flat`
    if p < 0 or flat >= offsets[p] + numels[p]:         # (on a boundary, or past the end: a cut already)
        return flat
    return flat - (flat - offsets[p]) % align


def plan_buckets(numels: list[int], bucket_params: int, start: int = 0, end: int | None = None,
                 align: int = PIECE_ALIGN) -> list[Bucket]:
    """Cut the flat range [start, end) of `numels` (elements per parameter; end defaults to all of
    them) into buckets of <= bucket_params.

    With bucket_params >= align a cut inside a parameter moves back to the aligned place before it
    (`aligned_cut`), so every bucket but the last holds bucket_params - align + 1 .. bucket_params
    elements; smaller buckets hold exactly bucket_params (align = 1: every bucket but the last). Empty
    parameters own no segment.
    Segments of one bucket are in flat order and tile [0, bucket.numel) without gaps.
    """
    if bucket_params < 1:
        raise ValueError(f"bucket_params ({bucket_params}) must be >= 1")
    offsets = param_offsets(numels)
    total = sum(numels)
    stop = total if end is None else end
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is not inside the flat space [0, {total})")
    buckets = []
    param = 0
    lo_flat = start
    while lo_flat < stop:
        hi_flat = min(lo_flat + bucket_params, stop)
        if hi_flat < stop and bucket_params >= align:
            hi_flat = aligned_cut(offsets, numels, hi_flat, align)   # (>= lo_flat + 1: it moves back < align)
        segments = []
        while param < len(numels) and offsets[param] + numels[param] <= lo_flat:
            param += 1  # parameters wholly before this bucket (or empty)
        p = param
        while p < len(numels) and offsets[p] < hi_flat:
            lo = max(lo_flat, offsets[p])
            hi = min(hi_flat, offsets[p] + numels[p])
            if hi > lo:
                segments.append(Segment(p, lo - offsets[p], lo - lo_flat, hi - lo))
            p += 1
        buckets.append(Bucket(lo_flat, hi_flat - lo_flat, tuple(segments)))
        lo_flat = hi_flat
    return buckets


def device_split(total: int, device_fraction: float) -> int:
    """End of the device-resident head of the flat space, as planned: the first round(d * N) elements
    (the optimizer's cut, `device_cut`, is at most PIECE_ALIGN - 1 elements before it)."""
    return round(device_fraction * total)


def device_cut(numels: list[int], device_fraction: float, align: int = PIECE_ALIGN) -> int:
    """Where the optimizer ends the device-resident head: `device_split` moved back to its parameter's
    lane boundary (`aligned_cut`)."""
    return aligned_cut(param_offsets(numels), numels, device_split(sum(numels), device_fraction), align)


def staging_bytes_bound(bucket_params: int, slots: int, host_share: bool = False) -> int:
    """Device bytes the optimizer may use during a step: s x B x 12 (slots) + B x 4 (grad upcast),
    plus, with a host share, one fp32 cast temporary of HOST_CHUNK elements per copy direction."""
    host = 2 * HOST_CHUNK * FP32_BYTES if host_share else 0
    return slots * bucket_params * STATE_ROWS * FP32_BYTES + bucket_params * FP32_BYTES + host


def host_state_bytes(numel: int) -> int:
    """Host bytes of the fp32 master, exp_avg and exp_avg_sq of `numel` local elements."""
    return numel * STATE_ROWS * FP32_BYTES


def allocate_host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """A [nbytes] uint8 host buffer on whole pages of its own, page-locked for the copy engines when `pin`.

    The buffer comes from the ordinary CPU allocator and is registered with CUDA (cudaHostRegister),
    because torch's pinned allocator rounds each block up to a power of two (a 17 GB state would
    pin 32 GB). Registration works on whole pages, so the buffer starts on a page boundary and its
    last page is padded: no other allocation shares (and re-registers) its pages. Returns (buffer,
    registered); the caller must `unregister_host_state` before the storage is freed.
    """
    page = mmap.PAGESIZE
    span = -(-nbytes // page) * page
    raw = torch.empty(span + page, dtype=torch.uint8).untyped_storage()
    start = (-raw.data_ptr()) % page
    # a storage that starts on the page boundary (it keeps `raw` alive), so is_pinned() sees it
    buffer = torch.empty(0, dtype=torch.uint8).set_(raw[start:start + span], 0, (nbytes,))
    if not pin or nbytes == 0:
        return buffer, False
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), span, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {span} host bytes failed (cudaError {err}); "
                           "free host memory or lower the parameters per rank")
    return buffer, True


def allocate_host_state(numel: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """The [3, N] fp32 host state (master, exp_avg, exp_avg_sq) in a buffer of `allocate_host_buffer`."""
    buffer, registered = allocate_host_buffer(host_state_bytes(numel), pin)
    return buffer.view(torch.float32).view(STATE_ROWS, numel), registered


def unregister_host_state(data_ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(data_ptr)


def release_when_idle(data_ptr: int, streams) -> None:
    """Unregister a host buffer once no copy on `streams` can still target it (a weakref finalizer)."""
    streams.synchronize()
    unregister_host_state(data_ptr)
