"""Overlap of the optimizer step with the next forward: each unit's forward waits only for the
pieces of the step that hold its own parameters.

A step leaves a list of ready pieces per lane, each a flat range whose working weights are final
once its event has passed: lane 0 is the update stream (the device-resident buckets, then the
streamed buckets, in flat order), lane 1 the upload stream of the CPU-updated share (its chunks, in
flat order). Events of one lane are recorded on one stream in flat order, so waiting for piece j
also covers every earlier piece of that lane. A forward pre-hook on each unit (FSDP2 unit, or any
module) waits, before the unit's own forward and before FSDP2's all-gather of it, for the last
piece of each lane that intersects the unit's parameters; a piece is never waited for twice. The
waits are device-side (stream waits on events): the host never blocks, and on a CPU-only build
they are bookkeeping only.

With the flat order = the forward's order (`forward_order`), the forward runs block i while the
buckets of blocks > i are still in flight. The CPU-updated share is still computed inside step()
(the host thread runs torch's CPU AdamW), so with host_fraction > 0 the forward is enqueued once
that is done; its uploads and the remaining buckets then overlap the forward.
Anything that reads the weights outside the hooked units (a checkpoint save, an evaluation, a
finiteness check of the model) must call `OffloadStreamAdamW.wait_for_weights()` first.
Legend: N local elements, lane 0 update stream, lane 1 upload stream.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import nn

LANES = 2  # 0: update stream (device share, streamed buckets); 1: upload stream (CPU-updated share)


@dataclass(frozen=True)
class Ready:
    """Flat range [lo, hi) whose working weights are final once `event` has passed (None on CPU)."""

    lo: int
    hi: int
    event: object = None


def forward_units(root: nn.Module, units: list[nn.Module] | None = None) -> list[tuple[nn.Module, list]]:
    """[(module, parameters it consumes)] in forward order.

    Default units: the FSDP2 units under `root` (`fully_shard`ed modules) in registration order,
    the root first (FSDP2 gathers the root's own parameters before any block runs), or [root] when
    nothing is sharded; the modules of one `fully_shard([a, b])` are one unit, named by its first
    module (its pre-forward gathers them all: the head [norm, output]). Each parameter belongs to the
    innermost unit that holds it; units with no parameters of their own are dropped.
    """
    members: dict[nn.Module, list[nn.Module]] = {}
    if units is None:
        from torch.distributed.fsdp import FSDPModule
        units, states = [], set()
        for m in root.modules():
            if isinstance(m, FSDPModule) and id(state := m._get_fsdp_state()) not in states:
                states.add(id(state))
                units.append(m)
                members[m] = list(getattr(state, "_modules", (m,)))
        units = units or [root]

    def params_of(unit):
        return [p for m in members.get(unit, [unit]) for p in m.parameters()]
    owner: dict[int, nn.Module] = {}
    # a nested unit holds a subset of its ancestors' parameters: fewest parameters = innermost
    for unit in sorted(units, key=lambda m: len(params_of(m))):
        for p in params_of(unit):
            owner.setdefault(id(p), unit)
    out = [(unit, [p for p in params_of(unit) if owner[id(p)] is unit]) for unit in units]
    return [(unit, params) for unit, params in out if params]


def forward_order(root: nn.Module, units: list[nn.Module] | None = None) -> list[nn.Parameter]:
    """`root`'s parameters in the order the forward consumes them: unit by unit (`forward_units`),
    then any parameter no unit holds."""
    ordered = [p for _, params in forward_units(root, units) for p in params]
    seen = {id(p) for p in ordered}
    return ordered + [p for p in root.parameters() if id(p) not in seen]


def _fsdp_streams(module: nn.Module) -> list:
    """FSDP2's all-gather streams for `module` (they read the sharded weights before the unit's
    forward); [] for plain modules and before FSDP2's lazy init."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    ctx = getattr(get_state(), "_comm_ctx", None)
    return [s for name in ("all_gather_copy_in_stream", "all_gather_stream")
            if (s := getattr(ctx, name, None)) is not None]


class ForwardWaits:
    """The ready pieces of the latest step and the waits the forward makes on them.

    `log` lists the (lane, piece) waits since the latest step, in order (tests and debugging);
    `exposed_seconds()` is the time the compute stream spent in them."""

    def __init__(self, streams):
        self._streams = streams
        self._lanes: tuple[list[Ready], ...] = tuple([] for _ in range(LANES))
        self._los: tuple[list[int], ...] = tuple([] for _ in range(LANES))
        self._done = [-1] * LANES
        self.log: list[tuple[int, int]] = []
        self._cycle = self._finished = None
        self._handles = []
        self._ranges_of: dict[nn.Module, list[tuple[int, int]]] = {}

    @property
    def hooked(self) -> bool:
        return bool(self._handles)

    def arm(self, lanes: tuple[list[Ready], ...], *, count_wall: bool) -> None:
        """A new step's pieces; the previous step's pieces must all have been waited for."""
        self.wait_all()
        self._finish()
        self._lanes = tuple(lanes)
        self._los = tuple([r.lo for r in lane] for lane in lanes)
        self._done = [-1] * LANES
        self.log = []
        self._cycle = {"stalls": [], "wall": 0.0, "count_wall": count_wall}

    def set_wall(self, seconds: float) -> None:
        if self._cycle is not None:
            self._cycle["wall"] = seconds

    def pending(self) -> bool:
        return any(done < len(lane) - 1 for done, lane in zip(self._done, self._lanes))

    def wait_ranges(self, ranges: list[tuple[int, int]], streams=()) -> None:
        """Make the current stream (and `streams`) wait until the weights of the flat `ranges` are final."""
        todo = []
        for lane, pieces in enumerate(self._lanes):
            last = -1
            for lo, hi in ranges:
                j = bisect.bisect_left(self._los[lane], hi) - 1  # last piece starting before hi
                if j >= 0 and pieces[j].hi > lo:
                    last = max(last, j)
            if last > self._done[lane]:
                todo.append((lane, last))
        if todo:
            self._wait([self._lanes[lane][j].event for lane, j in todo], streams)
            for lane, j in todo:
                self._done[lane] = j
                self.log.append((lane, j))

    def wait_all(self, since=None) -> None:
        """Make the current stream wait for every piece; `since`: an earlier event of the current
        stream from which the stall is counted (the step's start, when nothing ran in between)."""
        todo = [(lane, len(pieces) - 1) for lane, pieces in enumerate(self._lanes) if len(pieces) - 1 > self._done[lane]]
        if todo:
            self._wait([self._lanes[lane][j].event for lane, j in todo], (), since)
            for lane, j in todo:
                self._done[lane] = j
                self.log.append((lane, j))
        self._finish()

    def _wait(self, events, streams, since=None) -> None:
        s = self._streams
        if not s.cuda:
            return
        current = torch.cuda.current_stream(s.device)
        before = since if since is not None else s.record(timing=True)
        for event in events:
            if event is not None:
                current.wait_event(event)
                for stream in streams:
                    stream.wait_event(event)
        self._cycle["stalls"].append((before, s.record(timing=True)))

    def _finish(self) -> None:
        if self._cycle is not None and not self.pending():
            self._finished = self._cycle

    def exposed_seconds(self) -> float:
        """Seconds the compute stream waited for the optimizer in the latest step whose pieces have
        all been waited for (with overlap: the previous step until the forward has waited for all of
        this one): the stalls at the waits, plus the step's host time when that held the forward
        back (overlap, or a CPU-only build). Synchronises with those events."""
        cycle = self._finished
        if cycle is None:
            return 0.0
        stalls = 0.0
        for before, after in cycle["stalls"]:
            after.synchronize()
            stalls += before.elapsed_time(after) / 1e3
        return stalls + (cycle["wall"] if cycle["count_wall"] else 0.0)

    def hook(self, module: nn.Module, ranges: list[tuple[int, int]]) -> None:
        """Wait for `ranges` before `module`'s forward (and before FSDP2's pre-forward all-gather,
        also for the units it prefetches: `FSDPModule.set_modules_to_forward_prefetch`)."""
        self._ranges_of[module] = ranges

        def pre_forward(mod, args):
            self.wait_ranges(ranges + self._prefetched_ranges(mod), _fsdp_streams(mod))
        self._handles.append(module.register_forward_pre_hook(pre_forward, prepend=True))

    def _prefetched_ranges(self, module: nn.Module) -> list[tuple[int, int]]:
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            return []
        return [r for state in getattr(get_state(), "_states_to_forward_prefetch", ())
                for m in getattr(state, "_modules", ()) for r in self._ranges_of.get(m, [])]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._ranges_of = [], {}
