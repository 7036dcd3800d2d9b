"""Host memory for offloaded checkpoint boundaries: one arena per rank, reused from step to step.

The arena is a sequence of host chunks totalling exactly the host budget, allocated lazily (only
up to the highest byte a step has used) and never freed. Boundaries are placed one after another
in forward order (a bump pointer) and the pointer returns to 0 once no offloaded boundary is alive,
so the greedy rule "offload iff it still fits" is exact and the host footprint never exceeds the
budget. A boundary may straddle chunks; its copy is then split at the chunk edges.

Chunks are powers of two (CHUNK_BYTES, then the binary expansion of the remainder, largest
first) because torch's pinned-memory allocator rounds every block up to a power of two: one
block of the budget's size could pin almost twice the budget.

On a CUDA run the chunks are pinned and copies are asynchronous on the caller's current stream; on
a CPU run (pin_memory() raises on a CPU-only torch build) they are plain host tensors and the
copies are synchronous, through the same code.
"""

from __future__ import annotations

import bisect

import torch

CHUNK_BYTES = 1 << 28
"""Size of the arena's full chunks (256 MiB); the last chunks split the remainder."""


def power_of_two_parts(nbytes: int) -> list[int]:
    """Binary expansion of `nbytes`, largest part first: 96 -> [64, 32]; 0 -> []."""
    return [1 << bit for bit in reversed(range(nbytes.bit_length())) if (nbytes >> bit) & 1]


def chunk_plan(budget: int, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """Chunk sizes of an arena of exactly `budget` bytes, all powers of two."""
    if chunk_bytes < 1 or chunk_bytes & (chunk_bytes - 1):
        raise ValueError(f"chunk_bytes = {chunk_bytes} must be a power of two >= 1")
    return [chunk_bytes] * (budget // chunk_bytes) + power_of_two_parts(budget % chunk_bytes)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy). [numel * element_size]"""
    return t.reshape(-1).view(torch.uint8)


class HostArena:
    """Up to `budget` host bytes in power-of-two chunks, allocated on first use and kept."""

    def __init__(self, budget: int, chunk_bytes: int = CHUNK_BYTES):
        self._plan = chunk_plan(budget, chunk_bytes)
        self.chunks: list[torch.Tensor] = []
        self._starts: list[int] = []   # arena offset of each allocated chunk
        self.capacity = 0
        self.pinned = False

    def grow_to(self, end: int, pinned: bool) -> None:
        """Make bytes [0, end) exist (end <= budget); chunks are pinned when `pinned`."""
        if self.chunks and pinned != self.pinned:
            raise ValueError("boundaries from a CUDA device and from the CPU cannot share one "
                             "SelectiveCheckpointOffload; use one per device")
        self.pinned = pinned
        while self.capacity < end:
            size = self._plan[len(self.chunks)]
            self.chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=pinned))
            self._starts.append(self.capacity)
            self.capacity += size

    def _spans(self, offset: int, nbytes: int):
        """(chunk slice, start within the boundary, length) covering arena bytes [offset, offset+nbytes)."""
        index = bisect.bisect_right(self._starts, offset) - 1
        done = 0
        while done < nbytes:
            chunk, start = self.chunks[index], self._starts[index]
            inside = offset + done - start
            length = min(chunk.numel() - inside, nbytes - done)
            yield chunk[inside:inside + length], done, length
            done += length
            index += 1

    def write(self, offset: int, src: torch.Tensor) -> None:
        """Copy the contiguous `src` (any device) to arena bytes starting at `offset`."""
        flat = byte_view(src)
        for part, start, length in self._spans(offset, flat.numel()):
            part.copy_(flat[start:start + length], non_blocking=self.pinned)

    def read_into(self, offset: int, dst: torch.Tensor) -> None:
        """Copy dst.nbytes arena bytes starting at `offset` into the contiguous `dst` (any device)."""
        flat = byte_view(dst)
        for part, start, length in self._spans(offset, flat.numel()):
            flat[start:start + length].copy_(part, non_blocking=self.pinned)
