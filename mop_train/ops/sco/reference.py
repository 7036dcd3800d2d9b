"""Plain non-reentrant activation checkpointing of one layer: what SCO replaces, and its oracle.

`checkpointed(layer)` returns a module whose forward runs `layer` under
torch.utils.checkpoint.checkpoint(use_reentrant=False): only the layer's inputs are kept from
forward to backward (the checkpoint boundary), everything inside is recomputed in backward.
The wrapper keeps the wrapped module's parameter names (torch's ActivationWrapper strips its
`_checkpoint_wrapped_module.` prefix), so state dicts and DCP checkpoints are the same with or
without it, as with torchtitan's activation checkpointing.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils.checkpoint import checkpoint


class CheckpointedLayer(ActivationWrapper):
    """`layer(*args, **kwargs)` under non-reentrant checkpointing (the wrapper adds no parameters).

    preserve_rng_state: replay the forward's RNG state in the recompute (needed for dropout).
    """

    def __init__(self, layer: nn.Module, preserve_rng_state: bool = True):
        super().__init__(layer)
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args, **kwargs):
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


def checkpointed(layer: nn.Module, preserve_rng_state: bool = True) -> CheckpointedLayer:
    """Wrap `layer` in plain non-reentrant activation checkpointing."""
    return CheckpointedLayer(layer, preserve_rng_state)
