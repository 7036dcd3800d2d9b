"""The run's mixed-precision policy, one for every parameter: FSDP2's units and the weights kept
out of FSDP2 (expert shards over E_p, the output projection's shard over P).

    precision = MixedPrecision.from_training(cfg.training)   # [training] mixed_precision_param/_reduce
    apply_fsdp(..., param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
    reduce_replica_grads(expert_params, replica_group, reduce_dtype=precision.reduce_dtype)

FSDP2 keeps fp32 sharded masters, all-gathers them as `param_dtype` compute copies for the
forward, and reduces gradients in `reduce_dtype` into fp32 gradients of the masters. Weights
sharded by a MoP group follow the same rules where they are used: the MoE layer casts its expert
shards to the activation dtype (which is `param_dtype`: the activations come out of FSDP2's
units), Ring-DTP casts the projection shard inside its ring and hands dW back in fp32 from its fp32
accumulator; autograd delivers fp32 gradients to the fp32 masters; the sum over the replica group
runs in `reduce_dtype`. The same policy runs on CPU (gloo) and GPU (NCCL): a bf16 run is bf16
everywhere, never silently replaced by fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype    # compute copies of every weight in forward and backward
    reduce_dtype: torch.dtype   # gradient reductions across ranks (FSDP2's and the replica groups')

    @classmethod
    def from_training(cls, training) -> "MixedPrecision":
        """From the `[training]` section (`mixed_precision_param`, `mixed_precision_reduce`)."""
        return cls(param_dtype=_dtype("training.mixed_precision_param", training.mixed_precision_param),
                   reduce_dtype=_dtype("training.mixed_precision_reduce", training.mixed_precision_reduce))

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of an activation (what the memory plan counts)."""
        return torch.finfo(self.param_dtype).bits // 8


def _dtype(key: str, name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"{key} = {name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]
