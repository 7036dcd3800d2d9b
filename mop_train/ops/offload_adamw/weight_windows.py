"""The device windows of weights = "stream": each block's working weights copied host -> device one
block ahead of their use into a fixed set of block-sized slots, reused after the block's last use.

Two windows, each `weight_window` slots (s_w, default 2):
- `UnitWindow`: FSDP2 units (slots of the largest block unit; the units gathered once a step and
  larger than a block get a one-off buffer, held only while FSDP2 copies it in: the root's own, the
  token embedding at the forward's start, the head [norm, output] at the forward's end). FSDP2 reads a parameter's all-gather source from
  `FSDPParam._sharded_param_data` inside `FSDPParamGroup.unshard` (world size > 1: copied into the
  all-gather buffer on its copy-in stream) or `wait_for_unshard` (world size 1: copied on the current
  stream). This is where FSDP2's CPUOffloadPolicy makes its host -> device copy (in
  `FSDPParam.all_gather_inputs`), so the window wraps those two methods of each group: before FSDP2
  gathers, the unit's bf16 shards are copied into a slot on an h2d side stream, the copy-in stream
  waits for that copy's event, `_sharded_param_data` points into the slot; after `wait_for_unshard`
  the slot is released (an event on the current stream). FSDP2's own prefetch (forward:
  `set_modules_to_forward_prefetch`, backward: implicit) thus makes the copies one unit ahead, and the
  recompute reuses the unit gathered for backward. CPUOffloadPolicy itself is not used: it keeps
  fp32 shards on the host (4 B/param over the link, not 2) and moves the parameters themselves to
  the CPU, where OffloadStreamAdamW's device update cannot treat them as device tensors.
- `ShardWindow`: the shards FSDP2 does not manage, one block per MoE layer (its w1, w2, w3) and one
  for the vocab shard, in forward order. The model asks for each weight as it computes
  (`weight(param, dtype)`, via `WorkingWeight`); a block found in a slot is used as it is (the
  last block of the forward is still there for its recompute); otherwise it is loaded into a free
  slot. The first request of a block prefetches the next one (forward: the next block; backward: the
  previous checkpointed one). A slot is in use from its load until the block's last use: in the
  forward of a checkpointed block, until the next block is requested (the checkpoint keeps none of
  its tensors); when the weight is needed in backward (the recompute's requests, or a block that
  is not checkpointed), until every parameter's WorkingWeight backward has run; a request in
  another dtype (the vocab shard handed to Ring-DTP in fp32) copies and releases at once. When no
  slot is free the block goes to an extra slot (counted in `stats["overflow"]`; none in a
  step that follows these rules).
Every copy is on the window's h2d stream after an event of the current stream (so after the
optimizer's step and the forward's waits); the consumer waits for the copy's event; nothing waits on
the host. On CPU the same copies run in program order. Each load's bytes go to the optimizer's
host-link account (`link`, source "windows"; link.py).
Legend: s_w window slots.
"""

from __future__ import annotations

import torch

from mop_train.ops.offload_adamw.link import host_bytes
from mop_train.ops.offload_adamw.working_weight import WorkingWeight, in_backward


class _Slots:
    """`count` device buffers of `capacity` elements with their load / release events."""

    def __init__(self, count: int, capacity: int, dtype: torch.dtype, device: torch.device, link=None):
        self.link = link  # LinkCounter of the step's host-link bytes (link.py), or None
        self.cuda = device.type == "cuda"
        self.device, self.dtype, self.capacity = device, dtype, capacity
        self.buffers = [torch.zeros(capacity, dtype=dtype, device=device) for _ in range(count)]
        self.freed = [None] * count   # event: the slot's last reader is done
        self.loaded = [None] * count  # event: the slot's copy-in is done
        self.busy = [False] * count
        self.stamp = [0] * count      # last load or use (the least recently used free slot is taken)
        self.transient: set[int] = set()  # one-off buffers larger than a slot
        self._clock = 0
        self.h2d = torch.cuda.Stream(device) if self.cuda else None

    def take(self, numel: int = 0) -> tuple[int, bool]:
        """The least recently used slot not in use (a new one when all are); (index, overflow). A
        request larger than the slots (a unit gathered once a step: the root's, the embedding, the
        head) gets a buffer of its own, dropped on release."""
        if numel > self.capacity:
            self.buffers.append(torch.empty(numel, dtype=self.dtype, device=self.device))
            self.freed.append(None)
            self.loaded.append(None)
            self.busy.append(True)
            self.stamp.append(0)
            self.transient.add(len(self.buffers) - 1)
            return len(self.buffers) - 1, False
        free = [k for k, b in enumerate(self.busy) if not b and k not in self.transient]
        overflow = not free
        if overflow:
            self.buffers.append(torch.zeros(self.capacity, dtype=self.dtype, device=self.device))
            self.freed.append(None)
            self.loaded.append(None)
            self.busy.append(False)
            self.stamp.append(0)
            free = [len(self.buffers) - 1]
        k = min(free, key=lambda j: self.stamp[j])
        self.busy[k] = True
        self.touch(k)
        return k, overflow

    def touch(self, k: int) -> None:
        self._clock += 1
        self.stamp[k] = self._clock

    def load(self, k: int, copies) -> None:
        """Copy (slot offset, host source) pairs into slot k on the h2d stream, after the current
        stream's work so far and the slot's last reader."""
        buffer = self.buffers[k]
        if self.link is not None:
            self.link.add("windows", h2d=sum(host_bytes(src) for _, src in copies))
        if not self.cuda:
            for offset, src in copies:
                buffer[offset:offset + src.numel()].copy_(src)
            return
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        if self.freed[k] is not None:
            self.h2d.wait_event(self.freed[k])
        with torch.cuda.stream(self.h2d):
            for offset, src in copies:
                buffer[offset:offset + src.numel()].copy_(src, non_blocking=True)
        self.loaded[k] = self.h2d.record_event()
        if k in self.transient:
            buffer.record_stream(self.h2d)

    def wait_loaded(self, k: int, stream=None) -> None:
        if self.cuda and self.loaded[k] is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self.loaded[k])

    def release(self, k: int) -> None:
        if k in self.transient:  # (freed on the current stream, which has waited for its readers)
            self.buffers[k] = torch.empty(0, dtype=self.dtype, device=self.device)
            return
        self.busy[k] = False
        self.freed[k] = torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def device_bytes(self) -> int:
        """Bytes of the slots (one-off buffers excluded)."""
        kept = [b for k, b in enumerate(self.buffers) if k not in self.transient]
        return sum(b.numel() * b.element_size() for b in kept)


class UnitWindow:
    """Streams FSDP2 units' working shards into `slots` slots around their all-gathers.

    units: [(FSDPParamGroup, [(FSDPParam, optimizer index, slot offset, padded numel)])];
    host: the flat pinned working views with FSDP2's padding, per optimizer index;
    one_off: groups gathered once a step (the root's own, the embedding, the head) that the slots are
    not sized for (each load of them larger than a slot gets its own buffer)."""

    def __init__(self, units, host, slots: int, dtype: torch.dtype, device: torch.device, wait_for_params,
                 link=None, one_off=()):
        sizes = {id(group): sum(n for *_, n in entries) for group, entries in units}
        apart = {id(group) for group in one_off}
        capacity = max((n for key, n in sizes.items() if key not in apart), default=0)  # the others: their own
        self._slots = _Slots(slots, capacity, dtype, device, link)
        self._host, self._wait_for_params = host, wait_for_params
        self._pending: dict[int, int] = {}  # id(group) -> slot, between unshard and wait_for_unshard
        self.stats = {"loads": 0, "overflow": 0, "transient": 0}
        self.log: list[tuple[str, bool]] = []  # (unit's module name, in backward) per load
        for group, entries in units:
            self._wrap(group, entries)

    def _wrap(self, group, entries) -> None:
        unshard, wait_for_unshard = group.unshard, group.wait_for_unshard

        def streamed_unshard(async_op: bool = False):
            if _will_gather(group):
                self._load(group, entries, async_op)
            return unshard(async_op)

        def streamed_wait_for_unshard():
            k = self._pending.pop(id(group), None)
            if k is not None:
                self._slots.wait_loaded(k)  # world size 1: FSDP2 copies the source here
            wait_for_unshard()
            if k is not None:
                self._slots.release(k)
        group.unshard, group.wait_for_unshard = streamed_unshard, streamed_wait_for_unshard

    def _load(self, group, entries, async_op: bool) -> None:
        stale = self._pending.pop(id(group), None)  # an unshard FSDP2 dropped without waiting for it
        if stale is not None:
            self._slots.release(stale)
        self._wait_for_params([fp.sharded_param for fp, *_ in entries])
        numel = sum(n for *_, n in entries)
        k, overflow = self._slots.take(numel)
        self.stats["overflow"] += overflow
        self.stats["transient"] += k in self._slots.transient
        self._slots.load(k, [(offset, self._host[i][:n]) for _, i, offset, n in entries])
        buffer = self._slots.buffers[k]
        for fsdp_param, _, offset, n in entries:
            fsdp_param._sharded_param_data = buffer[offset:offset + n]
        if self._slots.cuda:
            copy_in, _ = group.comm_ctx.get_all_gather_streams(async_op, group._training_state)
            self._slots.wait_loaded(k, copy_in)
        self._pending[id(group)] = k
        self.stats["loads"] += 1
        self.log.append((getattr(group, "_module_fqn", "") or "", in_backward()))


def _will_gather(group) -> bool:
    """FSDP2's unshard will read the sharded data (FSDPParamGroup.unshard's own early returns)."""
    if group._all_gather_result is not None or group.is_unsharded:
        return False
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    return getattr(group, "unshard_in_backward", True) or group._training_state != TrainingState.PRE_BACKWARD


class ShardWindow:
    """Streams the blocks of shards kept out of FSDP2 into `slots` slots as the model asks for them.

    blocks: [(params, checkpointed)] in forward order (a parameter in one block); index: id(param) ->
    optimizer index; host: flat pinned working views per optimizer index."""

    def __init__(self, blocks, index, host, slots: int, dtype: torch.dtype, device: torch.device, wait_for_params,
                 version=lambda: 0, link=None):
        self._version, self._loaded_at = version, {}  # the working weights' version, per resident block
        self._blocks = [tuple(params) for params, _ in blocks]
        self._checkpointed = [bool(c) for _, c in blocks]
        self._where: dict[int, tuple[int, int, int]] = {}  # id(param) -> (block, offset, optimizer index)
        capacity = 0
        for b, params in enumerate(self._blocks):
            offset = 0
            for p in params:
                self._where[id(p)] = (b, offset, index[id(p)])
                offset += host[index[id(p)]].numel()
            capacity = max(capacity, offset)
        self._slots = _Slots(slots, capacity, dtype, device, link)
        self._host, self._wait_for_params = host, wait_for_params
        self._resident: dict[int, int] = {}  # block -> slot holding it
        self._owner: dict[int, int] = {}     # slot -> block
        self._backward_left = [0] * len(self._blocks)
        self._forward_block = None           # the block the forward asked for last
        self.stats = {"loads": 0, "overflow": 0, "reused": 0, "demand": 0}
        self._last_use = None  # (block, in backward) of the latest request
        self.log: list[tuple[int, bool]] = []  # (block, in backward) per load

    def manages(self, param) -> bool:
        return id(param) in self._where

    def weight(self, param, dtype: torch.dtype) -> torch.Tensor:
        """The working weight of `param` in `dtype`, differentiable in `param` (fp32 gradients)."""
        b, offset, i = self._where[id(param)]
        backward = in_backward()
        first = self._forward_block != b or backward
        k = self._use(b, backward, first)
        if first:
            self._prefetch(b, backward)
        numel = self._host[i].numel()
        self._slots.wait_loaded(k)
        view = self._slots.buffers[k][offset:offset + numel].view(param._local_tensor.shape)
        copy = dtype != view.dtype  # the output is a copy: the slot has no later reader
        if not copy and backward == self._checkpointed[b]:  # backward will read the slot: a recompute's
            self._backward_left[b] += 1                       # request, or a block not checkpointed
        # the forward's node is the one whose backward runs (a recompute's graph is only harvested)
        done = (lambda: self._backward_done(b)) if not copy and not backward else None
        out = WorkingWeight.apply(param, view, dtype, done)
        self._last_use = (b, backward)
        if copy and not backward and self._backward_left[b] == 0 and not self._checkpointed[b]:
            self._release(b)
        return out

    def _use(self, b: int, backward: bool, first: bool) -> int:
        previous = self._forward_block
        self._forward_block = None if backward else b
        if not backward and previous is not None and previous != b and self._checkpointed[previous] \
                and self._backward_left[previous] == 0:
            self._release(previous)  # its forward is over: the checkpoint keeps none of its tensors
        if b in self._resident and self._loaded_at[b] != self._version():
            self._forget(b)  # a step has changed the working weights since
        if b in self._resident:
            k = self._resident[b]
            if first and (b, backward) != self._last_use:
                self.stats["reused"] += 1  # found in its slot: no copy
            self._slots.busy[k] = True
            self._slots.touch(k)
            return k
        self.stats["demand"] += 1
        return self._load(b, backward)

    def _load(self, b: int, backward: bool, prefetch: bool = False) -> int | None:
        if prefetch and all(self._slots.busy):
            return None  # no free slot: the block loads when it is asked for
        self._wait_for_params(self._blocks[b])
        k, overflow = self._slots.take()
        self.stats["overflow"] += overflow
        if k in self._owner:
            self._resident.pop(self._owner[k], None)
        self._owner[k], self._resident[b], self._loaded_at[b] = b, k, self._version()
        self._slots.load(k, [(self._where[id(p)][1], self._host[self._where[id(p)][2]]) for p in self._blocks[b]])
        if prefetch:
            self._slots.busy[k] = False  # loaded, not in use yet: its first request takes it
        self.stats["loads"] += 1
        self.log.append((b, backward))
        return k

    def _forget(self, b: int) -> None:
        k = self._resident.pop(b)
        self._owner.pop(k)
        if self._slots.busy[k]:
            self._slots.release(k)

    def _prefetch(self, b: int, backward: bool) -> None:
        nxt = self._next(b, backward)
        if nxt is not None and nxt in self._resident and self._loaded_at[nxt] != self._version():
            self._forget(nxt)
        if nxt is not None and nxt not in self._resident:
            self._load(nxt, backward, prefetch=True)

    def _next(self, b: int, backward: bool) -> int | None:
        if not backward:
            return b + 1 if b + 1 < len(self._blocks) else None
        earlier = [c for c in range(b) if self._checkpointed[c]]
        return earlier[-1] if earlier else None

    def _backward_done(self, b: int) -> None:
        if self._backward_left[b] > 0:
            self._backward_left[b] -= 1
            if self._backward_left[b] == 0:
                self._release(b)

    def _release(self, b: int) -> None:
        k = self._resident.get(b)
        if k is not None and self._slots.busy[k]:
            self._slots.release(k)
