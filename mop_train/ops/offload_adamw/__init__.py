"""OffloadStreamAdamW: AdamW with fp32 masters and moments in host memory, streamed through the
device in buckets of `bucket_params` over `slots` staging buffers (paper section 3.4, Appendix E.1).

    opt = OffloadStreamAdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                             bucket_params=100_000_000, slots=2)
    opt.staging_bytes <= staging_bytes_bound(opt.bucket_params, opt.slots)

- optimizer.py: the optimizer (torch.optim.Optimizer; DCP-checkpointable state_dict).
- buckets.py:   flat host layout, bucket plan, staging_bytes_bound (the device memory bound).
- host_update.py: the tail fraction updated on the CPU while the rest streams (host_fraction).
- update.py:    torch's fused AdamW over tensor pieces, one call per param group (both paths).
- reference.py: the plain AdamW math / torch.optim.AdamW oracle.
Legend: N local elements, B bucket capacity (elements), s slots.
"""

from mop_train.ops.offload_adamw import host_update
from mop_train.ops.offload_adamw.buckets import host_state_bytes, plan_buckets, staging_bytes_bound
from mop_train.ops.offload_adamw.optimizer import OffloadStepStats, OffloadStreamAdamW
from mop_train.ops.offload_adamw.reference import adamw_reference_step, reference_adamw

__all__ = ["OffloadStreamAdamW", "OffloadStepStats", "staging_bytes_bound", "host_state_bytes",
           "plan_buckets", "reference_adamw", "adamw_reference_step", "host_update"]
