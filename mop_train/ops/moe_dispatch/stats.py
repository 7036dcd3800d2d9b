"""What an expert-parallel dispatch reports about its last call: chunks, relocated routes, weight
copies, and the routes each destination received per chunk against the receiver bound.

The MoE layer owns one `DispatchStats` (in its `ExpertDispatch`, mop_train.ops.moe_dispatch), hands
it to `moe_experts_forward(..., stats=...)`, and the schedule fills it with `record_stats` on the
first pass (a checkpoint's recompute records nothing new); the loop reads it at logging time.

Legend: K chunks, E_p expert-group size, k top-k, c_eff tokens per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mop_train.ops.moe_dispatch.comm import group_size, host_to_device


@dataclass
class DispatchStats:
    """Figures of one expert-parallel dispatch call, filled by the schedule (`record_stats`).

    Filling it costs no host sync: the max over destinations is all-reduced on the device and read
    (one device-to-host copy) the first time `chunk_max_received` or `last_chunk_max_received` is."""

    num_chunks: int = 0                                  # K
    relocated_routes: int = 0                            # routes computed off their owner (group total)
    migrated_experts: int = 0                            # (expert, helper) weight copies in the plan
    weight_transfer_bytes: int = 0                       # bytes of those copies (w1+w2+w3; group total,
                                                         # forward; backward returns as many)
    chunk_received: list[int] = field(default_factory=list)  # routes this rank received, per chunk
    chunk_sent: list[int] = field(default_factory=list)      # routes this rank sent, per chunk
    received_bound: int = 0                              # E_p * k * c_eff, the receiver bound
    _chunk_peak: torch.Tensor | list[int] | None = field(default=None, repr=False)

    @property
    def chunk_max_received(self) -> list[int]:
        """Per chunk, the most routes any destination of the group received."""
        if isinstance(self._chunk_peak, torch.Tensor):
            self._chunk_peak = self._chunk_peak.tolist()
        return list(self._chunk_peak or [])

    @property
    def last_chunk_max_received(self) -> int:
        """The max over chunks and destinations (0 before any call)."""
        return max(self.chunk_max_received, default=0)


def record_stats(stats: DispatchStats, chunk_received: list[int], group, device, *,
                 relocated_routes: int = 0, migrated_experts: int = 0, weight_transfer_bytes: int = 0,
                 received_bound: int = 0, chunk_sent: list[int] | None = None,
                 identical_world_peak: list[int] | None = None) -> None:
    """Fill `stats`; the max over destinations costs one small all-reduce, read lazily.
    `chunk_sent`: routes this rank sent per chunk (None: as many as it received, no exchange).
    `identical_world_peak`: in a fake world (`stands_for_identical_ranks`), where that all-reduce
    returns only this rank's receipts, the max over destinations per chunk that the schedule
    computed for a world of identical ranks (None elsewhere)."""
    stats.num_chunks = len(chunk_received)
    stats.chunk_sent = list(chunk_received if chunk_sent is None else chunk_sent)
    stats.relocated_routes = relocated_routes
    stats.migrated_experts = migrated_experts
    stats.weight_transfer_bytes = weight_transfer_bytes
    stats.chunk_received = list(chunk_received)
    if identical_world_peak is not None:   # (the schedules pass it in a fake world only)
        stats._chunk_peak = list(identical_world_peak)
        stats.received_bound = received_bound
        return
    peak = host_to_device(torch.tensor(chunk_received, dtype=torch.int64), device)
    if group_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    stats._chunk_peak = peak
    stats.received_bound = received_bound
