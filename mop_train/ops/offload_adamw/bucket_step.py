"""The device-side part of OffloadStreamAdamW.step: the device-resident head's buckets, the streamed
buckets, the fp32 gradients they read and the working weights they refresh.

Per bucket (all on the update stream unless said; the first `slots` buckets' state may have been
staged during backward already: OffloadStreamAdamW.stage_ahead): the gradients of its segments are copied into
the [B] fp32 gradient buffer (upcast from the device gradients, or host -> device from the pinned
gradient buffer when gradients stream, then scaled by the clipping coefficient there: the same fp32
multiply the loop applies to device gradients); the state is staged (streamed buckets: host ->
device on the h2d stream), torch's fused AdamW runs, the state goes back (d2h stream) and the
working weights are refreshed from the updated masters:
  weights = "device" / "bf16": the device working tensor is overwritten (cast inside the copy);
  weights = "stream":          the masters are cast on the device into a temporary and copied into
                               the pinned host working copy on the d2h stream, from which the next
                               forward streams them per block (working.py).
Each bucket's Ready piece (forward_waits.py) is the event after which its working weights are final:
on the update stream, or on the d2h stream when they go to the host.
Legend: B bucket capacity (elements), s slots.
"""

from __future__ import annotations

from mop_train.ops.offload_adamw.forward_waits import Ready
from mop_train.ops.offload_adamw.link import host_bytes
from mop_train.ops.offload_adamw.update import fused_adamw_by_group


class BucketStep:
    """Mixin of OffloadStreamAdamW: uses its _streams, _device_share, _buckets, _slot_buffers,
    _slot_free, _slot_read, _grad_buffer, _group_of, _dev_end, _host, slots, grad_scale,
    gradients, link (the step's host-link account, link.py) and _working_on_host."""

    def _update_on_device(self, bucket, grads, work, fresh, steps, hparams) -> Ready:
        """A bucket of the device-resident head: fused AdamW in place (on the update stream)."""
        share = self._device_share
        live = self._upcast_grads(bucket, grads)
        pieces, refresh = [], []
        for param, src, dst in live:
            master, exp_avg, exp_avg_sq = share.rows(param, src.start, bucket.start + dst.start,
                                                     dst.stop - dst.start, work)
            if not share.aliased(param):
                if fresh[param]:  # first update: the master is the current working weight
                    master.copy_(work[param][src])
                refresh.append((work[param][src], master))
            pieces.append((self._group_of[param], master, self._grad_buffer[dst], exp_avg, exp_avg_sq,
                           steps[param]))
        fused_adamw_by_group(pieces, hparams)
        _, ready = self._refresh(refresh)
        return Ready(bucket.start, bucket.start + bucket.numel, ready)

    def _stream_buckets(self, grads, work, fresh, steps, hparams) -> list[Ready]:
        """Queue every streamed bucket's copy-in, update, weight refresh and write-back (the current
        stream is the update stream); one Ready piece per bucket."""
        s = self._streams
        ready, early = [], self._early or []   # early: copied in during backward (stage_ahead)
        for b, bucket in enumerate(self._buckets):
            k = b % self.slots
            lo = bucket.start - self._dev_end
            staged = self._slot_buffers[k][:, :bucket.numel]                   # [3, n] device
            host = self._host[:, lo:lo + bucket.numel]                         # [3, n] host
            loaded = early[b] if b < len(early) else self._copy_in(k, bucket)
            self.link.add("optimizer", h2d=host_bytes(host), d2h=host_bytes(host))  # (the write-back below)
            live = self._upcast_grads(bucket, grads)  # needs no slot: overlaps the copy-in
            s.wait(loaded)
            self._adamw(staged, live, work, fresh, steps, hparams)
            updated = s.record()
            with s.use(s.d2h):
                s.wait(updated)
                for row in range(3):
                    host[row].copy_(staged[row], non_blocking=True)
                self._slot_free[k] = s.record(timing=True)
            # refresh the working weights while the write-back runs
            self._slot_read[k], done = self._refresh([(work[p][src], staged[0, dst]) for p, src, dst in live])
            ready.append(Ready(bucket.start, bucket.start + bucket.numel, done))  # step_seconds times it
            if not self._working_on_host:  # (on the host, the refresh's copy is the d2h stream's last)
                self._writeback_done = self._slot_free[k]
        return ready

    def _copy_in(self, k: int, bucket):
        """Queue bucket's masters and moments host -> device into slot k on the h2d stream, once the slot's
        last write-back and weight refresh are done; returns the event after the copy."""
        s, lo = self._streams, bucket.start - self._dev_end
        with s.use(s.h2d):
            s.wait(self._slot_free[k])  # the slot's last write-back ...
            s.wait(self._slot_read[k])  # ... and its last weight refresh (so, in order, every earlier one)
            staged, host = self._slot_buffers[k][:, :bucket.numel], self._host[:, lo:lo + bucket.numel]
            for row in range(3):
                staged[row].copy_(host[row], non_blocking=True)
            return s.record()

    def _refresh(self, pairs):
        """Write bf16/fp32(master) into the working weights: pairs (working view, fp32 master on the
        device). Returns (the event after which the masters were read, the event after which the
        working weights are final); both None on CPU."""
        s = self._streams
        if not self._working_on_host:
            for weight, master in pairs:
                weight.copy_(master)
            read = s.record(timing=True)
            return read, read
        # Cast on the device (a copy even in the same dtype: the d2h copy must not read the slot).
        casts = [master.to(weight.dtype, copy=True) for weight, master in pairs]
        self.link.add("optimizer", d2h=sum(host_bytes(weight) for weight, _ in pairs))
        read = s.record(timing=True)
        with s.use(s.d2h):
            s.wait(read)
            for (weight, _), cast in zip(pairs, casts):
                weight.copy_(cast, non_blocking=True)
                if s.cuda:
                    cast.record_stream(s.d2h)
            done = s.record(timing=True)
        self._writeback_done = done  # the d2h stream's latest copy (wait_for_writeback waits for it)
        return read, done

    def _upcast_grads(self, bucket, grads) -> list[tuple[int, slice, slice]]:
        """fp32 gradients of the bucket's updated segments; returns (param, src, dst) per segment."""
        grad32 = self._grad_buffer  # [B] fp32
        scale = self.grad_scale
        live = []
        for seg in bucket.segments:
            grad = grads[seg.param]
            if grad is None:
                continue  # no gradient: master, moments and step stay as they are
            dst = slice(seg.bucket_start, seg.bucket_start + seg.numel)
            src = slice(seg.param_start, seg.param_start + seg.numel)
            grad32[dst].copy_(grad[src], non_blocking=True)  # pinned host source when gradients stream
            if self.gradients == "stream":
                self.link.add("optimizer", h2d=host_bytes(grad[src]))
            if scale is not None:
                grad32[dst].mul_(scale)  # the clipping coefficient (gradients = "stream")
            live.append((seg.param, src, dst))
        return live

    def _adamw(self, staged, live, work, fresh, steps, hparams) -> None:
        """torch's fused AdamW over the live segments of a staged bucket, one call per group."""
        pieces = []
        for param, src, dst in live:
            if fresh[param]:  # first update: the master is the current working weight
                staged[0, dst].copy_(work[param][src])
            pieces.append((self._group_of[param], staged[0, dst], self._grad_buffer[dst], staged[1, dst],
                           staged[2, dst], steps[param]))
        fused_adamw_by_group(pieces, hparams)
