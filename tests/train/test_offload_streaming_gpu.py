"""[mop.offload_adamw] weights / gradients on one CUDA device, through the loop's `train_step` (issue 32
item 5): a 4-block debug model (3 MoE blocks; bf16 compute, 2 micro-batches per step, every block
checkpointed, experts kept out of FSDP2, weight_window 2) trains 3 steps with stream/stream,
stream/device, bf16/device, device/stream and stream/stream with the optimizer overlapped with the next
forward (`overlap`), and each is bitwise device/device (losses, gradient
norms, final fp32 parameters; a second device/device run first shows the reference repeats itself).

While the steps run (not during start-up), a probe checks:
  - no host synchronisation in our streaming code: OffloadStreamAdamW.step, the windows' loads, waits
    and releases (UnitWindow._load, ShardWindow.weight / _backward_done, _Slots.wait_loaded / release)
    and the gradient stream's hooks (GradientStream._arrived, begin_micro_batch, end_backward) run
    under torch.cuda.set_sync_debug_mode("error") (the model's own MoE dispatch reads its counts on
    the host, so the whole forward cannot);
  - every host <-> device copy those make (Tensor.copy_ across devices, recorded) is non_blocking,
    from or into pinned memory, on one of their own side streams (never the compute stream or
    FSDP2's), and the copies' bytes are the step's link account (`link_bytes()`, less the 4 B step
    counts the optimizer uploads with `.to`); the optimizer state, the streamed gradients' buffer
    and the working weights' host copy are pinned;
  - the prefetch runs one block ahead: in each forward, FSDP2 unit i+1's load is issued before unit
    i's forward ends, and MoE block b+1's before block b's last weight request; in each backward
    (recompute included), unit i-1's load before unit i's gradients are reduced, and an expert
    block loaded there is a prefetch issued before the following block's last request; per
    micro-batch FSDP2 loads every unit in the forward and blocks 0..L-2 once in backward (the
    recompute reuses the unit gathered for backward); no window overflows.
One process (NCCL at W=1); about 40 s on an H200 (passed there 2026-12-01 and 2026-12-02). Failures of every
run are collected and reported together.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
from dataclasses import replace

import pytest
import torch

from tests.dist_utils import requires_gpus, run_distributed, worker_device

pytestmark = [pytest.mark.gpu, requires_gpus(1)]
STEPS, N_LAYERS, M = 3, 4, 2
RUNS = {"reference": ("device", "device"), "control": ("device", "device"), "stream-stream": ("stream", "stream"),
        "stream-device": ("stream", "device"), "bf16-device": ("bf16", "device"), "device-stream": ("device", "stream"),
        # the optimizer's buckets still in flight while the next forward runs (and allocates): the
        # clipping coefficient they read must outlive zero_grad (found at 2 x 4K on `small`, 2026-12-01)
        "stream-stream-overlap": ("stream", "stream", "--mop.offload_adamw.overlap")}


class _Probe:
    """Strict (sync debug "error") wrappers around our streaming code, a recorder of cross-device
    copies and an event log, armed only inside `step(...)`."""

    def __init__(self):
        self.armed, self.depth, self.lock = False, 0, threading.Lock()
        self.events, self.copies, self.entries = [], [], {}
        self.ours: set[int] = set()

    # ---- install (before anything is built) -------------------------------------------------
    def install(self) -> None:
        from mop_train.ops.offload_adamw import OffloadStreamAdamW
        from mop_train.ops.offload_adamw.grad_stream import GradientStream
        from mop_train.ops.offload_adamw.weight_windows import ShardWindow, UnitWindow, _Slots
        for cls, name in ((OffloadStreamAdamW, "step"), (UnitWindow, "_load"), (ShardWindow, "weight"),
                          (ShardWindow, "_backward_done"), (_Slots, "wait_loaded"), (_Slots, "release"),
                          (GradientStream, "_arrived"), (GradientStream, "begin_micro_batch"),
                          (GradientStream, "end_backward")):
            setattr(cls, name, self._strict(getattr(cls, name), f"{cls.__name__}.{name}"))
        self._log_calls(UnitWindow, ShardWindow)
        original = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            if self.armed and isinstance(src, torch.Tensor) and dst.device.type != src.device.type:
                self._record(dst, src, non_blocking)
            return original(dst, src, non_blocking)
        torch.Tensor.copy_ = copy_

    def _strict(self, fn, name):
        @functools.wraps(fn)
        def strict(*args, **kwargs):
            if not self.armed:
                return fn(*args, **kwargs)
            with self.lock:
                self.entries[name] = self.entries.get(name, 0) + 1
                self.depth += 1
                if self.depth == 1:
                    gc.disable()  # (a finalizer run inside would synchronize streams)
                    torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.depth -= 1
                    if self.depth == 0:
                        torch.cuda.set_sync_debug_mode("default")
                        gc.enable()
        return strict

    def _log_calls(self, UnitWindow, ShardWindow) -> None:
        from mop_train.ops.offload_adamw.working_weight import in_backward
        unit_load, shard_load, weight = UnitWindow._load, ShardWindow._load, ShardWindow.weight

        def logged_unit_load(window, group, entries, async_op):
            self._event("unit-load", getattr(group, "_module_fqn", "") or "")
            return unit_load(window, group, entries, async_op)

        def logged_shard_load(window, b, backward, prefetch=False):
            k = shard_load(window, b, backward, prefetch)
            if k is not None:
                self._event("shard-load", b, prefetch)
            return k

        def logged_weight(window, param, dtype):
            self._event("shard-use", window._where[id(param)][0])
            return weight(window, param, dtype)
        UnitWindow._load, ShardWindow._load = logged_unit_load, logged_shard_load
        ShardWindow.weight = functools.wraps(weight)(logged_weight)
        self._in_backward = in_backward

    def _event(self, *what) -> None:
        if self.armed:
            self.events.append((*what, self._in_backward()))

    def _record(self, dst, src, non_blocking) -> None:
        host = src if dst.is_cuda else dst
        stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).cuda_stream
        self.copies.append({"h2d": dst.is_cuda, "bytes": host.numel() * host.element_size(), "pinned": host.is_pinned(),
                            "non_blocking": bool(non_blocking), "ours": stream in self.ours, "strict": self.depth > 0,
                            "shape": tuple(host.shape)})

    # ---- per run, per step --------------------------------------------------------------------
    def watch(self, run) -> None:
        """Our side streams, and hooks that log each block's forward end and gradients."""
        opt = self.opt = run.optimizers.optimizers[0]
        streams = [getattr(opt._streams, n) for n in ("update", "h2d", "d2h", "down", "up")]
        stream, working = getattr(opt, "grad_stream", None), getattr(opt, "working", None)  # (device/device: unset)
        if stream is not None:
            streams += [stream.h2d, stream.d2h]
        if working is not None and working.units is not None:
            streams += [working.units._slots.h2d, working.shards._slots.h2d]
        self.ours = {s.cuda_stream for s in streams}
        for i, block in enumerate(run.parts.model.layers.values()):
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            inner.register_forward_hook(lambda *_, i=i: self._event("block-end", i))
            expert = {id(p) for p in run.parts.expert_params}
            for p in block.parameters():
                if id(p) not in expert:  # FSDP2 calls these after the unit's reduce-scatter
                    p.register_post_accumulate_grad_hook(lambda _, i=i: self._event("grad", i))

    def step(self, records):
        probe = self

        class _Armed:
            def __enter__(self):
                probe.events, probe.copies, probe.entries = [], [], {}
                probe.armed = True

            def __exit__(self, *exc):
                probe.armed = False
                records.append((probe.events, probe.copies, probe.entries, probe.opt.link_bytes()))
                return False
        return lambda step: _Armed()


def _passes(events):
    """The step's events cut into passes: [forward 1, backward 1, forward 2, backward 2]."""
    passes = []
    for event in events:
        if not passes or passes[-1][0][-1] != event[-1]:
            passes.append([])
        passes[-1].append(event)
    return passes


def _index(events, *what, last=False):
    hits = [k for k, e in enumerate(events) if e[:len(what)] == what]
    assert hits, f"no {what} in {events}"
    return hits[-1] if last else hits[0]


def _check_prefetch(events, name, step):
    passes = _passes(events)
    assert [p[0][-1] for p in passes] == [False, True] * M, f"{name} step {step}: passes {passes}"
    for k, events in enumerate(passes):
        where = f"{name} step {step} pass {k}"
        units = [e[1] for e in events if e[0] == "unit-load"]
        shard_loads = [e for e in events if e[0] == "shard-load"]
        if not events[0][-1]:  # forward
            # torchtitan's units: the embedding, each block, then the head [final norm, output projection].
            assert units == ["model.tok_embeddings", *(f"model.layers.{i}" for i in range(N_LAYERS)),
                             "model.norm, model.output"], f"{where}: {units}"
            for i in range(N_LAYERS - 1):
                assert _index(events, "unit-load", f"model.layers.{i + 1}") < _index(events, "block-end", i), where
            for _, b, prefetch, _ in shard_loads:
                if b > 0:
                    assert prefetch and _index(events, "shard-load", b) < _index(events, "shard-use", b - 1, last=True), \
                        f"{where}: expert block {b} was not loaded while block {b - 1} computed: {events}"
        else:
            assert units == [f"model.layers.{i}" for i in range(N_LAYERS - 2, -1, -1)], f"{where}: {units}"
            for i in range(N_LAYERS - 1, 0, -1):
                assert _index(events, "unit-load", f"model.layers.{i - 1}") < _index(events, "grad", i), where
            for _, b, prefetch, _ in shard_loads:
                assert prefetch and _index(events, "shard-load", b) < _index(events, "shard-use", b + 1, last=True), \
                    f"{where}: expert block {b} was not loaded while block {b + 1} computed: {events}"
    assert any(e[0] == "shard-load" for p in passes[1::2] for e in p), f"{name} step {step}: no backward expert load"


def _check_copies(copies, link, n_params, name, step):
    where = f"{name} step {step}"
    ours = [c for c in copies if c["strict"]]
    assert ours, f"{where}: no host <-> device copy recorded"
    for c in ours:
        assert c["non_blocking"] and c["pinned"] and c["ours"], f"{where}: {c}"
    h2d = sum(c["bytes"] for c in ours if c["h2d"])
    d2h = sum(c["bytes"] for c in ours if not c["h2d"])
    assert (h2d + 4 * n_params, d2h) == (link.h2d_total, link.d2h_total), f"{where}: copies {h2d, d2h}, {link}"


def _worker(rank, world, root):
    """Every run, each checked as it ends; failures are collected, so that one GPU session reports
    all of them (a run that raises, e.g. a host sync in "error" mode, is one of them)."""
    import traceback

    from mop_train.models import zoo
    from mop_train.train.build import build_run
    from tests.train.offload_steps import drive, offload_config
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    probe, device, results, keep, failures = _Probe(), worker_device(), {}, [], []
    probe.install()
    args = replace(zoo.get_model_args("debug"), n_layers=N_LAYERS)
    for name, (weights, gradients, *extra) in RUNS.items():
        try:
            cfg = offload_config(os.path.join(root, name), weights=weights, gradients=gradients, window=2,
                                 steps=STEPS, extra=tuple(extra))
            run = build_run(cfg, device, model_args=args)
            keep.append(run)  # (dropped at exit: a finalizer must not run inside a strict region)
            opt = run.optimizers.optimizers[0]
            probe.watch(run)
            records = []
            out = drive(cfg, run, device, STEPS, around_step=probe.step(records))
            opt.wait_for_weights()
            values = [p.to_local().detach().float().cpu().clone() for p in run.parts.module.parameters()]
            results[name] = (torch.stack([torch.stack(o) for o in out]).cpu(), values)
            _check_run(name, weights, gradients, opt, records)
        except Exception as err:  # noqa: BLE001  (reported below, with the others)
            failures.append(f"{name}: {type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}")
    failures += _check_bitwise(results)
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures)


def _check_run(name, weights, gradients, opt, records):
    for step, (events, copies, entries, link) in enumerate(records, start=1):
        assert entries.get("OffloadStreamAdamW.step") == 1, f"{name} step {step}: {entries}"
        if gradients == "stream":
            assert entries.get("GradientStream._arrived", 0) >= M * len(opt._params), f"{name}: {entries}"
        if weights == "stream":
            assert entries.get("UnitWindow._load", 0) and entries.get("ShardWindow.weight", 0), f"{name}: {entries}"
            _check_prefetch(events, name, step)
        _check_copies(copies, link, len(opt._params), name, step)  # (every setting streams the optimizer state)
    assert opt._host.is_pinned(), f"{name}: the optimizer's host state is not pinned"
    if gradients == "stream":
        assert opt._host_grads.is_pinned(), f"{name}: the streamed gradients' host buffer is not pinned"
    if weights == "stream":
        working = opt.working
        assert working._storage.is_pinned(), f"{name}: the working weights' host copy is not pinned"
        assert all(t.is_pinned() for t in working.units._host) and all(t.is_pinned() for t in working.shards._host)
        assert working.units.stats["overflow"] == 0 and working.shards.stats["overflow"] == 0, name


def _check_bitwise(results) -> list[str]:
    """Each run against the reference: (loss, grad norm) per step and every final parameter."""
    from tests.utils import assert_bitwise_equal
    if "reference" not in results:
        return ["no reference run to compare with"]
    ref_out, ref_values = results["reference"]
    failures = []
    for name, (out, values) in results.items():
        what = "control (device/device itself does not repeat on this GPU)" if name == "control" else name
        try:
            assert_bitwise_equal(out, ref_out, name=f"{what}: (loss, grad norm) per step")
            for i, (a, b) in enumerate(zip(values, ref_values)):
                assert_bitwise_equal(a, b, name=f"{what}: parameter {i}")
        except AssertionError as err:
            failures.append(str(err))
    return failures


def test_streaming_on_one_gpu_is_bitwise_without_host_syncs_and_prefetches(tmp_path):
    run_distributed(_worker, 1, str(tmp_path), backend="nccl", timeout_s=300)
