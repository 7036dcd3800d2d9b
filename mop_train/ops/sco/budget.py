"""SCO host budget and memory bound: which boundaries go to the host, and how many bytes that is.

The selection rule (paper section 3.3): walk the checkpointed layers in forward order and offload a
boundary iff it still fits in what is left of the per-rank host budget. Boundaries of zero bytes
are never offloaded (there is nothing to move). The device then retains only the boundaries that
were not selected; in backward at most one offloaded boundary is back on the device ahead of its
layer (the prefetch), so

    retained boundary bytes on device <= sum_{l not in S} B_l + max_{l in S} B_l .

`resolve_host_budget` turns the `[mop.sco] host_budget` string into bytes per rank; "auto" takes
AUTO_HOST_FRACTION of the host memory available now and splits it evenly among the node's ranks.

Legend: L checkpointed layers, B_l bytes of boundary l (N_l x H elements), S the offloaded set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mop_train.ops.bound import DeviceBound
from mop_train.units import parse_bytes

AUTO_HOST_FRACTION = 0.5
"""Share of currently available host RAM that host_budget = "auto" gives to SCO on a node.

Half, because pinned pages cannot be swapped and the rest of the process (data loading, an
offloaded optimizer's host state, the pinned staging of other operators) needs host memory too.
Resolve "auto" after those are allocated so that they are not counted as available."""


def boundary_bytes(tokens: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one checkpoint boundary h_l [N, H]."""
    return tokens * hidden * torch.empty((), dtype=dtype).element_size()


def select_offloaded(sizes: Sequence[int], host_budget_bytes: int) -> list[int]:
    """Greedy forward-order selection: indices l whose boundary of `sizes[l]` bytes is offloaded."""
    selected, used = [], 0
    for index, nbytes in enumerate(sizes):
        if 0 < nbytes and used + nbytes <= host_budget_bytes:
            selected.append(index)
            used += nbytes
    return selected


def retained_boundary_bytes(sizes: Sequence[int], host_budget_bytes: int) -> int:
    """Device bytes of boundaries kept through forward (the SCO term of the per-rank budget)."""
    offloaded = set(select_offloaded(sizes, host_budget_bytes))
    return sum(nbytes for index, nbytes in enumerate(sizes) if index not in offloaded)


IN_FLIGHT = 2
"""Offloaded boundaries on the device at once in backward: the one being recomputed and the prefetch."""


def device_bound(host_budget_bytes: int, boundary_sizes: Sequence[int]) -> DeviceBound:
    """Device bytes of the checkpoint boundaries through the step: those SCO keeps (`saved`) and the
    offloaded ones back on the device in backward (`working`: up to IN_FLIGHT of the largest).

    Args:
        host_budget_bytes: [mop.sco] host_budget resolved, per rank (0: SCO off, every boundary kept).
        boundary_sizes: B_l, bytes of each checkpointed layer's input in forward order.
    """
    offloaded = select_offloaded(boundary_sizes, host_budget_bytes)
    retained = retained_boundary_bytes(boundary_sizes, host_budget_bytes)
    largest = max((boundary_sizes[i] for i in offloaded), default=0)
    return DeviceBound(retained, min(len(offloaded), IN_FLIGHT) * largest,
                       f"{len(boundary_sizes)} checkpointed block inputs, {len(offloaded)} offloaded by SCO "
                       f"({IN_FLIGHT} in flight in backward)")


def available_host_bytes(meminfo_path: str = "/proc/meminfo") -> int:
    """Host memory available to this process now: MemAvailable, capped by a cgroup v2 limit."""
    available = None
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            import psutil
        except ImportError as err:
            raise ValueError(f"cannot read available host memory from {meminfo_path} and psutil is not "
                             "installed; set [mop.sco] host_budget to a size such as \"24GiB\"") from err
        available = int(psutil.virtual_memory().available)
    return min(available, _cgroup_headroom())


def _cgroup_headroom() -> int:
    """memory.max - memory.current of this cgroup (v2), or a huge number when unlimited/unknown."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 62
    if limit == "max":
        return 1 << 62
    return max(int(limit) - current, 0)


def resolve_host_budget(text: str | int, local_world_size: int, *,
                        available_bytes: int | None = None) -> int:
    """`[mop.sco] host_budget` -> bytes per rank.

    Args:
        text: "0" (SCO off), a byte size such as "24GiB" or "512MiB" (per rank), or "auto".
        local_world_size: ranks on this node that share its host memory (torchrun's
            LOCAL_WORLD_SIZE); "auto" gives each an equal share.
        available_bytes: host bytes available now; read from /proc/meminfo when None.
    Returns:
        int bytes, >= 0. "auto" = floor(AUTO_HOST_FRACTION * available / local_world_size).
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size = {local_world_size!r} must be an int >= 1 "
                         "(the number of ranks on this node)")
    if isinstance(text, str) and text.strip().lower() == "auto":
        if available_bytes is None:
            available_bytes = available_host_bytes()
        return int(AUTO_HOST_FRACTION * available_bytes) // local_world_size
    return parse_bytes(text, key="mop.sco.host_budget")

