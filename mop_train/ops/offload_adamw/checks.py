"""The checks of OffloadStreamAdamW's arguments, made where they are given: the constructor's options
(`check_options`; `resize_staging` re-checks its own), its parameters (`check_params`: one device,
contiguous fp32 / bf16 / fp16 tensors) and each param group's hyperparameters (`check_group`, on
construction and on load_state_dict). Each raises ValueError with the value and the fix.
"""

from __future__ import annotations

import torch

from mop_train.ops.offload_adamw.buckets import PIECE_ALIGN
from mop_train.ops.offload_adamw.memory import GRADIENTS, WEIGHTS


def check_options(*, bucket_params, slots, piece_align, weights, gradients, host_fraction, device_fraction,
                  overlap, stage_in_backward=False) -> None:
    """The constructor's options, in the order it takes them (the first bad one raises)."""
    check_staging(bucket_params, slots)
    if isinstance(piece_align, bool) or not isinstance(piece_align, int) or piece_align < 1:
        raise ValueError(f"piece_align ({piece_align!r}) must be an int >= 1 (elements; default {PIECE_ALIGN})")
    check_modes(weights, gradients, host_fraction)
    check_host_fraction(host_fraction)
    check_fraction("device_fraction", device_fraction, "the share of the optimizer state kept on the "
                   "device (0 streams everything; \"auto\" is resolved by fit_device_fraction)")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap ({overlap!r}) must be true or false; set [mop.offload_adamw] overlap")
    if not isinstance(stage_in_backward, bool):
        raise ValueError(f"stage_in_backward ({stage_in_backward!r}) must be true or false; set "
                         "[mop.offload_adamw] stage_in_backward")


def check_staging(bucket_params, slots) -> None:
    if isinstance(bucket_params, bool) or not isinstance(bucket_params, int) or bucket_params < 1:
        raise ValueError(f"bucket_params ({bucket_params!r}) must be an int >= 1, e.g. 25_000_000; "
                         "set [mop.offload_adamw] bucket_params")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots ({slots!r}) must be an int >= 1 (2 overlaps copies with the update); "
                         "set [mop.offload_adamw] slots")


def check_modes(weights, gradients, host_fraction) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights ({weights!r}) must be one of {WEIGHTS}; set [mop.offload_adamw] weights")
    if gradients not in GRADIENTS:
        raise ValueError(f"gradients ({gradients!r}) must be one of {GRADIENTS}; set [mop.offload_adamw] gradients")


def check_host_fraction(host_fraction) -> None:
    check_fraction("host_fraction", host_fraction, "the share of the streamed parameters updated on the "
                   "CPU (0 streams everything through the device)")


def check_fraction(name: str, value, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} ({value!r}) must be a number in [0, 1]: {meaning}; "
                         f"set [mop.offload_adamw] {name}")


def check_params(shards: list[torch.Tensor], param_devices: list[torch.device], *,
                 host_values: bool) -> torch.device:
    """The device the optimizer works on: its parameters'. With weights != "device" a parameter's
    local shard may already hold its value on the host (a DTensor on a CUDA mesh whose local tensor
    is in host memory: [mop.offload_adamw] host_init) while its gradients form on the device."""
    devices = set(param_devices) if host_values else {t.device for t in shards}
    if len(devices) != 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}; "
                         "build one optimizer per device")
    device = next(iter(devices))
    stray = {str(t.device) for t in shards if t.device != device and t.device.type != "cpu"}
    if stray:
        raise ValueError(f"parameters of a {device} optimizer hold their values on {sorted(stray)}; "
                         "build one optimizer per device")
    for t in shards:
        if not t.is_floating_point() or not t.is_contiguous():
            raise ValueError(f"parameters must be contiguous floating-point tensors, got "
                             f"{t.dtype} {tuple(t.shape)} with strides {t.stride()}; "
                             "make the parameter's data contiguous before building the optimizer")
        # The masters and moments are fp32 (the host layout, the fused update): an fp64 parameter
        # would be updated in fp32 and rounded back, silently off torch.optim.AdamW's fp64 update
        # by ~1e-7 relative per step (seen: 2e-7 after 3 steps). Refuse it rather than lose precision.
        if t.itemsize > 4:
            raise ValueError(f"parameters must be fp32, bf16 or fp16 (OffloadStreamAdamW keeps fp32 masters "
                             f"and moments), got {t.dtype} {tuple(t.shape)}; cast the model to fp32 or use "
                             "torch.optim.AdamW for fp64 parameters")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"parameters on {device} are not supported; use cuda or cpu")
    return device


def check_group(group: dict) -> None:
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not float(lr) >= 0.0:
        raise ValueError(f"lr ({lr}) must be >= 0")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"betas ({betas}) must be two numbers in [0, 1), e.g. (0.9, 0.95)")
    if not float(eps) >= 0.0:
        raise ValueError(f"eps ({eps}) must be >= 0")
    if not float(wd) >= 0.0:
        raise ValueError(f"weight_decay ({wd}) must be >= 0")
    for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(f"{flag}=True is not supported by OffloadStreamAdamW; drop it")
