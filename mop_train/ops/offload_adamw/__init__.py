"""OffloadStreamAdamW: AdamW with fp32 masters and moments in host memory, streamed through the
device in buckets of `bucket_params` over `slots` staging buffers (paper section 3.4, Appendix E.1),
except a device-resident head (`device_fraction`) and a CPU-updated tail (`host_fraction`); with
`overlap` the next forward waits per unit for its own buckets only. With the masters on the host the
device may keep only bf16 working weights (`weights = "bf16"`) or none (`"stream"`: copied in per
block), and gradients may leave as they become final (`gradients = "stream"`), bit for bit the same.

    opt = OffloadStreamAdamW(forward_order(model), lr=3e-4, weight_decay=0.1,
                             bucket_params=25_000_000, slots=3, device_fraction=0.25, overlap=True)
    opt.wait_in_forward(forward_units(model))
    opt.staging_bytes <= staging_bytes_bound(opt.bucket_params, opt.slots)

- optimizer.py:     the optimizer (torch.optim.Optimizer; DCP-checkpointable state_dict).
- checks.py:        the checks of its arguments: options, parameters, param groups (ValueError with the fix).
- state.py:         where each parameter's state lives; state_dict / load_state_dict; master_view, value_tensor.
- bucket_step.py:   the step's device side: the head's and the streamed buckets, gradients in, weights out.
- buckets.py:       flat layout, bucket plan, staging_bytes_bound (the device memory bound).
- device_share.py:  the device-resident head; fit_device_fraction (device_fraction = "auto").
- host_update.py:   the tail updated on the CPU while the rest streams (host_fraction).
- forward_waits.py: forward order, per-piece ready events and the forward's waits (overlap).
- update.py:        torch's fused AdamW over tensor pieces, one call per param group (every path).
- reference.py:     the plain AdamW math / torch.optim.AdamW oracle.
- working.py:       weights = "bf16" | "stream": parameters' values become their masters, separate working
                    weights (FSDP2's all-gather source, the expert/vocab shards' WorkingWeight).
- weight_windows.py: weights = "stream": each block copied in one block ahead into weight_window slots.
- working_weight.py: the autograd seam of a shard kept out of FSDP2 (fp32 gradients, as a cast's).
- grad_stream.py:   gradients = "stream": each final gradient to the pinned host buffer, norm terms as it leaves.
- link.py:          each step's host-link bytes per source (optimizer, weight windows, gradients): `link_bytes()`;
                    OffloadStepStats (`last_step`).
- memory.py:        device bounds the plan sums: staging and share, weights_bound, gradients_bound.
Legend: N local elements, N_d device-resident, B bucket capacity (elements), s slots.
"""

from mop_train.ops.offload_adamw import host_update
from mop_train.ops.offload_adamw.buckets import host_state_bytes, plan_buckets, staging_bytes_bound
from mop_train.ops.offload_adamw.device_share import (AUTO_MARGIN_BYTES, device_bytes_per_element,
                                                      fit_device_fraction)
from mop_train.ops.offload_adamw.forward_waits import forward_order, forward_units
from mop_train.ops.offload_adamw.link import OffloadStepStats
from mop_train.ops.offload_adamw.optimizer import DEFAULT_BUCKET_PARAMS, DEFAULT_SLOTS, OffloadStreamAdamW
from mop_train.ops.offload_adamw.reference import adamw_reference_step, reference_adamw

OFFLOAD_ADAMW = "OffloadStreamAdamW"
"""The `optimizer.name` that selects this optimizer (its class name)."""

__all__ = ["OFFLOAD_ADAMW", "OffloadStreamAdamW", "OffloadStepStats", "staging_bytes_bound", "host_state_bytes",
           "plan_buckets", "reference_adamw", "adamw_reference_step", "host_update", "fit_device_fraction",
           "device_bytes_per_element", "AUTO_MARGIN_BYTES", "forward_order", "forward_units",
           "DEFAULT_BUCKET_PARAMS", "DEFAULT_SLOTS"]
