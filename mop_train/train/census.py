"""A census of live tensor storages, by where each was allocated: the CPU stand-in for a CUDA memory
snapshot, so one rank's device memory can be accounted term by term on a machine without a GPU.

    with StorageCensus() as census:                 # every storage an op makes from here is counted
        run = build_run(cfg, device); train_step(...)
    census.peak_bytes, census.peak_labels            # the largest live total and what made it up
    census.live_bytes(lambda label: "host" in label) # bytes alive now whose label matches

How: a TorchDispatchMode sees every op's outputs (DTensor ops are let through first, so their local
ops are what is counted); a storage not seen before is labelled (the phase the caller set, the
allocating op, the first mop_train and first torch frame on the stack, dtype) and held by a weak
reference whose callback subtracts its bytes when autograd, FSDP2 or Python frees it.
`UntypedStorage.resize_` (FSDP2 allocates and frees its unsharded parameters that way) is patched
while the census runs. At every new peak that exceeds the last recorded one by `resolution` bytes
the per-label totals are copied, so `peak_labels` is the make-up at the peak to that resolution.
Storages made before the census began, or inside a collective's Python stand-in, are not counted.
`fp32_gemms`: CPUs without bf16 matrix units run bf16 GEMMs ~100x slower than fp32 (0.1 against 18
GFLOP/s measured here), so the census can compute bf16 mm/addmm/bmm/baddbmm (and their out= and
in-place forms) in fp32 and hand back bf16: the storages made are the same shapes and dtypes as
the op's own, only the values' rounding differs (a fake world's values are meaningless anyway).
Model taken from: torch.distributed._tools.mem_tracker.MemTracker (the same mode, weak references
and resize_ patch; it labels by module and reference type, where we need the allocating code).

Legend: label = (phase, site, op, dtype).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import defaultdict
from functools import wraps

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.mm.out,
         aten.addmm.out, aten.addmm_.default, aten.bmm.out, aten.baddbmm_.default, aten.baddbmm.out}
_PACKAGE = os.sep + "mop_train" + os.sep
_TORCH = os.sep + "torch" + os.sep
_SKIP = (__file__, os.sep + "torch" + os.sep + "utils" + os.sep, os.sep + "_ops.py", os.sep + "_tensor.py",
         os.sep + "_python_dispatch.py", os.sep + "overrides.py", os.sep + "_compile.py", os.sep + "_dynamo" + os.sep)


def gemm_in_fp32(func, args, kwargs):
    """`func` (one of GEMMS) on fp32 copies of its bf16 tensors; the results (and any tensor it
    writes: out=, in-place) in the dtypes the op itself would give."""
    def up(t):
        return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t
    written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **kwargs)
    fp32 = {k: up(v) for k, v in bound.items()}
    positional = [fp32[n] for n in names[:len(args)]]
    result = func(*positional, **{k: fp32[k] for k in kwargs})
    if written:
        for name in written:
            if fp32[name] is not bound[name]:
                bound[name].copy_(fp32[name])
        return bound[written[0]] if len(written) == 1 else tuple(bound[n] for n in written)
    want = func(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()}).dtype
    return result.to(want)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t


def allocation_site(skip_frames: int = 2) -> str:
    """`file:function` of the first mop_train frame above this call and, after it, of the first torch
    frame (FSDP2, autograd, checkpoint) under it: e.g. "ops/moe_dispatch/llep.py:run_chunks | fsdp/_fsdp_param.py:..."."""
    frame, ours, theirs = sys._getframe(skip_frames), None, None
    while frame is not None and ours is None:
        name = frame.f_code.co_filename
        if not any(s in name for s in _SKIP):
            if _PACKAGE in name:
                ours = f"{name.split(_PACKAGE, 1)[1]}:{frame.f_code.co_name}"
            elif theirs is None and _TORCH in name:
                theirs = f"{name.split(_TORCH, 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return " | ".join(s for s in (ours, theirs) if s) or "autograd engine"


class StorageCensus(TorchDispatchMode):
    """Live storages on `device_type` by label (module docstring). `phase` is set by the caller
    (e.g. "forward", "backward", "optimizer") and becomes part of each new storage's label."""

    def __init__(self, device_type: str = "cpu", resolution: int = 16 * 2**20, fp32_gemms: bool = False):
        super().__init__()
        self.device_type, self.resolution, self.fp32_gemms = device_type, resolution, fp32_gemms
        self.phase = ""
        self.total = self.peak_bytes = self._recorded = 0
        self.by_label: dict[tuple, int] = defaultdict(int)
        self.peak_labels: dict[tuple, int] = {}
        self.peak_phase = ""
        self._live: dict[int, list] = {}          # id(storage) -> [weakref, label, nbytes]
        self._orig_resize = None

    # -- bookkeeping ----------------------------------------------------------------------------
    def _add(self, label: tuple, nbytes: int) -> None:
        self.total += nbytes
        self.by_label[label] += nbytes
        if self.total > self.peak_bytes:
            self.peak_bytes = self.total
            if self.total >= self._recorded + self.resolution or not self.peak_labels:
                self._recorded = self.total
                self.peak_labels = {k: v for k, v in self.by_label.items() if v}
                self.peak_phase = self.phase

    def _freed(self, key: int, _ref=None) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.total -= entry[2]
            self.by_label[entry[1]] -= entry[2]

    def track(self, storage: torch.UntypedStorage, label: tuple) -> None:
        """Count `storage` under `label` until it is freed (once; a storage seen before is skipped)."""
        key = id(storage)
        if key in self._live or storage.device.type != self.device_type:
            return
        nbytes = storage.nbytes()
        self._live[key] = [weakref.ref(storage, lambda ref, key=key: self._freed(key)), label, nbytes]
        self._add(label, nbytes)

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        key, after = id(storage), storage.nbytes()
        entry = self._live.get(key)
        if entry is None:
            if after:
                self.track(storage, (self.phase, allocation_site(3), "resize_", "uint8"))
            return
        self.total -= entry[2]
        self.by_label[entry[1]] -= entry[2]
        entry[2] = after
        self._add(entry[1], after)

    # -- queries --------------------------------------------------------------------------------
    def live_bytes(self, match=None) -> int:
        """Bytes alive now, of the labels for which `match(label)` is true (all without it)."""
        return sum(v for k, v in self.by_label.items() if match is None or match(k))

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (e.g. at a step's start)."""
        self.peak_bytes = self._recorded = self.total
        self.peak_labels = {k: v for k, v in self.by_label.items() if v}
        self.peak_phase = self.phase

    # -- the mode -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if self.fp32_gemms and func in GEMMS and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in tree_flatten((args, kwargs))[0]):
            out = gemm_in_fp32(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        seen = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type == self.device_type}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type == self.device_type:
                st = t.untyped_storage()
                if id(st) not in seen and id(st) not in self._live:
                    seen.add(id(st))
                    self.track(st, (self.phase, allocation_site(), func.__name__, str(t.dtype).removeprefix("torch.")))
        return out

    def __enter__(self):
        census, orig = self, torch.UntypedStorage.resize_
        self._orig_resize = orig

        @wraps(orig)
        def resize_(storage, size):
            before = storage.nbytes()
            result = orig(storage, size)
            census._resized(storage, before)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


def group_labels(labels: dict[tuple, int], key=lambda label: label[1]) -> list[tuple[str, int]]:
    """Totals of `labels` grouped by `key(label)` (the site by default), largest first."""
    out: dict[str, int] = defaultdict(int)
    for label, nbytes in labels.items():
        out[key(label)] += nbytes
    return sorted(out.items(), key=lambda kv: -kv[1])


class StepPhases:
    """Names the census's phase around a training step's parts: "backward" inside Tensor.backward,
    "after backward" until the optimizer, "optimizer" inside each optimizer's step (patched while
    entered; the forward is whatever the caller set before the step)."""

    def __init__(self, census: StorageCensus, optimizers):
        self.census, self.optimizers, self._undo = census, list(optimizers), []

    def _wrap(self, owner, name: str, inside: str, after: str) -> None:
        own = name in vars(owner)               # an instance attribute of its own, or the class's method
        orig, census = getattr(owner, name), self.census

        def wrapped(*a, **k):
            census.phase = inside
            try:
                return orig(*a, **k)
            finally:
                census.phase = after
        setattr(owner, name, wrapped)
        self._undo.append((owner, name, orig if own else None))

    def __enter__(self):
        self._wrap(torch.Tensor, "backward", "backward", "after backward")
        for opt in self.optimizers:
            self._wrap(opt, "step", "optimizer", "after optimizer")
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._undo):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self._undo.clear()
