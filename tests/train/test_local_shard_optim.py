"""LocalShardAdam / LocalShardAdamW against torch's Adam / AdamW on DTensor parameters: the same bits
for parameters and every state tensor after several steps, the state still DTensors, and no DTensor
among the arguments of the update's kernels; on gloo at 1 and 2 ranks (FSDP-like Shard(0) on a 1-D
mesh, the expert shards' [Replicate, Shard(0)] on a 2-D one), on NCCL at 1 and 2 GPUs (gpu)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mop_train.train.local_shard_optim import LocalShardAdam, LocalShardAdamW, _local_when_aligned
from tests.dist_utils import backend_params, run_distributed, worker_device
from tests.utils import assert_bitwise_equal, dispatched_ops, fresh_seed

SHAPES = [(6, 5), (7,), (4, 3, 2), (1, 9), (10, 10)]  # uneven rows at 2 ranks, one shard empty at 2


def _dtensor_args(calls) -> list[str]:
    return [name for name, args in calls if any(isinstance(a, DTensor) for a in args)]


def _record(fn):
    return [(n, a) for n, a in dispatched_ops(fn) if n.startswith(("_fused_adam", "_foreach_", "addcdiv", "lerp"))]


def _params(mesh, placements, seed, device):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in SHAPES:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=g).to(device), mesh, placements))
        params.append(p)
    return params


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        full = torch.randn(p.shape, generator=g).to(p.to_local().device)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)


def _compare(rank, world, seed):
    device = worker_device()
    meshes = [(init_device_mesh(device.type, (world,)), [Shard(0)])]
    if world == 2:
        meshes.append((init_device_mesh(device.type, (1, 2)), [Replicate(), Shard(0)]))
    implementations = [("fused", dict(fused=True)), ("foreach", dict(foreach=True)), ("for-loop", dict(foreach=False))]
    for mesh, placements in meshes:
        for (torch_cls, ours_cls) in ((torch.optim.AdamW, LocalShardAdamW), (torch.optim.Adam, LocalShardAdam)):
            for impl, flags in implementations:
                for amsgrad in (False, True):
                    where = f"{ours_cls.__name__} {impl} amsgrad={amsgrad} placements={placements}"
                    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, **flags)
                    ref, ours = _params(mesh, placements, seed, device), _params(mesh, placements, seed, device)
                    opt_ref, opt_ours = torch_cls(ref, **kw), ours_cls(ours, **kw)
                    for step in range(3):
                        _grads(ref, seed + 1 + step)
                        _grads(ours, seed + 1 + step)
                        opt_ref.step()
                        if step < 2:
                            opt_ours.step()
                        else:  # the last step watched: its kernels get local tensors only
                            calls = _record(opt_ours.step)
                            assert calls and not _dtensor_args(calls), f"{where}: {_dtensor_args(calls)}"
                    for k, (a, b) in enumerate(zip(ref, ours)):
                        assert_bitwise_equal(b.to_local(), a.to_local(), name=f"{where}: parameter {k}")
                        for key, value in opt_ref.state[a].items():
                            mine = opt_ours.state[b][key]
                            assert type(mine) is type(value), f"{where}: state {key} is {type(mine).__name__}"
                            local = (lambda t: t.to_local() if isinstance(t, DTensor) else t)
                            assert_bitwise_equal(local(mine), local(value), name=f"{where}: {key} of parameter {k}")
    # torch's own class does hand DTensors to the kernels: the check above can fail
    ref = _params(meshes[0][0], meshes[0][1], seed, device)
    opt = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    _grads(ref, seed)
    assert _dtensor_args(_record(opt.step)), "torch's AdamW was expected to dispatch DTensors"
    dist.barrier()


@pytest.mark.parametrize("backend,world_size", backend_params([1, 2]))
def test_local_shard_adam_is_torch_adam_bit_for_bit(backend, world_size):
    run_distributed(_compare, world_size, fresh_seed(), backend=backend)


def _misaligned(rank, world, seed):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    p = distribute_tensor(torch.randn(4, 3, generator=g), mesh, [Shard(0)])
    grad = distribute_tensor(torch.randn(4, 3, generator=g), mesh, [Replicate()])
    params, grads, moments = [p], [grad], [distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])]
    assert not _local_when_aligned(params, [grads, moments, []])
    assert all(isinstance(t, DTensor) for t in (*params, *grads, *moments)), "a misaligned group stays DTensors"
    grads = [distribute_tensor(torch.randn(4, 3, generator=g), mesh, [Shard(0)])]
    assert _local_when_aligned(params, [grads, moments, []])
    assert not any(isinstance(t, DTensor) for t in (*params, *grads, *moments))


def test_a_gradient_off_its_parameter_placements_is_left_to_dtensor():
    run_distributed(_misaligned, 2, fresh_seed())


@pytest.mark.parametrize("backend,world_size", backend_params([], nccl_world_size=1))
def test_local_shard_adam_on_one_gpu(backend, world_size):
    """The one-GPU run's case (W = 1 under NCCL, the fused CUDA kernel)."""
    run_distributed(_compare, world_size, fresh_seed(), backend=backend)
