"""Working weights apart from the masters ([mop.offload_adamw] weights = "bf16" | "stream").

With OffloadStreamAdamW the fp32 master of every parameter is in its state, yet with weights =
"device" each parameter also keeps an fp32 device tensor that no forward computes with (FSDP2 casts
it to bf16 before the all-gather; the experts and the vocab shard are cast where they are used).
`WorkingWeights` removes that copy:
  - each parameter's value (its DTensor's local tensor) becomes a view of its master (host state, or
    the optimizer's device share), so state dicts, DCP checkpoints and loads see the fp32 masters,
    and a checkpoint holds the same state whatever the setting;
  - the step refreshes separate working tensors from the masters (`OffloadStreamAdamW.use_working`):
      "bf16":   a bf16 device tensor per parameter (2 B instead of 4). For FSDP2's parameters it is
                FSDP2's all-gather source (`FSDPParam._sharded_param_data`, with FSDP2's padding),
                which FSDP2 copies as it would copy its bf16 cast of the fp32 shard;
      "stream": a pinned host tensor per parameter; nothing persists on the device: FSDP2's units
                and the other shards are copied in per block through the windows of
                weight_windows.py (UnitWindow, ShardWindow; `weight_window` slots each);
  - the shards kept out of FSDP2 are computed with through `weight(param, dtype)` (the model's
    `weight_source` seams: GroupedExperts, LanguageModelLoss), a `WorkingWeight` whose backward hands
    an fp32 gradient to the parameter, as the device path's cast does.
The bits are those of weights = "device": the forward computes with bf16(master) either way, and
gradients are formed and reduced by the same kernels.
Model: FSDP2 (`_sharded_param_data` is where FSDP2 itself and its CPUOffloadPolicy keep the all-gather
source); ZeRO-Infinity and the OOM competitor (shared/reference/oom-offload-moe-paper.txt) stream
bf16 working weights per layer the same way.
Legend: N local elements, s_w window slots.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mop_train.ops.offload_adamw.buckets import allocate_host_buffer, release_when_idle
from mop_train.ops.offload_adamw.master_state_dict import serve_masters
from mop_train.ops.offload_adamw.weight_windows import ShardWindow, UnitWindow
from mop_train.ops.offload_adamw.working_weight import WorkingWeight

MODES = ("bf16", "stream")


def fsdp_param_groups(roots) -> list:
    """Every FSDPParamGroup under `roots` (FSDP2 units with parameters), in module order."""
    groups = []
    for root in roots:
        for module in root.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            group = get_state()._fsdp_param_group if get_state is not None else None
            if group is not None and group not in groups:
                groups.append(group)
    return groups


class WorkingWeights:
    """Rewires one OffloadStreamAdamW's parameters for weights = "bf16" / "stream" (module docstring).

    Args:
        opt: the optimizer (built with the same `weights`), over DTensor parameters only.
        roots: the FSDP2 root modules of those parameters.
        mode: "bf16" or "stream".
        dtype: the working dtype (the run's compute dtype, `param_dtype`; bf16 for "bf16").
        blocks: the shards kept out of FSDP2 as [(params, checkpointed)] in forward order (one MoE
            layer's w1, w2, w3; the vocab shard); "stream" needs checkpointed blocks, except for a
            block whose weight is asked for in another dtype (it is copied at once).
        window: slots per window (s_w, "stream").
        one_off_units: modules whose FSDP2 units the unit window's slots are not sized for ("stream":
            the token embedding and the head, gathered once a step; the root's own unit never is).
    """

    def __init__(self, opt, roots, *, mode: str, dtype: torch.dtype, blocks=(), window: int = 2,
                 one_off_units=()):
        if mode not in MODES:
            raise ValueError(f"weights ({mode!r}) must be one of {MODES} here; 'device' needs no WorkingWeights")
        if opt.weights != mode:
            raise ValueError(f"the optimizer was built with weights = {opt.weights!r}, not {mode!r}")
        if mode == "bf16" and dtype != torch.bfloat16:
            raise ValueError(f"weights = 'bf16' needs bf16 compute (training.mixed_precision_param = "
                             f"\"bfloat16\"), got {dtype}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"weight_window ({window!r}) must be an int >= 1 (2 prefetches one block ahead); "
                             "set [mop.offload_adamw] weight_window")
        self.opt, self.mode, self.dtype = opt, mode, dtype
        for root in roots:  # FSDP2 re-pads and re-points its sharded data at lazy init: let it do so first
            get_state = getattr(root, "_get_fsdp_state", None)
            if get_state is not None:
                get_state()._lazy_init()
        groups = fsdp_param_groups(roots)
        self._fsdp = {id(fp.sharded_param): (fp, group) for group in groups for fp in group.fsdp_params}
        self._index = {id(p): i for i, p in enumerate(opt._params)}
        caps = [self._capacity(i, p) for i, p in enumerate(opt._params)]
        self._storage, padded = self._allocate(caps, opt.device, stream=mode == "stream")
        self.views = [t[:n] for t, n in zip(padded, opt._numels)]  # flat working tensor per parameter
        self._adopt(padded)
        serve_masters(roots, set(self._index))  # state dicts see the masters, on their own device
        opt.use_working(self.views, on_host=mode == "stream")
        opt.refresh_working()
        self._managed = {id(p) for params, _ in blocks for p in params}
        self.units = self.shards = None
        if mode == "stream":
            wait = opt.wait_for_params
            units = [(g, self._unit_entries(g, padded)) for g in groups]
            root = roots[0]._get_fsdp_state()._fsdp_param_group if hasattr(roots[0], "_get_fsdp_state") else None
            apart = [g for g in [root, *fsdp_param_groups(one_off_units)] if g is not None]
            self.units = UnitWindow([u for u in units if u[1]], padded, window, dtype, opt.device, wait,
                                    link=opt.link, one_off=apart)
            self.shards = ShardWindow(blocks, self._index, self.views, window, dtype, opt.device, wait,
                                      version=lambda: opt.weights_version, link=opt.link)

    def _capacity(self, i: int, p) -> int:
        if not isinstance(p, DTensor):
            raise ValueError(f"weights = {self.mode!r} needs DTensor parameters (FSDP2 units or MoP shards); "
                             f"parameter {i} is a plain {type(p).__name__}; use weights = 'device'")
        if id(p) in self._fsdp:
            return self._fsdp[id(p)][0]._sharded_param_data.numel()  # FSDP2's padded shard
        return self.opt._numels[i]

    def _allocate(self, caps, device, *, stream: bool):
        """One flat buffer of the working dtype (pinned host for "stream", device for "bf16"),
        zeroed (FSDP2's padding is gathered but never read), cut per parameter."""
        total = sum(caps)
        if stream:
            pin = device.type == "cuda"
            raw, registered = allocate_host_buffer(total * torch.finfo(self.dtype).bits // 8, pin)
            if registered:
                weakref.finalize(self, release_when_idle, raw.data_ptr(), self.opt._streams)
            flat = raw.view(self.dtype)
        else:
            flat = torch.empty(total, dtype=self.dtype, device=device)
        flat.zero_()
        return flat, list(torch.split(flat, caps))

    @torch.no_grad()
    def _adopt(self, padded) -> None:
        """Each parameter's value becomes its master; FSDP2 gathers from the working tensor. The
        parameters' previous device tensors are no longer referenced (freed)."""
        for i, p in enumerate(self.opt._params):
            shape = p._local_tensor.shape
            p._local_tensor = self.opt.value_tensor(i).view(shape)
            if id(p) in self._fsdp:
                fsdp_param, _ = self._fsdp[id(p)]
                fsdp_param._sharded_param_data = padded[i]
                fsdp_param._post_load_hook_handle.remove()  # it would re-point the data at the master

    def _unit_entries(self, group, padded):
        entries, offset = [], 0
        for fp in group.fsdp_params:
            i = self._index.get(id(fp.sharded_param))
            if i is not None:
                entries.append((fp, i, offset, padded[i].numel()))
                offset += padded[i].numel()
        return entries

    def weight(self, param, dtype: torch.dtype):
        """The compute weight of a shard kept out of FSDP2, or None for a parameter not managed here."""
        if id(param) not in self._managed:
            return None
        if self.shards is not None:
            return self.shards.weight(param, dtype)
        i = self._index[id(param)]
        return WorkingWeight.apply(param, self.views[i].view(param._local_tensor.shape), dtype, None)

    def device_bytes(self) -> int:
        """Device bytes of the working weights: the bf16 tensors, or the two windows' slots."""
        if self.mode == "bf16":
            return self._storage.numel() * self._storage.element_size()
        return self.units._slots.device_bytes() + self.shards._slots.device_bytes()


def bind_weight_sources(modules: list[nn.Module], working: WorkingWeights) -> None:
    """Point the model's `weight_source` seams (modules with that attribute) at `working.weight`."""
    for module in modules:
        if hasattr(module, "weight_source"):
            module.weight_source = working.weight
