"""SCO (selective checkpoint offload): checkpoint boundaries to host memory within a byte budget.

    sco = SelectiveCheckpointOffload(resolve_host_budget("24GiB", local_world_size=8), device=dev)
    model.layers[i] = sco.wrap(layer)           # per decoder layer, instead of plain checkpointing
    sco.begin_step(); loss = model(batch); loss.backward()
    sco.last_step_stats()                      # {offloaded_layers, host_bytes, wait_s}

Each wrapped layer runs under non-reentrant activation checkpointing; its input (the checkpoint
boundary) goes to host memory iff it still fits in the step's remaining host budget, walking the
layers in forward order, and comes back one layer ahead of its recompute in backward. Gradients are
bitwise those of plain checkpointing (`reference.checkpointed`). Paper section 3.3.

Legend: N tokens, H hidden, L checkpointed layers, B_l boundary bytes of layer l, S offloaded set.
"""

from mop_train.ops.sco.budget import (AUTO_HOST_FRACTION, available_host_bytes, boundary_bytes,
                                      resolve_host_budget, retained_boundary_bytes, select_offloaded)
from mop_train.ops.sco.offload import OffloadedCheckpoint, SelectiveCheckpointOffload
from mop_train.ops.sco.reference import CheckpointedLayer, checkpointed

__all__ = [
    "AUTO_HOST_FRACTION", "CheckpointedLayer", "OffloadedCheckpoint", "SelectiveCheckpointOffload",
    "available_host_bytes", "boundary_bytes", "checkpointed", "resolve_host_budget",
    "retained_boundary_bytes", "select_offloaded",
]
