"""OffloadStreamAdamW's weights = "bf16" / "stream" and gradients = "stream" on a small FSDP2 model with
shards kept out of FSDP2 (a replicated DTensor "expert" per block, summed over its replica group),
checkpointed blocks, two micro-batches and clipping: parameters, masters and gradient norms are
bitwise those of device/device, and the mechanics really run (the fp32 device tensors are gone, the
gradients leave the device, the windows load one block ahead and never overflow), with and without a
CPU-updated share (host_fraction; with streamed gradients it reads and clips them in host memory). gloo, 2 ranks;
the same worker on one GPU under set_sync_debug_mode("error") (marked gpu)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from mop_train.ops.offload_adamw import OffloadStreamAdamW, forward_order
from mop_train.ops.offload_adamw.grad_stream import GradBlock, GradientStream
from mop_train.ops.offload_adamw.working import WorkingWeights, bind_weight_sources
from mop_train.parallel.sharding import (clip_coefficient, clip_grads_with_norm_, grad_norm_term, reduce_replica_grad,
                                         reduce_replica_grads, total_grad_norm)
from tests.dist_utils import requires_gpus, run_distributed, worker_device
from tests.utils import assert_bitwise_equal, fresh_seed, no_host_syncs

H, N_BLOCKS, MAX_NORM, STEPS = 12, 3, 0.05, 3
SETTINGS = [("device", "device"), ("device", "stream"), ("bf16", "device"), ("bf16", "stream"),
            ("stream", "device"), ("stream", "stream")]
HOST_FRACTIONS = (0.0, 0.3)  # without and with a CPU-updated share (host_update.py), clipping on in both


class _Block(nn.Module):
    """x + tanh(lin(x)) + x @ w.T, with `w` [H, H] a DTensor kept out of FSDP2 (like an expert shard)."""

    def __init__(self, mesh):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.w = nn.Parameter(DTensor.from_local(torch.randn(H, H) * 0.1, mesh, [Replicate(), Shard(0)],
                                                 run_check=False))
        self.weight_source = None

    def forward(self, x):
        source = self.weight_source
        w = source(self.w, x.dtype) if source is not None else None
        w = self.w.to_local().to(x.dtype) if w is None else w
        return x + torch.tanh(self.lin(x)) + x @ w.t()


class _Model(nn.Module):
    def __init__(self, seed, mesh, expert_mesh, device):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(5, H)
        self.layers = nn.ModuleList([_Block(expert_mesh) for _ in range(N_BLOCKS)])
        self.head = nn.Linear(H, 40)  # the root unit larger than a block (its own one-off buffer)
        self.to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.experts = [block.w for block in self.layers]
        for i, block in enumerate(self.layers):
            self.layers[i] = checkpoint_wrapper(block)
            fully_shard(self.layers[i], mesh=mesh, mp_policy=mp, ignored_params=set(self.experts))
        fully_shard(self, mesh=mesh, mp_policy=mp, ignored_params=set(self.experts))

    def forward(self, x):
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        return self.head(h).float().square().sum()


def _build(weights, gradients, mesh, expert_mesh, device, host_fraction=0.0):
    model = _Model(fresh_seed(5), mesh, expert_mesh, device)
    opt = OffloadStreamAdamW(forward_order(model), lr=1e-2, weight_decay=0.1, bucket_params=50, slots=2,
                             device_fraction=0.2, weights=weights, gradients=gradients, host_fraction=host_fraction)
    if weights != "device":
        blocks = [((w,), True) for w in model.experts]
        opt.working = WorkingWeights(opt, [model], mode=weights, dtype=torch.bfloat16, blocks=blocks, window=2)
        bind_weight_sources(list(model.modules()), opt.working)
        if weights == "stream":
            for unit, following in zip(model.layers, model.layers[1:]):
                unit.set_modules_to_forward_prefetch([following])
    stream = None
    if gradients == "stream":
        group = expert_mesh.get_group(0)
        stream = GradientStream(opt, [GradBlock((w,), lambda g: reduce_replica_grad(g, group)) for w in model.experts],
                                grad_norm_term)
    return model, opt, stream


def _inputs(step, rank, device):
    return [torch.randn(4, 5, generator=torch.Generator().manual_seed(fresh_seed(100 * step + 10 * k + rank)))
            .to(device) for k in range(2)]


def _step(model, opt, stream, inputs, expert_group):
    """Two micro-batches, the replica sum, the norm, clipping and the update (nothing reads a value)."""
    for k, x in enumerate(inputs):
        if stream is not None:
            stream.begin_micro_batch(k, 2)
        model(x).backward()
    terms = {}
    if stream is not None:
        stream.end_backward()
        terms = stream.terms()
    reduce_replica_grads(model.experts, expert_group)
    norm = total_grad_norm(list(model.parameters()), terms=terms)
    clip_grads_with_norm_(list(model.parameters()), MAX_NORM, norm)
    if stream is not None:
        stream.set_scale(clip_coefficient(MAX_NORM, norm))
    opt.step()
    opt.zero_grad()
    return norm


def _values(model, opt):
    """Every parameter's fp32 value (the parameter itself, or its master) on the host."""
    opt.wait_for_weights()
    return [p.to_local().detach().float().cpu().clone() for p in model.parameters()]


def _working_worker(rank, world_size, sync_check):
    device = worker_device()
    mesh = init_device_mesh(device.type, (world_size,))
    expert_mesh = init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("replica", "shard"))
    expert_group = expert_mesh.get_group(0)
    runs = {}
    for weights, gradients, host_fraction in [(w, g, f) for f in HOST_FRACTIONS for w, g in SETTINGS]:
        model, opt, stream = _build(weights, gradients, mesh, expert_mesh, device, host_fraction)
        if host_fraction:  # a CPU share really runs; with streamed gradients it reads them where they landed
            assert opt._host_update.numel > 0
            assert opt.host_buffer_bytes == (0 if gradients == "stream" else 4 * opt._host_update.numel)
        norms = []
        for step in range(STEPS):
            inputs = _inputs(step, rank, device)
            with no_host_syncs() if sync_check and step > 0 else _nothing():
                norms.append(_step(model, opt, stream, inputs, expert_group))
            if stream is not None:  # every gradient left the device
                assert all(p.grad is None for p in model.parameters())
                assert stream.stats["held_max"] <= H * H and stream.stats["partials"] > 0
        runs[(weights, gradients, host_fraction)] = (torch.stack(norms).cpu(), _values(model, opt), model, opt,
                                                     stream)
    for setting, (norms, values, model, opt, stream) in runs.items():
        # the same CPU share's kernel (torch's fused AdamW on the CPU) in every setting of one host_fraction
        ref_norms, ref_values = runs[("device", "device", setting[2])][:2]
        assert_bitwise_equal(norms, ref_norms, name=f"rank {rank} {setting} norms")
        for i, (a, b) in enumerate(zip(values, ref_values)):
            assert_bitwise_equal(a, b, name=f"rank {rank} {setting} parameter {i}")
        if setting[0] == "stream":
            units, shards = opt.working.units, opt.working.shards
            assert units.stats["overflow"] == 0 and shards.stats["overflow"] == 0
            # Only the first block of a step loads when asked (a step made every copy stale); every
            # other load was a prefetch one block ahead, and the blocks still in their slots (the
            # last block for its recompute, the first for the next micro-batch) were used as they were.
            assert shards.stats["demand"] == STEPS and shards.stats["reused"] > 0
            assert shards.log[:N_BLOCKS] == [(b, False) for b in range(N_BLOCKS)]
            assert any(backward for _, backward in shards.log)
            # FSDP2 units: gathered from a slot each time they are gathered (forward, and backward)
            assert units.stats["loads"] >= STEPS * 2 * (2 * N_BLOCKS)
            # the slots hold the largest block unit; the root unit (gathered once per micro-batch) its own buffer
            root = sum(p.to_local().numel() for name, p in model.named_parameters() if "layers" not in name)
            assert units._slots.capacity < root and units.stats["transient"] == STEPS * 2, units.stats
            assert units._slots.device_bytes() == 2 * units._slots.capacity * 2


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def _fsdp2_worker(rank, world_size):
    _adopt_worker(rank, world_size)
    _working_worker(rank, world_size, False)


def test_settings_are_bitwise_device_device_and_adopt_their_masters_on_fsdp2():
    """Both workers in one spawn of 2 gloo ranks (a spawn costs more than either worker's checks)."""
    run_distributed(_fsdp2_worker, 2)


def _adopt_worker(rank, world_size):
    """The fp32 device tensors are released, each parameter's value is its master, FSDP2 gathers bf16."""
    mesh = init_device_mesh("cpu", (world_size,))
    expert_mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replica", "shard"))
    for weights in ("bf16", "stream"):
        model = _Model(fresh_seed(6), mesh, expert_mesh, torch.device("cpu"))
        old = [weakref.ref(p._local_tensor) for p in model.parameters()]
        opt = OffloadStreamAdamW(forward_order(model), bucket_params=50, device_fraction=0.3, weights=weights,
                                 piece_align=1)
        values = [p.to_local().clone() for p in opt._params]
        working = WorkingWeights(opt, [model], mode=weights, dtype=torch.bfloat16,
                                 blocks=[((w,), True) for w in model.experts])
        gc.collect()
        assert all(ref() is None for ref in old), "a parameter's fp32 tensor is still referenced"
        for i, p in enumerate(opt._params):
            assert p._local_tensor.data_ptr() == opt.value_tensor(i).data_ptr()
            assert_bitwise_equal(p.to_local(), values[i], name=f"{weights} value {i}")
            assert_bitwise_equal(working.views[i].view(p._local_tensor.shape), values[i].to(torch.bfloat16),
                                 name=f"{weights} working {i}")
        for fp, _ in working._fsdp.values():
            assert fp._sharded_param_data.dtype == torch.bfloat16
        padded = sum(fp._sharded_param_data.numel() for fp, _ in working._fsdp.values())
        assert padded >= sum(p._local_tensor.numel() for p in model.parameters() if id(p) in working._fsdp)
        if weights == "bf16":  # 2 B per parameter element (FSDP2's padding included), nothing else
            assert working.device_bytes() == 2 * (padded + sum(w.to_local().numel() for w in model.experts))
        assert opt._mirrors, "no parameter straddles the device share's end: the test misses that case"


def test_bad_settings_are_refused():
    params = [nn.Parameter(torch.randn(3))]
    for kwargs, match in ((dict(weights="gpu"), "weights"), (dict(gradients="host"), "gradients"),
                          (dict(gradients="stream", host_fraction=1.5), "host_fraction")):
        with pytest.raises(ValueError, match=match):
            OffloadStreamAdamW(params, **kwargs)
    opt = OffloadStreamAdamW(params, weights="bf16")
    with pytest.raises(ValueError, match="DTensor"):
        WorkingWeights(opt, [], mode="bf16", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 compute"):
        WorkingWeights(opt, [], mode="bf16", dtype=torch.float32)
    with pytest.raises(ValueError, match="weight_window"):
        WorkingWeights(opt, [], mode="bf16", dtype=torch.bfloat16, window=0)
    with pytest.raises(ValueError, match="built with weights"):
        WorkingWeights(OffloadStreamAdamW(params), [], mode="stream", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gradients = 'stream'"):
        GradientStream(OffloadStreamAdamW(params), [], grad_norm_term)
    two = [nn.Parameter(torch.randn(10)), nn.Parameter(torch.randn(10))]
    with pytest.raises(ValueError, match="straddles"):  # the share may split a tensor
        OffloadStreamAdamW(two, device_fraction=0.25, piece_align=1).master_view(0)


@pytest.mark.gpu
@requires_gpus(1)
def test_cuda_settings_are_bitwise_and_never_sync_the_host():
    """One GPU: the same bits, and steps 2-3 (forward, backward, norm, clipping, update) run under
    torch.cuda.set_sync_debug_mode("error")."""
    run_distributed(_working_worker, 1, True, backend="nccl")


def test_norm_terms_give_the_device_paths_norm():
    """total_grad_norm from streamed terms equals the one formed from the gradients (same kernel)."""
    gen = torch.Generator().manual_seed(fresh_seed(41))
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in ((5, 3), (7,), (0,), (2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    for norm_type in (2.0, 1.0, float("inf")):
        want = total_grad_norm(params, norm_type)
        terms = {id(p): grad_norm_term(p.grad, norm_type) for p in params[:2]}
        assert_bitwise_equal(total_grad_norm(params, norm_type, terms=terms), want, name=f"p={norm_type}")
        got = torch.nn.utils.get_total_norm([p.grad for p in params if p.numel()], norm_type)  # (torch: no inf of [])
        torch.testing.assert_close(want, got, rtol=1e-6, atol=0)
