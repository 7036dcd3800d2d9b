"""The streams OffloadStreamAdamW queues its work on, beside the current (compute) stream."""

from __future__ import annotations

import contextlib

import torch


class Streams:
    """Streams beside the current (compute) stream; on CPU, program order.

    update runs the device-side AdamW (device share and buckets) and the weight refresh, so that the
    compute stream is free for the next forward; h2d / d2h carry the streamed buckets; down / up the
    host-updated range's gradients and weights, so that those interleave with the buckets."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.update, self.h2d, self.d2h, self.down, self.up = (
            (torch.cuda.Stream(device) for _ in range(5)) if self.cuda else (None,) * 5)

    def use(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, timing: bool = False):
        """An event on the current stream (None on CPU, where everything has already happened)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        if self.cuda:
            for stream in (self.update, self.h2d, self.d2h, self.down, self.up):
                stream.synchronize()
