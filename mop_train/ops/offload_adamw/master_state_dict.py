"""Module state dicts of the masters when parameters' values live on the host (weights = "bf16" | "stream").

    serve_masters(roots, adopted)   # after WorkingWeights pointed each parameter's value at its master

With working weights apart from the masters, a parameter's DTensor stays on the compute device (its
gradients arrive there: FSDP2's reduce-scatter, the experts' WorkingWeight backward) while its local
tensor is a view of its fp32 master, which is in pinned host memory unless the optimizer's device
share holds it. torch refuses a tensor whose wrapper and storage are on two devices: `param.detach()`,
which `nn.Module._save_to_state_dict` calls for every parameter, raises "Attempted to set the storage
of a tensor on device "cpu" to a storage on different device "cuda:0"" (seen on one H200 at commit
017e763; on CPU both are "cpu", so no CPU run meets it). So every module that owns such a parameter
saves with, in its place, a DTensor over the same master view with the parameter's own sharding
spec, on the master's device: the state-dict entry is the master itself (what FSDP2's own
CPUOffloadPolicy hands DCP: a DTensor whose local shard is on the host), so DCP writes the masters
and loads into them in place. Loading needs nothing here: `_load_from_state_dict`'s `param.copy_`
runs through DTensor's dispatch on the local tensors (no detach), and `refresh_working` then casts
the loaded masters into the working weights. The module's own parameter object is put back in a
`finally`, so a failing save never leaves the module pointing at another object than FSDP2 and the
optimizer do.
Model: FSDP2's CPUOffloadPolicy (sharded DTensor parameters with host local shards, device mesh
unchanged); torch's `Module._save_to_state_dict` protocol (FSDP2's pre-save hook, which registers
the sharded parameters on the module, runs before it).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def master_parameter(param: DTensor) -> nn.Parameter:
    """A parameter over `param`'s local tensor (its master view) with its spec, on that tensor's device."""
    local = param._local_tensor
    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    value = DTensor(local, DTensorSpec(param.device_mesh, param.placements, tensor_meta=meta),
                    requires_grad=False)
    return nn.Parameter(value, requires_grad=param.requires_grad)


def _owned(module: nn.Module, adopted: set[int]) -> list[str]:
    return [name for name, p in module._parameters.items() if p is not None and id(p) in adopted]


def serve_masters(roots, adopted: set[int]) -> int:
    """Make the modules under `roots` that own a parameter in `adopted` (ids) save it as its master
    (module docstring); returns how many modules were set up."""
    count = 0
    for root in roots:
        for module in root.modules():
            if not _owned(module, adopted) or getattr(module, "_mop_saves_masters", False):
                continue

            def save_masters(destination, prefix, keep_vars, *, _module=module, _save=module._save_to_state_dict):
                params = _module._parameters
                held = {name: params[name] for name in _owned(_module, adopted)}  # (FSDP2 may re-register)
                try:
                    for name, param in held.items():
                        params[name] = master_parameter(param)
                    _save(destination, prefix, keep_vars)
                finally:
                    params.update(held)

            module._save_to_state_dict = save_masters
            module._mop_saves_masters = True
            count += 1
    return count
