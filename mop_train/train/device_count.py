"""A count kept on the device and read on the host only when asked.

    tokens = DeviceCount()
    tokens.add(n_tokens)          # each step: a 0-dim integer tensor (an all-reduce's result), no read
    tokens.value                  # at logging or checkpoint time: one device-to-host read for all of them

A training step that reads a device value at its end makes the host wait for the device to finish
the step (its optimizer included) before it can launch the next step's first kernels; the device
then idles while the host draws the next batch and launches them. Counts that only logs and
checkpoints need (tokens seen, from which a record's throughput window is derived) therefore stay on
the device.
"""

from __future__ import annotations

import torch


class DeviceCount:
    """An integer total: `add` sums on the device (no host sync); `value` reads it (one sync, then none
    until the next `add`); assigning `value` sets it."""

    def __init__(self, value: int = 0):
        self._read = int(value)
        self._pending: torch.Tensor | None = None   # added since the last read, still on its device

    def add(self, n: torch.Tensor | int, times: int = 1) -> None:
        """Add `times` x `n` (a 0-dim integer tensor on any device, or an int) without reading it."""
        if not isinstance(n, torch.Tensor):
            self._read += int(n) * times
            return
        if n.dim() != 0 or n.is_floating_point() or n.is_complex():
            raise ValueError(f"DeviceCount.add takes a 0-dim integer tensor, got shape {tuple(n.shape)} "
                             f"and dtype {n.dtype}")
        n = n.detach().to(torch.int64) * times
        self._pending = n if self._pending is None else self._pending + n

    @property
    def value(self) -> int:
        if self._pending is not None:
            self._read += int(self._pending.item())
            self._pending = None
        return self._read

    @value.setter
    def value(self, value: int) -> None:
        self._read, self._pending = int(value), None
