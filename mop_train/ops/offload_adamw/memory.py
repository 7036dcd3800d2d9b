"""OffloadStreamAdamW's device bytes, in the bound protocol the memory plan sums (mop_train.ops.bound).

During the step the streamed part needs its staging slots (`staging_bytes_bound`: s x B x 12 bytes
plus one bucket's fp32 gradient upcast, and the host share's cast temporaries when it is on); the
device-resident share (`device_fraction` of this rank's elements) keeps its moments, and an fp32
master unless the working weight is itself fp32 (`device_bytes_per_element`), all step.

Legend: N local elements, d device_fraction, B bucket capacity (elements), s slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from mop_train.ops.bound import DeviceBound
from mop_train.ops.offload_adamw.buckets import staging_bytes_bound
from mop_train.ops.offload_adamw.device_share import device_bytes_per_element


@dataclass(frozen=True)
class OffloadSettings:
    """The [mop.offload_adamw] settings that size the device bound (device_fraction resolved)."""
    bucket_params: int
    slots: int
    host_share: bool = False            # host_fraction > 0
    device_fraction: float = 0.0


def device_bound(settings: OffloadSettings, local_params: int, *, fp32_weights: bool) -> DeviceBound:
    """`saved`: the device share's state (all step); `working`: the staging of the streamed part."""
    s = settings
    staging = staging_bytes_bound(s.bucket_params, s.slots, s.host_share)
    per = device_bytes_per_element(fp32_weights=fp32_weights)
    share = round(s.device_fraction * local_params) * per
    return DeviceBound(share, staging, f"OffloadStreamAdamW: staging {s.slots} x {s.bucket_params:,} x 12 B "
                                       f"+ grad buffer, device share {s.device_fraction:g} x {per} B")
