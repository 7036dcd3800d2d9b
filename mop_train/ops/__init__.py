"""The four memory-bounding operators (and the expert-dispatch seam), each a small package.

- moe_dispatch: `moe_experts_forward` with dispatch = local | ep | llep | pipelined_llep
- ring_dtp:     vocabulary projection + cross-entropy over a ring of vocab shards
- sco:          selective checkpoint offload of checkpoint boundaries to host memory
- offload_adamw: AdamW with host-resident state streamed through the device in buckets
"""
