"""The head of the flat state that stays on the device (device_fraction d), and the share that fits.

The first N_d elements of the flat space (round(d * N), moved back to a lane boundary of the parameter
holding it: buckets.device_cut; flat order = the order the forward consumes the parameters, see
forward_waits.forward_order) keep their AdamW state in device memory and update
there with no transfer: one fused AdamW per bucket-sized piece, nothing streamed. fp32 working
weights are their own masters (AdamW updates them in place: the master is 4 bytes the device already
holds), so a device-resident element costs 8 bytes (both moments); bf16 working weights also need an
fp32 master, 12 bytes. A parameter may straddle N_d: its head is here, its tail on the host.

Why the head: the forward consumes the flat order from the front (the FSDP2 units: the embedding, block 0, 1,
...), so a resident head lets it start at once while the streamed tail is still in flight, and the
last streamed bucket has the whole forward to arrive (exposed ~ T_stream - T_forward). A resident
tail would make the forward wait for the first streamed bucket and leave the stream only the
forward's time up to the tail (exposed ~ T_stream - (1 - d) T_forward).

Legend: N local elements, N_d device-resident elements, d device fraction, B bucket capacity, s slots.
"""

from __future__ import annotations

import torch

from mop_train.ops.offload_adamw.buckets import FP32_BYTES, HOST_CHUNK, param_offsets, staging_bytes_bound

AUTO_MARGIN_BYTES = 2 * 2**30
"""Device bytes `fit_device_fraction` leaves unused: the plan is an estimate (allocator rounding and
fragmentation, communication buffers, CUDA context growth are not in it)."""


def device_bytes_per_element(fp32_weights: bool) -> int:
    """Device bytes of one device-resident element: both moments, plus an fp32 master unless the
    working weight is itself fp32."""
    return (2 if fp32_weights else 3) * FP32_BYTES


def fit_device_fraction(free_bytes: int, local_numel: int, *, fp32_weights: bool, bucket_params: int,
                        slots: int, host_share: bool = False, margin_bytes: int = AUTO_MARGIN_BYTES) -> float:
    """The largest device_fraction whose device state fits in `free_bytes` (device_fraction = "auto").

    Args:
        free_bytes: device bytes the rest of the plan leaves free on this rank (device memory minus
            the planner's estimate of parameters, gradients, activations, ...).
        local_numel: N, this rank's parameter elements (local shards).
        fp32_weights: the working weights are fp32 (8 B per resident element, else 12).
        bucket_params, slots: the streamed part's staging (s*B*12 + B*4 bytes, needed unless d = 1).
        host_share: a CPU-updated share is on (adds its two cast temporaries).
        margin_bytes: left unused (default AUTO_MARGIN_BYTES, 2 GiB).
    Returns d in [0, 1], rounded down to 1/1000 (1.0 when everything fits with the bucket's
    gradient buffer alone).
    """
    if local_numel <= 0:
        return 1.0
    per = device_bytes_per_element(fp32_weights)
    usable = free_bytes - margin_bytes
    if usable >= per * local_numel + min(bucket_params, local_numel) * FP32_BYTES:
        return 1.0  # all resident: no slots, only the fp32 gradient buffer of one bucket
    usable -= staging_bytes_bound(bucket_params, slots) + (2 * HOST_CHUNK * FP32_BYTES if host_share else 0)
    share = usable / (per * local_numel)
    return min(max(int(share * 1000) / 1000, 0.0), 1.0)


class DeviceShare:
    """Moments (and non-fp32 parameters' masters) of the flat range [0, end) in device memory.

    moments: [2, end] fp32 (exp_avg, exp_avg_sq) indexed by flat position; masters: fp32 heads of
    the parameters whose working weights are not fp32 (of every parameter without `alias_fp32`,
    where the working weights are separate tensors: weights = "bf16" / "stream"), packed in flat order."""

    def __init__(self, numels: list[int], dtypes: list[torch.dtype], end: int, device: torch.device,
                 alias_fp32: bool = True):
        self.end = end
        self.moments = torch.zeros(2, end, dtype=torch.float32, device=device)  # [2, N_d]
        self._master_at: dict[int, int] = {}
        size = 0
        for i, (start, numel) in enumerate(zip(param_offsets(numels), numels)):
            head = min(numel, max(end - start, 0))  # the parameter's elements on the device
            if head and (dtypes[i] != torch.float32 or not alias_fp32):
                self._master_at[i] = size
                size += head
        self.masters = torch.empty(size, dtype=torch.float32, device=device)  # [sum of bf16 heads]
        self.bytes = (self.moments.numel() + self.masters.numel()) * FP32_BYTES

    def aliased(self, param: int) -> bool:
        """The working weight is its own master (fp32)."""
        return param not in self._master_at

    def rows(self, param: int, param_start: int, flat: int, numel: int, work) -> tuple[torch.Tensor, ...]:
        """(master, exp_avg, exp_avg_sq) of elements [param_start, +numel) of `param`, which sit at
        flat position `flat`; `work[param]` is the flat working weight."""
        if self.aliased(param):
            master = work[param][param_start:param_start + numel]
        else:
            at = self._master_at[param] + param_start
            master = self.masters[at:at + numel]
        return master, self.moments[0, flat:flat + numel], self.moments[1, flat:flat + numel]
