"""OffloadStreamAdamW: AdamW whose fp32 master weights and moments live in host memory and stream
through the device in buckets, so the device never holds more than a few buckets of optimizer state
(plus the device-resident share it is given).

The flat state (every local shard end to end, in the order given: `forward_order` makes it the
order the forward consumes the parameters) has three parts:
  [0, N_d)        device-resident (device_fraction): fused AdamW in place on the device, no transfer
                  (device_share.py);
  [N_d, split)    streamed: bucket b (<= bucket_params elements, may split tensors) goes host ->
                  device slot b % s on the H2D stream (master, exp_avg, exp_avg_sq), is updated on the
                  update stream (gradients upcast to fp32, torch's fused AdamW, working weights
                  refreshed from the masters) and goes back on the D2H stream; with s >= 2 the
                  copy-in of b+1 and the write-back of b-1 overlap the update of b;
  [split, N)      host_fraction of the rest, updated by the CPU while the buckets stream
                  (host_update.py; 4 B/param each way instead of 12).
Each parameter with a gradient advances its own step count (as torch.optim.AdamW does); on its
first update its master is re-read from the working weight. Every piece's weights are final at an
event (forward_waits.py): without overlap the compute stream waits for all of them at the end of
step(); with overlap each unit of the next forward waits only for its own pieces.
On a CPU-only build the "device" is the CPU and the same code runs in program order.
Paper: section 3.4 (OffloadStreamAdamW) and Appendix E.1 (bucket and slot sweep).
Legend: N local elements (all parameters), N_d device-resident, B bucket capacity, s slots.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.optim import Optimizer

from mop_train.ops.offload_adamw.bucket_step import BucketStep
from mop_train.ops.offload_adamw.buckets import (
    FP32_BYTES, PIECE_ALIGN, allocate_host_buffer, allocate_host_state, device_cut, param_offsets,
    plan_buckets, release_when_idle)
from mop_train.ops.offload_adamw.checks import (check_group, check_host_fraction, check_options, check_params,
                                                check_staging)
from mop_train.ops.offload_adamw.device_share import DeviceShare
from mop_train.ops.offload_adamw.forward_waits import ForwardWaits
from mop_train.ops.offload_adamw.host_update import HostUpdate, host_cut
from mop_train.ops.offload_adamw.link import FP32_STEP_BYTES, LinkBytes, LinkCounter, OffloadStepStats
from mop_train.ops.offload_adamw.state import ROW, StateDictMixin, local_shard
from mop_train.ops.offload_adamw.streams import Streams
from mop_train.ops.offload_adamw.working_weight import in_backward

DEFAULT_BUCKET_PARAMS = 25_000_000  # benchmarks/RESULTS.md: 25M x 3 slots is 2-4% faster than
DEFAULT_SLOTS = 3                   # 100M x 2 at 1B and 2.6B params, with 954 MiB of staging (not 2.6 GiB)


class OffloadStreamAdamW(StateDictMixin, BucketStep, Optimizer):
    """AdamW (torch.optim.AdamW's math) with fp32 masters and moments in (pinned) host memory,
    except a device-resident share.

    Build it like torch.optim.AdamW, from parameters or param groups (each group may set lr,
    betas, eps, weight_decay); every group must be given here, add_param_group is refused later:

        opt = OffloadStreamAdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=3e-4, betas=(0.9, 0.95), bucket_params=25_000_000, slots=3)
        # overlap with the next forward: parameters in forward order, one wait per unit
        opt = OffloadStreamAdamW(forward_order(model), lr=3e-4, device_fraction=0.25, overlap=True)
        opt.wait_in_forward(forward_units(model))

    Args:
        params: parameters or param-group dicts; plain tensors or FSDP2 DTensors (the local shard
            is updated), contiguous, all on one device; bf16 or fp32 working weights. Their order
            is the flat order (the device share is its head, the CPU share its tail).
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        bucket_params: flat elements per streamed bucket (B); buckets may split tensors.
        slots: device staging buffers (s); device staging is s*B*12 + B*4 bytes.
        host_fraction: share f of the streamed part (its tail) updated by the CPU instead; 0 streams
            everything. Costs a pinned fp32 gradient buffer of 4 B per element of the share
            (`host_buffer_bytes`; none with gradients = "stream", whose buffer it reads) and, on the
            device, the casts' temporaries (<= 2 x CHUNK x 4 bytes,
            `staging_bytes_bound(..., host_share=True)`). Same math (torch's fused AdamW on the CPU),
            not the same bits: CPU and CUDA kernels round differently, so runs with different
            host_fraction agree to rounding; resuming with the same value is exact.
        device_fraction: share d of the flat state (its head) kept and updated on the device: 8 B
            per element for fp32 working weights (they are their own masters), 12 B for bf16
            (`device_state_bytes`; `fit_device_fraction` picks the d that fits). The same kernel as
            the streamed buckets: any d gives the same bits at host_fraction = 0 (on CPU too, as the
            cuts are lane-aligned: `piece_align`).
        piece_align: every cut inside a parameter (buckets of >= piece_align elements, the device
            share's end, the CPU share's start) lies on a multiple of this many elements from the
            parameter's start (buckets.PIECE_ALIGN, default 64), so that torch's CPU fused AdamW, whose
            vector lanes start at a piece's first element, rounds each element as it does in the whole
            parameter: bucket_params, device_fraction and host_fraction then do not change the bits of
            the CPU update. 1 cuts anywhere (the tests' tiny shapes use it to place cuts inside them).
        overlap: leave the weights' readiness to the next forward: after `wait_in_forward(units)`
            each unit waits for its own pieces only (without hooks, or with overlap False, the
            compute stream waits for every piece at the end of step()). Same values either way.
        weights: "device" (the parameters' own device tensors are the working weights); "bf16" or
            "stream": the masters are authoritative (never re-read from a working weight), no
            working weight aliases a master, the device share ends on a parameter boundary, and
            `use_working` hands the step the working tensors to refresh (device, or pinned host for
            "stream"); `working.WorkingWeights` sets that up. Same values as "device".
        gradients: "device" (read `param.grad`), or "stream": the gradients arrive in a pinned fp32
            host buffer (`host_grad`, `mark_grad`, grad_stream.py) and are copied host -> device
            per bucket, scaled by `grad_scale` there; the CPU share (host_fraction) reads and scales
            them where they landed (host_update.py), with no buffer of its own.

    State per parameter (state_dict, DCP): "step" (fp32 scalar, per parameter), "exp_avg",
    "exp_avg_sq", "master" (fp32; DTensors with the parameter's sharding for DTensor params): views
    of the host buffer, of the device share (for fp32 weights there, "master" is the weight itself),
    or, for the one parameter that straddles the device/host boundary, a host copy. Loading copies
    into place (load_state_dict), as DCP's Stateful load does.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, bucket_params: int = DEFAULT_BUCKET_PARAMS,
                 slots: int = DEFAULT_SLOTS, host_fraction: float = 0.0, device_fraction: float = 0.0,
                 overlap: bool = False, weights: str = "device", gradients: str = "device",
                 piece_align: int = PIECE_ALIGN, stage_in_backward: bool = False):
        check_options(bucket_params=bucket_params, slots=slots, piece_align=piece_align, weights=weights,
                      gradients=gradients, host_fraction=host_fraction, device_fraction=device_fraction,
                      overlap=overlap, stage_in_backward=stage_in_backward)
        self.stage_in_backward = stage_in_backward
        self._pace_handles, self._pace, self._staging_armed = [], 1, False   # pace_staging / begin_staging
        self.piece_align = piece_align
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        shards = [local_shard(p) for p in self._params]
        self.device = check_params(shards, [p.device for p in self._params], host_values=weights != "device")
        self._numels = [t.numel() for t in shards]
        self._offsets = param_offsets(self._numels)
        self._streams = Streams(self.device)
        total = sum(self._numels)
        self.device_fraction, self.overlap = float(device_fraction), overlap
        self.weights, self.gradients = weights, gradients
        # the same cut whatever `weights`, on a lane boundary of its parameter (buckets.PIECE_ALIGN): on
        # CPU, torch's fused AdamW rounds by an element's lane in its piece
        self._dev_end = device_cut(self._numels, self.device_fraction, piece_align)
        self._device_share = DeviceShare(self._numels, [t.dtype for t in shards], self._dev_end, self.device,
                                         alias_fp32=weights == "device")
        self._host, registered = allocate_host_state(total - self._dev_end, pin=self._streams.cuda)
        if registered:
            weakref.finalize(self, release_when_idle, self._host.data_ptr(), self._streams)
        self._host[1:].zero_()
        self._steps = torch.zeros(len(self._params), dtype=torch.float32)  # torch keeps fp32 steps
        with torch.no_grad():  # the state must not join the parameters' autograd graph
            for i, shard in enumerate(shards):
                self._write_row(ROW["master"], i, shard.reshape(-1))
        self._refresh_state()
        self._waits = ForwardWaits(self._streams)
        self._writeback_done = None
        self._host_update = None
        self._timing = (None, (), 0.0)
        self.link = LinkCounter()  # this step's host-link bytes so far (windows, gradient stream, step)
        self.last_step = OffloadStepStats()
        self._working, self._working_on_host = None, False  # set by use_working (weights != "device")
        self._mirrors: dict[int, torch.Tensor] = {}          # value_tensor of the straddler
        self.weights_version = 0    # steps that changed the working weights (weight_windows.py)
        self.grad_scale = None      # clipping coefficient applied to streamed gradients (0-dim, device)
        self.grads_read = None      # event: the last step's reads of the host gradients are done
        self.grads_landed = None    # event: this step's streamed gradients are all in host memory
        self._host_grads = None
        self._grad_arrived = [False] * len(self._params)
        if gradients == "stream":
            pool, registered = allocate_host_buffer(total * FP32_BYTES, pin=self._streams.cuda)
            if registered:
                weakref.finalize(self, release_when_idle, pool.data_ptr(), self._streams)
            self._host_grads = pool.view(torch.float32)  # [N] fp32, the flat order
        self.resize_staging(bucket_params, slots, host_fraction)

    # ---- construction helpers -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_host"):
            raise ValueError("OffloadStreamAdamW lays out its host state once; pass every param group "
                             "to the constructor instead of calling add_param_group later")
        super().add_param_group(param_group)
        check_group(self.param_groups[-1])

    def resize_staging(self, bucket_params: int, slots: int, host_fraction: float | None = None) -> None:
        """Re-cut the buckets, reallocate the device staging (s*B*12 + B*4 bytes) and, when given,
        move the boundary of the CPU-updated tail (host_fraction). The device share stays."""
        check_staging(bucket_params, slots)
        if host_fraction is not None:
            check_host_fraction(host_fraction)
        self.wait_for_writeback()
        self._streams.synchronize()
        self.bucket_params, self.slots = bucket_params, slots
        if host_fraction is not None:
            self.host_fraction = float(host_fraction)
            self._split = host_cut(self._numels, self._dev_end, self.host_fraction, self.piece_align)
            self._host_update = None  # frees the previous pinned buffers first
            self._host_update = HostUpdate(self._numels, self._split, self._streams, base=self._dev_end,
                                           link=self.link, align=self.piece_align,
                                           streamed_grads=self.gradients == "stream")
        self._device_buckets = plan_buckets(self._numels, bucket_params, end=self._dev_end, align=self.piece_align)
        self._buckets = plan_buckets(self._numels, bucket_params, start=self._dev_end, end=self._split,
                                     align=self.piece_align)
        capacity = max((b.numel for b in self._buckets), default=0)
        grad_capacity = max((b.numel for b in self._buckets + self._device_buckets), default=0)
        self._slot_buffers = self._grad_buffer = None  # free the old staging first
        self._slot_buffers = [torch.empty(3, capacity, dtype=torch.float32, device=self.device)
                              for _ in range(slots)]  # [3, B] each: master, exp_avg, exp_avg_sq
        self._grad_buffer = torch.empty(grad_capacity, dtype=torch.float32, device=self.device)  # [B]
        self._slot_free = [None] * slots  # write-back done, per slot
        self._slot_read = [None] * slots  # weight refresh done, per slot
        self._early = None                # stage_ahead: the copy-in events of the first `slots` buckets
        self.staging_bytes = (3 * slots * capacity + grad_capacity) * 4

    def stage_ahead(self) -> None:
        """Copy the first `slots` streamed buckets' masters and moments into their staging slots now,
        before this step's gradients are final (call it before backward: `stage_in_backward`). They do
        not depend on the gradients -- only the update does, after the clipping norm -- so the host ->
        device direction carries them while backward sends gradients the other way; step() then finds
        them staged and skips their copy-in. Same host values, same copies, earlier: exact. No device
        memory beyond the slots the step allocates anyway. Again before a step: a no-op. Whatever writes
        the state between this and the step must drop the staged copies first: load_state_dict and
        reset_masters_from_params do (drop_staged); an in-place edit of the `state` views must call it."""
        if self._early is None:
            self._early = [self._copy_in(k, bucket) for k, bucket in enumerate(self._buckets[:self.slots])]

    def pace_staging(self, modules) -> None:
        """Spread stage_in_backward over the backward instead of queueing it at once: each of `modules`
        (the FSDP2 units, `forward_units`) gets a forward pre-hook that hooks its input's gradient (outside
        backward: a checkpoint's recompute adds none), and once `begin_staging` has armed the step, each
        such gradient forming -- that module's backward queued, and with it FSDP2's prefetch of the next
        unit's weights -- stages the next ceil(slots / len(modules)) of the first `slots` buckets. Queued
        at once, the 2 x 4K step's 8 GB of staged state held up the blocks' weight copies, which share the
        host -> device engine, and cost 5% (RESULTS.md 2026-12-03); paced, each block's weights wait behind
        one short run of buckets. The same copies of the same host state, earlier: exact either way."""
        if not self.stage_in_backward:
            raise ValueError("pace_staging needs stage_in_backward = true ([mop.offload_adamw] stage_in_backward)")
        modules = list(modules)
        self._pace = max(1, -(-self.slots // max(1, len(modules))))

        def pre_forward(module, args):
            if in_backward():
                return
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if x is not None:
                x.register_hook(self._paced_hook)
        self._pace_handles = [m.register_forward_pre_hook(pre_forward) for m in modules]

    def _paced_hook(self, grad):
        if self._staging_armed:
            self._stage_next(self._pace)

    def begin_staging(self) -> None:
        """Before the step's last backward (stage_in_backward): paced by `pace_staging`'s hooks when they
        are installed, else every one of the first `slots` buckets now (`stage_ahead`)."""
        if not self._pace_handles:
            self.stage_ahead()
            return
        self._early = self._early if self._early is not None else []
        self._staging_armed = True

    def _stage_next(self, count: int) -> None:
        """Stage up to `count` more of the first `slots` buckets, in order."""
        early = self._early
        limit = min(self.slots, len(self._buckets))
        while count > 0 and len(early) < limit:
            k = len(early)
            early.append(self._copy_in(k, self._buckets[k]))
            count -= 1

    def wait_in_forward(self, units) -> None:
        """Overlap: before each unit's forward, wait for the pieces of the step that hold its
        parameters. units: [(module, parameters)] in forward order (`forward_units(model)`); each
        module gets a forward pre-hook that runs before FSDP2's. No effect unless overlap is on."""
        if not self.overlap:
            return
        index = {id(p): i for i, p in enumerate(self._params)}
        for module, params in units:
            ranges = [(self._offsets[i], self._offsets[i] + self._numels[i]) for p in params
                      if (i := index.get(id(p))) is not None and self._numels[i]]
            if ranges:
                self._waits.hook(module, ranges)

    # ---- the step -------------------------------------------------------------------------
    def _flat_grad(self, i: int):
        if self.gradients == "stream":
            return self.host_grad(i) if self._grad_arrived[i] else None
        grad = self._params[i].grad
        if grad is None:
            return None
        if grad.is_sparse:
            raise ValueError("OffloadStreamAdamW does not support sparse gradients")
        grad = local_shard(grad)
        if grad.shape != local_shard(self._params[i]).shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} != local parameter shape "
                             f"{tuple(local_shard(self._params[i]).shape)} (parameter {i})")
        return grad.reshape(-1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [self._flat_grad(i) for i in range(len(self._params))]
        active = [g is not None for g in grads]
        if not any(active):
            self.close_link_account()
            return loss
        fresh = [a and self.weights == "device" and float(self._steps[i]) == 0.0 for i, a in enumerate(active)]
        self.weights_version += 1  # working weights change: copies of the previous ones are stale
        self._steps += torch.tensor(active, dtype=torch.float32)
        hparams = [(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                    float(g["weight_decay"]), float(g["eps"])) for g in self.param_groups]
        s, host = self._streams, self._host_update
        work = self._working or [local_shard(p).view(-1) for p in self._params]  # FSDP2 may swap: re-read
        wall = time.perf_counter()
        start = s.record(timing=True)  # gradients and weights are final from here on
        if s.cuda and self.gradients == "device":  # read on the update stream: not to be reused
            for grad in grads:                      # before it is done (zero_grad frees them)
                if grad is not None:
                    grad.record_stream(s.update)
        if s.cuda and self.grad_scale is not None:  # the clipping coefficient, made on the compute stream
            self.grad_scale.record_stream(s.update)  # and dropped by zero_grad: with overlap the next forward
                                                      # would otherwise reuse its memory while buckets read it
        host.download(grads, work, fresh, self._host, start, landed=self.grads_landed,  # queued first: the
                      scale=self.grad_scale if self.gradients == "stream" else None)  # CPU starts early
        with s.use(s.update):
            s.wait(start)
            s.wait(self.grads_landed)  # streamed gradients: in host memory
            steps = self._steps.pin_memory().to(self.device, non_blocking=True) if s.cuda else self._steps
            self.link.add("optimizer", h2d=len(self._params) * FP32_STEP_BYTES)
            ready = [self._update_on_device(b, grads, work, fresh, steps, hparams) for b in self._device_buckets]
            ready += self._stream_buckets(grads, work, fresh, steps, hparams)
            self._early, self._staging_armed = None, False  # (consumed: the slots hold this step's state now)
            self.grads_read = s.record()  # the next backward may overwrite the host gradients after this
        uploads = host.update(grads, work, self._host, self._steps, self._group_of, hparams,
                              work_on_host=self._working_on_host)
        overlap = self.overlap and self._waits.hooked
        self._waits.arm((ready, uploads), count_wall=overlap or not s.cuda)
        if not overlap:
            self._waits.wait_all(since=start)  # the next reader of the weights waits for every piece
        wall = time.perf_counter() - wall
        self._waits.set_wall(wall)
        done = [r.event for r in ready[-1:] + uploads[-1:]] + [
            self._writeback_done if self._buckets or self._working_on_host else None]
        self._timing = (start, [e for e in done if e is not None], wall)
        link = self.link.close()
        self.last_step = OffloadStepStats(len(self._buckets), link.h2d["optimizer"], link.d2h["optimizer"],
                                          sum(active), host.numel, self._dev_end, link)
        return loss

    def link_bytes(self) -> LinkBytes:
        """The host-link bytes of the last optimizer step, per source and direction (link.py): its
        forwards' and backwards' weight windows, its streamed gradients and the step's own copies."""
        return self.last_step.link

    def close_link_account(self) -> None:
        """End the step's account without an update (a step the loop skips): `link_bytes()` then holds
        what its forwards and backwards moved, and the next step starts from zero. Staged buckets stay
        valid (the host state did not change); their copy counts in the step that uses them."""
        self.last_step = OffloadStepStats(link=self.link.close())

    # ---- working weights and streamed gradients (weights / gradients != "device") ---------------
    def use_working(self, tensors: list[torch.Tensor], *, on_host: bool) -> None:
        """The flat working tensor of each parameter, which every step refreshes from its master
        (device tensors, or pinned host ones when `on_host`); weights != "device" only."""
        if self.weights == "device":
            raise ValueError("use_working needs weights = 'bf16' or 'stream'; with 'device' the parameters "
                             "are their own working weights")
        if [t.numel() for t in tensors] != self._numels:
            raise ValueError(f"working tensors of {[t.numel() for t in tensors]} elements for parameters of "
                             f"{self._numels}")
        self._working, self._working_on_host = list(tensors), on_host
        self.weights_version += 1

    @torch.no_grad()
    def refresh_working(self) -> None:
        """Write every master into its working tensor (after a load or at start; blocks the host)."""
        self.wait_for_writeback()
        for i, weight in enumerate(self._working or ()):
            weight.copy_(self._read_row(ROW["master"], i))
        self.weights_version += 1

    def wait_for_params(self, params) -> None:
        """Make the current stream wait until these parameters' working weights of the last step are
        final (overlap; without it the compute stream waited for every piece at the end of step())."""
        index = {id(p): i for i, p in enumerate(self._params)}
        ranges = [(self._offsets[i], self._offsets[i] + self._numels[i]) for p in params
                  if (i := index.get(id(p))) is not None and self._numels[i]]
        if ranges:
            self._waits.wait_ranges(ranges)

    def host_grad(self, i: int) -> torch.Tensor:
        """Parameter i's flat fp32 gradient in the pinned host buffer (gradients = "stream")."""
        start = self._offsets[i]
        return self._host_grads[start:start + self._numels[i]]

    def mark_grad(self, i: int) -> None:
        """Parameter i has a gradient in `host_grad(i)` for the next step (gradients = "stream")."""
        self._grad_arrived[i] = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._grad_arrived = [False] * len(self._params)
        self.grad_scale = None

    def drop_staged(self) -> None:
        """Forget what stage_ahead copied in (after letting its copies end): the host state is about to change."""
        if self._early is not None:
            self._streams.synchronize()
            self._early = None
        self._staging_armed = False

    def load_state_dict(self, state_dict: dict) -> None:
        self.drop_staged()  # staged from the state this load replaces
        super().load_state_dict(state_dict)
        self.refresh_working()

    # ---- stats and synchronisation ----------------------------------------------------------
    @property
    def host_buffer_bytes(self) -> int:
        """Pinned bytes of the host share's gradient buffer (beyond the [3, N - N_d] state)."""
        return self._host_update.host_bytes

    @property
    def device_state_bytes(self) -> int:
        """Device bytes of the device-resident share's state (moments, bf16 weights' masters)."""
        return self._device_share.bytes

    def wait_for_weights(self) -> None:
        """Make the current stream wait until every working weight of the last step is final
        (overlap: call before anything outside the hooked units reads the weights, e.g. a
        checkpoint save or an evaluation). With weights != "device" the parameters' values are
        the masters: the host waits for their write-back too."""
        self._waits.wait_all()
        if self.weights != "device":
            self.wait_for_writeback()
            for i, mirror in self._mirrors.items():
                mirror.copy_(self._read_row(ROW["master"], i))

    def wait_for_writeback(self) -> None:
        """Block the host until the last step is done: its state back in host memory, its weights
        written, no upload still reading the host state."""
        self._waits.wait_all()
        if self._streams.cuda:
            self._streams.update.synchronize()
        for event in (self._writeback_done, self._host_update and self._host_update.uploaded):
            if event is not None:
                event.synchronize()

    def step_seconds(self) -> float:
        """Seconds from the last step's start to its last write-back, upload or weight refresh
        (waits for them on CUDA); the host's time in step() on CPU."""
        start, done, wall = self._timing
        if start is None or not done:
            return wall
        for end in done:
            end.synchronize()
        return max(start.elapsed_time(end) for end in done) / 1e3

    def exposed_seconds(self) -> float:
        """Seconds the training step waited for the optimizer (what overlap and the device share
        shorten): without overlap, the compute stream's wait from step start to the last weight
        refresh; with overlap, the host's time in step() plus the next forward's stalls at its
        waits, reported for the latest step whose weights have all been waited for (the previous
        one until the next forward has run). Call after the device has caught up."""
        return self._waits.exposed_seconds()

    @property
    def forward_waits(self) -> ForwardWaits:
        """The waits of the latest step (its `log` lists (lane, piece) per wait, for tests)."""
        return self._waits
