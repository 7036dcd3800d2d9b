"""offload_adamw.master_state_dict: a module whose parameter's value is a master on another device
than the parameter's DTensor (weights = "bf16" | "stream" on a GPU: wrapper on cuda, master on the
host) saves the master itself, and its own parameter object is back afterwards, also when the save fails.
CPU has one real device, so the wrapper is put on "meta" and the master on "cpu": the same mismatch,
which plain `state_dict()` refuses exactly as on the GPU (checked first, so the mirror is faithful)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mop_train.ops.offload_adamw.master_state_dict import serve_masters
from tests.dist_utils import run_distributed
from tests.utils import fresh_seed


def _mismatched(mesh, shape, gen) -> tuple[nn.Parameter, torch.Tensor]:
    param = nn.Parameter(distribute_tensor(torch.empty(shape, device="meta"), mesh, [Shard(0)]))
    master = torch.randn(shape, generator=gen)
    param._local_tensor = master  # what WorkingWeights._adopt does: the value is the master's view
    return param, master


def _worker(rank, world, seed):
    gen = torch.Generator().manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    weight, master = _mismatched(mesh, (4, 3), gen)
    model[0].weight = weight
    model[0].bias = nn.Parameter(distribute_tensor(torch.randn(4, generator=gen), mesh, [Shard(0)]))
    with pytest.raises(RuntimeError, match="different device"):
        model.state_dict()  # the GPU's failure, mirrored

    assert serve_masters([model], {id(weight)}) == 1  # only the module owning an adopted parameter
    assert serve_masters([model], {id(weight)}) == 0  # and never twice
    for _ in range(2):
        sd = model.state_dict()
        entry = sd["0.weight"]
        assert isinstance(entry, DTensor) and entry._local_tensor.data_ptr() == master.data_ptr()
        assert entry.device == master.device and entry.placements == weight.placements and entry.shape == weight.shape
        assert torch.equal(entry.to_local(), master) and not entry.requires_grad
        assert model[0].weight is weight and model[0]._parameters["weight"] is weight
        assert torch.equal(sd["0.bias"].to_local(), model[0].bias.to_local()) and "1.weight" in sd
        master.add_(1.0)  # the next save sees the master as it is now (the optimizer updates it in place)

    other, _ = _mismatched(mesh, (4, 3), gen)
    broken = nn.Linear(3, 4, bias=False)
    broken.weight = other

    def failing_save(destination, prefix, keep_vars):
        assert broken._parameters["weight"] is not other  # the master's stand-in is in place during the save
        raise OSError("disk full")

    broken._save_to_state_dict = failing_save
    serve_masters([broken], {id(other)})
    with pytest.raises(OSError, match="disk full"):
        broken.state_dict()
    assert broken._parameters["weight"] is other  # put back although the save failed
    dist.barrier()


def test_state_dict_holds_the_masters_on_their_device():
    run_distributed(_worker, 1, fresh_seed())
