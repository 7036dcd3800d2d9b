"""Host storage for one offloaded checkpoint boundary, reused from step to step.

A boundary's bytes are kept in a few host chunks whose sizes are the powers of two in the binary
expansion of its byte count, largest first (e.g. 360 MiB = 256 + 64 + 32 + 8 MiB). torch's pinned
memory allocator rounds every block up to a power of two, so one block per boundary could pin
almost twice the budget; power-of-two chunks pin exactly the bytes asked for. Largest-first order
keeps every chunk's offset inside the boundary aligned to that chunk's size.

On a CUDA run the chunks are pinned and the copies are asynchronous on the caller's current
stream; on a CPU run (where pin_memory() raises on a CPU-only torch build) they are plain host
tensors and the copies are synchronous, through the same code.
"""

from __future__ import annotations

import torch


def power_of_two_parts(nbytes: int) -> list[int]:
    """Binary expansion of `nbytes`, largest part first: 96 -> [64, 32]; 0 -> []."""
    return [1 << bit for bit in reversed(range(nbytes.bit_length())) if (nbytes >> bit) & 1]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy). [numel * element_size]"""
    return t.reshape(-1).view(torch.uint8)


class HostBuffer:
    """`capacity` host bytes in power-of-two chunks (pinned when `pinned`).

    `busy` is set while the buffer holds a boundary that some autograd graph may still read back.
    """

    def __init__(self, capacity: int, pinned: bool):
        self.capacity = capacity
        self.pinned = pinned
        self.busy = False
        self.chunks = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
                       for size in power_of_two_parts(capacity)]

    def _spans(self, nbytes: int):
        """(chunk, start, length) covering bytes [0, nbytes) of the boundary, in order."""
        start = 0
        for chunk in self.chunks:
            if start >= nbytes:
                return
            length = min(chunk.numel(), nbytes - start)
            yield chunk, start, length
            start += length

    def write(self, src: torch.Tensor) -> None:
        """Copy the contiguous `src` (any device, nbytes <= capacity) into the chunks."""
        flat = byte_view(src)
        for chunk, start, length in self._spans(flat.numel()):
            chunk[:length].copy_(flat[start:start + length], non_blocking=self.pinned)

    def read_into(self, dst: torch.Tensor) -> None:
        """Copy the first dst.nbytes bytes back into the contiguous `dst` (any device)."""
        flat = byte_view(dst)
        for chunk, start, length in self._spans(flat.numel()):
            flat[start:start + length].copy_(chunk[:length], non_blocking=self.pinned)
