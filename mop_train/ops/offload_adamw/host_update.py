"""The tail of the flat state that AdamW updates on the CPU, in place, while the rest streams.

Streaming a parameter through the device moves 12 bytes each way over the host link (master and
both moments). Updating it on the CPU moves only its gradient down and its refreshed master up
(4 bytes each way) and spends CPU time instead. The link and the CPU are separate resources, so
with the last fraction f of the flat space updated on the CPU a step takes about
max(link time of 12(1-f) + 4f bytes/param, CPU time of f) instead of the link time alone. The
casts between the working dtype and fp32 run on the device (inside the non-blocking copies): on
the CPU they would cost more than the AdamW update itself while the copy engines share its memory
bandwidth (benchmarks/RESULTS.md, host_update_cpu).

The range is the tail of the host-resident part (after the device-resident head and the streamed
buckets), so the forward consumes it last. One step, per chunk c of the host range (chunks of at
most CHUNK elements, in flat order):
  1. before any bucket is streamed, fp32 gradients go device -> pinned host on the `down` stream
     (and, on a parameter's first update, its working weight, which becomes its master);
  2. the CPU waits for chunk c and runs torch's fused AdamW on the host masters and moments in place;
  3. the masters go host -> device into the working weights (cast there) on the `up` stream; each
     chunk's upload event is a ready piece (forward_waits.py) that readers of its weights wait for.
On a CPU-only build the "device" is the CPU and the same steps run in program order.
With gradients = "stream" the share's gradients are in host memory already (grad_stream.py: they left
as they became final, before the clipping norm existed), so step 1 copies nothing: the CPU reads them
from the optimizer's pinned gradient buffer, once the stream's last copy has landed, and multiplies
them by the clipping coefficient (copied to the host behind that copy) before AdamW, the same fp32
multiply the device path makes; the share then costs no link bytes at all with weights = "stream"
(its working weights are host tensors the CPU writes) and with "bf16" only the fp32 masters up (step 3:
4 B each, cast to bf16 on the device).
Legend: N local elements, f host fraction, c chunk.
"""

from __future__ import annotations

import weakref

import torch

from mop_train.ops.offload_adamw.buckets import (FP32_BYTES, HOST_CHUNK, PIECE_ALIGN, aligned_cut,
                                                 allocate_host_buffer, param_offsets, plan_buckets,
                                                 release_when_idle)
from mop_train.ops.offload_adamw.forward_waits import Ready
from mop_train.ops.offload_adamw.link import host_bytes
from mop_train.ops.offload_adamw.update import fused_adamw_by_group

CHUNK = HOST_CHUNK  # read at construction, so tests can cut smaller chunks


def host_split(total: int, host_fraction: float) -> int:
    """First element updated on the CPU of a range of `total`: its last round(f * total) elements."""
    return total - round(host_fraction * total)


def host_cut(numels: list[int], start: int, host_fraction: float, align: int = PIECE_ALIGN) -> int:
    """Where the optimizer starts the CPU-updated tail of the flat range [start, N): `host_split` of the
    range moved back to its parameter's lane boundary (buckets.aligned_cut)."""
    total = sum(numels)
    return aligned_cut(param_offsets(numels), numels, start + host_split(total - start, host_fraction), align)


def host_share_bytes(total: int, host_fraction: float) -> int:
    """Pinned bytes of the host share's fp32 gradient buffer as planned (`HostUpdate.host_bytes` is up
    to PIECE_ALIGN - 1 elements more: `host_cut`)."""
    return (total - host_split(total, host_fraction)) * FP32_BYTES


class HostUpdate:
    """Gradient download, CPU AdamW and master upload for the flat range [start, N).

    The host state passed to `download` / `update` is [3, N - base]: column 0 is flat element `base`.
    Holds one pinned fp32 buffer for the range's gradients (`host_bytes`)."""

    def __init__(self, numels: list[int], start: int, streams, base: int = 0, link=None, align: int = PIECE_ALIGN,
                 streamed_grads: bool = False):
        self.link = link  # LinkCounter of the step's host-link bytes (link.py), or None
        self.chunks = plan_buckets(numels, CHUNK, start=start, align=align)
        self.base = base
        self.numel = sum(chunk.numel for chunk in self.chunks)
        self._streams = streams
        self.streamed_grads = streamed_grads  # gradients = "stream": read where they landed, no buffer here
        self.host_bytes = 0 if streamed_grads else self.numel * FP32_BYTES
        self._arrived = [None] * len(self.chunks)
        self.uploaded = None  # event after the last weight upload (None on CPU)
        self._scale = None    # the clipping coefficient on the host (streamed gradients), or None
        if streamed_grads:
            self._grad_views = [None] * sum(1 for _ in self._segments())   # set per step by `download`
            self._scale_host = torch.empty((), dtype=torch.float32, pin_memory=streams.cuda)
            return
        pool, registered = allocate_host_buffer(self.host_bytes, streams.cuda)
        if registered:
            weakref.finalize(self, release_when_idle, pool.data_ptr(), streams)
        grads = pool.view(torch.float32)                      # [range] fp32, in flat order
        first = start - base  # host-state column of the range's first element
        self._grad_views = [grads[col - first:col - first + seg.numel] for _, seg, col, _ in self._segments()]

    def _segments(self):
        """(chunk index, segment, host-state column of the segment, view index) over the host range."""
        view = 0
        for c, chunk in enumerate(self.chunks):
            for seg in chunk.segments:
                yield c, seg, chunk.start + seg.bucket_start - self.base, view
                view += 1

    def download(self, grads, work, fresh, host_state, ready, *, landed=None, scale=None) -> None:
        """Enqueue every gradient of the range (and fresh working weights) for the host.

        ready: an event on the compute stream after which gradients and weights are final.
        With streamed gradients (`grads` are then host views): landed, the event after their last copy
        into host memory; scale, the clipping coefficient (0-dim, on the device; None: no clipping)."""
        s = self._streams
        with s.use(s.down):
            s.wait(ready)
            self._scale = None
            if self.streamed_grads:
                s.wait(landed)
                if scale is not None and self.chunks:  # behind the compute stream's norm and clip: `ready`
                    if s.cuda:                            # (an empty share reads no coefficient)
                        self._scale = self._scale_host.copy_(scale, non_blocking=True)
                        self._count(d2h=host_bytes(self._scale_host))
                    else:
                        self._scale = scale
            last = -1
            for c, seg, flat, view in self._segments():
                if c != last and last >= 0:
                    self._arrived[last] = s.record()
                last = c
                grad = grads[seg.param]
                if grad is None:
                    continue  # no gradient: master, moments and step stay as they are
                src = slice(seg.param_start, seg.param_start + seg.numel)
                if self.streamed_grads:
                    self._grad_views[view] = grad[src]          # where it landed (scaled in `update`)
                else:
                    self._grad_views[view].copy_(grad[src], non_blocking=True)  # cast (if any) on the device
                    self._count(d2h=host_bytes(self._grad_views[view]))
                if fresh[seg.param]:
                    host_state[0, flat:flat + seg.numel].copy_(work[seg.param][src], non_blocking=True)
                    self._count(d2h=host_bytes(host_state[0, flat:flat + seg.numel]))
            if last >= 0:
                self._arrived[last] = s.record()

    def update(self, grads, work, host_state, steps, group_of, hparams, *, work_on_host: bool = False):
        """CPU AdamW chunk by chunk as the gradients arrive; each chunk's weights go up when done
        (`work_on_host`: the working weights are pinned host tensors, weights = "stream": no link).

        Returns one Ready piece per updated chunk, in flat order (events None on CPU); `uploaded`
        keeps the event of the latest upload of any step."""
        s = self._streams
        by_chunk: dict[int, list] = {}
        for c, seg, flat, view in self._segments():
            if grads[seg.param] is not None:
                by_chunk.setdefault(c, []).append((seg, flat, view))
        last, ready = None, []
        for c, live in by_chunk.items():
            if self._arrived[c] is not None:
                self._arrived[c].synchronize()
            if self._scale is not None:  # streamed gradients: the clipping multiply, as on the device
                for _, _, view in live:
                    self._grad_views[view].mul_(self._scale)
            self._adamw(live, host_state, steps, group_of, hparams)
            with s.use(s.up):
                for seg, flat, _ in live:
                    dst = work[seg.param][seg.param_start:seg.param_start + seg.numel]
                    dst.copy_(host_state[0, flat:flat + seg.numel], non_blocking=True)  # cast on the device
                    if not work_on_host:
                        self._count(h2d=host_bytes(host_state[0, flat:flat + seg.numel]))
                last = s.record(timing=True)
            chunk = self.chunks[c]
            ready.append(Ready(chunk.start, chunk.start + chunk.numel, last))
        self.uploaded = last or self.uploaded
        return ready

    def _adamw(self, live, host_state, steps, group_of, hparams) -> None:
        pieces = []
        for seg, flat, view in live:
            rows = host_state[:, flat:flat + seg.numel]                 # [3, n] master, exp_avg, exp_avg_sq
            pieces.append((group_of[seg.param], rows[0], self._grad_views[view], rows[1], rows[2],
                           steps[seg.param]))
        fused_adamw_by_group(pieces, hparams)

    def _count(self, *, h2d: int = 0, d2h: int = 0) -> None:
        if self.link is not None:
            self.link.add("optimizer", h2d=h2d, d2h=d2h)

