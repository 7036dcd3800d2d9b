"""OffloadStreamAdamW against torch.optim.AdamW: values, state, resume (incl. DCP and FSDP2), staging."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from mop_train.ops.offload_adamw import (
    OffloadStreamAdamW, adamw_reference_step, device_bytes_per_element, fit_device_fraction, host_state_bytes,
    host_update, plan_buckets, reference_adamw, staging_bytes_bound)
from tests.dist_utils import run_distributed
from tests.utils import assert_bitwise_equal, assert_close, fresh_seed, no_host_syncs

SHAPES = [(3, 5), (7,), (), (0, 4), (11, 3), (2, 2, 3), (13,)]
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
RTOL, ATOL = 1e-6, 1e-9


def _groups(params):
    return [{"params": params[:4], "weight_decay": 0.1},
            {"params": params[4:], "lr": 5e-3}]


def _grads(step: int, shapes, dtype, seed: int):
    """Fresh random gradients; parameter 1 has none at step 1, parameter 5 none before step 2."""
    gen = torch.Generator().manual_seed(fresh_seed(seed * 1000 + step))
    out = []
    for i, shape in enumerate(shapes):
        skip = (i == 1 and step == 1) or (i == 5 and step < 2)
        out.append(None if skip else torch.randn(shape, generator=gen).to(dtype))
    return out


def _give_grads(ours, reference, step: int, dtype, seed: int) -> None:
    """Step `step`'s gradients (`_grads`) on our parameters and, in fp32, on the reference's."""
    for p, q, g in zip(ours, reference, _grads(step, SHAPES, dtype, seed)):
        p.grad = g
        q.grad = None if g is None else g.float()


def _params(seed: int, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(fresh_seed(seed))
    return [nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in SHAPES]


def _run(opt, params, steps, seed, sched=None, start=0):
    for step in range(start, steps):
        for p, g in zip(params, _grads(step, SHAPES, params[0].dtype, seed)):
            p.grad = None if g is None else g.to(p.device)
        opt.step()
        if sched is not None:
            sched.step()


def _lambda(step):
    return 1.0 / (1 + step)


def _assert_state_close(ours, ref, rtol=RTOL):
    """Moments within rtol of the reference, relative to each tensor's largest value: torch's AdamW
    kernels (CPU fused, CUDA fused, for-loop) order the moment updates differently, so an element
    much smaller than its neighbours may differ by a few ulps of their magnitude."""
    assert set(ours["state"]) == set(ref["state"])
    for i, b in ref["state"].items():
        a = ours["state"][i]
        assert float(a["step"]) == float(b["step"]), f"param {i}: step {a['step']} != {b['step']}"
        for key in ("exp_avg", "exp_avg_sq"):
            local = b[key].to_local() if hasattr(b[key], "to_local") else b[key]  # this rank's shard
            scale = float(local.abs().max()) if local.numel() else 0.0
            assert_close(a[key], b[key], rtol=rtol, atol=rtol * scale + ATOL, name=f"param {i} {key}")


@pytest.mark.parametrize("bucket_params,slots", [(7, 1), (7, 2), (7, 3), (1, 2), (5, 3), (10_000, 2)])
def test_matches_torch_adamw_fp32(bucket_params, slots):
    seed = fresh_seed(11 + bucket_params + slots)
    ours_p, ref_p = _params(seed), _params(seed)
    opt = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=bucket_params, slots=slots, piece_align=1)
    ref = reference_adamw(_groups(ref_p), **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, _lambda)
    _run(opt, ours_p, 5, seed, sched)
    _run(ref, ref_p, 5, seed, ref_sched)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    for i, (a, b) in enumerate(zip(ours_p, ref_p)):
        assert_close(a, b, rtol=RTOL, atol=ATOL, name=f"param {i}")
    ours, ref_sd = opt.state_dict(), ref.state_dict()
    _assert_state_close(ours, ref_sd)
    for i, p in enumerate(ours_p):
        assert_bitwise_equal(ours["state"][i]["master"], p.detach(), name=f"master {i}")


def test_reference_math_matches_torch():
    seed = fresh_seed(5)
    ref_p = _params(seed)
    ref = reference_adamw(ref_p, **HP)
    mine = [p.detach().clone() for p in ref_p]
    m = [torch.zeros_like(p) for p in mine]
    v = [torch.zeros_like(p) for p in mine]
    for step in range(3):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(fresh_seed(step * 7 + i)))
                 for i, s in enumerate(SHAPES)]
        for p, g in zip(ref_p, grads):
            p.grad = g
        ref.step()
        adamw_reference_step(mine, grads, m, v, [step + 1] * len(mine), **HP)
    for i, (a, b) in enumerate(zip(mine, ref_p)):
        assert_close(a, b, rtol=RTOL, atol=ATOL, name=f"param {i}")


def test_defaults_and_hyperparameters_are_torch_adamw_s():
    """With no hyperparameters given, OffloadStreamAdamW and reference_adamw are torch.optim.AdamW with its
    defaults; with hyperparameters given, they pass every one on."""
    seed = fresh_seed(17)
    for kwargs in (dict(), dict(lr=3e-2, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.2)):
        ours_p, ref_p, torch_p = _params(seed), _params(seed), _params(seed)
        opts = [OffloadStreamAdamW(ours_p, **kwargs, bucket_params=7, piece_align=1), reference_adamw(ref_p, **kwargs),
                torch.optim.AdamW(torch_p, **kwargs, foreach=False)]
        moved = [0.0] * len(torch_p)  # per parameter: the sum over steps of its largest update |p_t - p_{t-1}|
        for step in range(3):
            before = [p.detach().clone() for p in torch_p]
            for opt, params in zip(opts, (ours_p, ref_p, torch_p)):
                for p, g in zip(params, _grads(step, SHAPES, torch.float32, seed)):
                    p.grad = g
                opt.step()
            moved = [m + ((p.detach() - b).abs().max().item() if p.numel() else 0.0)
                     for m, p, b in zip(moved, torch_p, before)]
        for i, (a, b, c) in enumerate(zip(ours_p, ref_p, torch_p)):
            assert_bitwise_equal(b.detach(), c.detach(), name=f"reference_adamw {kwargs} param {i}")
            # fused AdamW forms each update in another order than torch's single-tensor loop: a few fp32
            # ulps of the update per step (8 here), on top of the rounding of the value itself (RTOL)
            atol = ATOL + 8 * torch.finfo(torch.float32).eps * moved[i]
            assert_close(a, c, rtol=RTOL, atol=atol, name=f"OffloadStreamAdamW {kwargs} param {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host_fraction", [0.0, 0.3, 1.0])
def test_matches_fp32_adamw_given_the_same_gradients(dtype, host_fraction, monkeypatch):
    """bf16 or fp32 working weights, streamed or (partly) CPU-updated: the fp32 masters follow fp32
    AdamW fed the same gradients, and the working weights are the masters in their dtype."""
    monkeypatch.setattr(host_update, "CHUNK", 6)  # several CPU chunks, tensors split across them
    seed = fresh_seed(51 + int(10 * host_fraction) + (dtype == torch.bfloat16))
    ours_p = _params(seed, dtype)
    ref_p = [nn.Parameter(p.detach().float().clone()) for p in ours_p]
    opt = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=7, slots=2, host_fraction=host_fraction, piece_align=1)
    ref = reference_adamw(_groups(ref_p), **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, _lambda)
    for step in range(5):
        _give_grads(ours_p, ref_p, step, dtype, seed)
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    ours = opt.state_dict()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        master = ours["state"][i]["master"]
        assert_close(master, q, rtol=RTOL, atol=ATOL, name=f"master {i}")
        assert_bitwise_equal(p.detach(), master.to(dtype), name=f"weight {i}")
    _assert_state_close(ours, ref.state_dict())
    numel = sum(p.numel() for p in ours_p)
    on_host = round(host_fraction * numel)  # the last step has every gradient
    assert opt.last_step.host_updated_elements == on_host
    state_bytes = 12 * (numel - on_host) + 4 * on_host  # streamed state; the CPU share's gradients / weights
    assert opt.last_step.d2h_bytes == state_bytes
    assert opt.last_step.h2d_bytes == state_bytes + 4 * len(ours_p)  # and the fp32 step counts up
    assert opt.link_bytes().h2d == {"optimizer": opt.last_step.h2d_bytes, "windows": 0, "gradients": 0}
    assert opt.host_buffer_bytes == 4 * on_host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [dict(), dict(host_fraction=0.5), dict(device_fraction=0.4)],
                         ids=["streamed", "host-share", "device-share"])
def test_values_set_after_construction_are_the_start(dtype, split, monkeypatch):
    """Weights written after the optimizer is built (copy_ into the parameter, or a new .data; e.g.
    init_weights after building) are where AdamW starts: each parameter's master is its working
    weight at its first update. Parameter 5, first updated at step 2, is rewritten once more after
    step 0. Judged against torch.optim.AdamW started from the final values."""
    monkeypatch.setattr(host_update, "CHUNK", 6)
    seed = fresh_seed(71 + (dtype == torch.bfloat16))
    ours_p = _params(seed, dtype)
    opt = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=7, slots=2, **split, piece_align=1)
    fresh = _params(seed + 1, dtype)

    def rewrite(i):
        with torch.no_grad():
            if i % 2:
                ours_p[i].data = fresh[i].detach().clone()
            else:
                ours_p[i].copy_(fresh[i])

    for i in range(len(SHAPES)):
        rewrite(i)
    ref_p = [nn.Parameter(p.detach().float().clone()) for p in ours_p]
    ref = reference_adamw(_groups(ref_p), **HP)
    for step in range(4):
        _give_grads(ours_p, ref_p, step, dtype, seed)
        opt.step()
        ref.step()
        if step == 0:
            fresh = _params(seed + 2, dtype)
            rewrite(5)
            with torch.no_grad():
                ref_p[5].copy_(ours_p[5].float())
    ours = opt.state_dict()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        assert_close(ours["state"][i]["master"], q, rtol=RTOL, atol=ATOL, name=f"master {i}")
        assert_bitwise_equal(p.detach(), ours["state"][i]["master"].to(dtype), name=f"weight {i}")


def test_host_fraction_resume_is_exact(monkeypatch):
    monkeypatch.setattr(host_update, "CHUNK", 5)
    seed, kwargs = 61, dict(**HP, bucket_params=6, slots=2, host_fraction=0.5)
    full_p = _params(seed, torch.bfloat16)
    full = OffloadStreamAdamW(_groups(full_p), **kwargs, piece_align=1)
    _run(full, full_p, 5, seed)
    first_p = _params(seed, torch.bfloat16)
    first = OffloadStreamAdamW(_groups(first_p), **kwargs, piece_align=1)
    _run(first, first_p, 3, seed)
    saved = first.state_dict()
    resumed_p = _params(seed + 1, torch.bfloat16)
    for p, q in zip(resumed_p, first_p):
        p.data.copy_(q)
    resumed = OffloadStreamAdamW(_groups(resumed_p), **kwargs, piece_align=1)
    resumed.load_state_dict(saved)
    _run(resumed, resumed_p, 5, seed, start=3)
    _assert_same_run(full_p, full, resumed_p, resumed)


@pytest.mark.parametrize("split", [dict(), dict(host_fraction=0.5), dict(device_fraction=0.4)],
                         ids=["streamed", "host-share", "device-share"])
def test_resumes_a_torch_adamw_checkpoint(split, monkeypatch):
    """A torch.optim.AdamW state dict (no "master"; parameter 5, never updated yet, has no entry)
    loaded into an optimizer that has already stepped on other gradients: masters come from the
    working weights, parameter 5 starts afresh (step 0, zero moments), and the run continues as
    torch's. A state entry without a moment is refused, naming it."""
    monkeypatch.setattr(host_update, "CHUNK", 6)
    seed = fresh_seed(81)
    ref_p = _params(seed)
    ref = reference_adamw(_groups(ref_p), **HP)
    _run(ref, ref_p, 2, seed)
    ours_p = _params(seed + 1)
    opt = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=7, slots=2, **split, piece_align=1)
    _run(opt, ours_p, 3, seed + 2)                                   # state of another run everywhere
    with torch.no_grad():
        for p, q in zip(ours_p, ref_p):
            p.copy_(q)
    saved = ref.state_dict()
    assert 5 not in saved["state"] and "master" not in saved["state"][0]
    opt.load_state_dict(saved)
    _run(opt, ours_p, 5, seed, start=2)
    _run(ref, ref_p, 5, seed, start=2)
    for i, (a, b) in enumerate(zip(ours_p, ref_p)):
        assert_close(a, b, rtol=RTOL, atol=ATOL, name=f"param {i}")
    _assert_state_close(opt.state_dict(), ref.state_dict())
    broken = ref.state_dict()
    del broken["state"][0]["exp_avg"]
    with pytest.raises(ValueError, match="optimizer state of parameter 0 lacks 'exp_avg'"):
        opt.load_state_dict(broken)


def test_host_state_is_outside_autograd():
    params = _params(8)
    opt = OffloadStreamAdamW(params, bucket_params=4, host_fraction=0.5, piece_align=1)
    opt.load_state_dict(opt.state_dict())
    opt.reset_masters_from_params()
    assert not opt._host.requires_grad and opt._host.grad_fn is None
    for entry in opt.state_dict()["state"].values():
        assert not any(t.requires_grad for t in entry.values())


def _assert_same_run(params_a, opt_a, params_b, opt_b):
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert_bitwise_equal(a.detach(), b.detach(), name=f"param {i}")
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    for key in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "master"):  # the device share's state lives on the device
            assert_bitwise_equal(sa["state"][key][name].cpu(), sb["state"][key][name].cpu(), name=f"{key} {name}")
        assert float(sa["state"][key]["step"]) == float(sb["state"][key]["step"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_state_dict_is_exact(dtype):
    seed = fresh_seed(31)
    full_p = _params(seed, dtype)
    full = OffloadStreamAdamW(_groups(full_p), **HP, bucket_params=7, slots=2, piece_align=1)
    full_sched = torch.optim.lr_scheduler.LambdaLR(full, _lambda)
    _run(full, full_p, 5, seed, full_sched)

    first_p = _params(seed, dtype)
    first = OffloadStreamAdamW(_groups(first_p), **HP, bucket_params=7, slots=2, piece_align=1)
    first_sched = torch.optim.lr_scheduler.LambdaLR(first, _lambda)
    _run(first, first_p, 3, seed, first_sched)
    buf = io.BytesIO()
    torch.save({"opt": first.state_dict(), "sched": first_sched.state_dict(),
                "params": [p.detach() for p in first_p]}, buf)
    buf.seek(0)
    saved = torch.load(buf)

    resumed_p = _params(seed + 1, dtype)  # different weights: everything must come from the save
    for p, q in zip(resumed_p, saved["params"]):
        p.data.copy_(q)
    resumed = OffloadStreamAdamW(_groups(resumed_p), **HP, bucket_params=5, slots=1, piece_align=1)
    resumed_sched = torch.optim.lr_scheduler.LambdaLR(resumed, _lambda)
    resumed.load_state_dict(saved["opt"])
    resumed_sched.load_state_dict(saved["sched"])
    _run(resumed, resumed_p, 5, seed, resumed_sched, start=3)
    _assert_same_run(full_p, full, resumed_p, resumed)


class _Tiny(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(fresh_seed(seed))
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 1)
        self.c = nn.Linear(1, 3)

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x))))


def _train(model, opt, steps, start=0, rank=0):
    for step in range(start, steps):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(fresh_seed(100 * step + rank)))
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()


def dcp_resume_matches_straight_run(tmp_path, kwargs: dict, resumed_kwargs: dict):
    """5 straight steps against 3 steps, a DCP save through torchtitan's OptimizersContainer, a load
    into a fresh model and optimizer built with `resumed_kwargs`, and 2 more steps: the same run.
    Returns the straight run's (model, container)."""
    from torchtitan.components.optimizer import OptimizersContainer
    full = _Tiny(0)
    full_opt = OptimizersContainer([full], OffloadStreamAdamW, kwargs)
    _train(full, full_opt, 5)

    first = _Tiny(0)
    first_opt = OptimizersContainer([first], OffloadStreamAdamW, kwargs)
    _train(first, first_opt, 3)
    dcp.save({"model": get_model_state_dict(first), "optimizer": first_opt}, checkpoint_id=str(tmp_path))

    resumed = _Tiny(1)
    resumed_opt = OptimizersContainer([resumed], OffloadStreamAdamW, resumed_kwargs)
    target = {"model": get_model_state_dict(resumed), "optimizer": resumed_opt}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_model_state_dict(resumed, target["model"])
    _train(resumed, resumed_opt, 5, start=3)
    _assert_same_run(list(full.parameters()), full_opt.optimizers[0],
                     list(resumed.parameters()), resumed_opt.optimizers[0])
    return full, full_opt


def test_resume_through_dcp_and_torchtitan_container(tmp_path):
    kwargs = dict(**HP, bucket_params=4, slots=2)
    full, full_opt = dcp_resume_matches_straight_run(tmp_path, kwargs, dict(kwargs, slots=3))
    flat = get_optimizer_state_dict(full, full_opt.optimizers[0],
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert {"state.a.weight.master", "state.a.weight.exp_avg", "state.c.bias.step"} <= set(flat)


def _fsdp2_worker(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import OptimizersContainer
    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed, cls, kwargs):
        model = _Tiny(seed)
        for layer in (model.a, model.b, model.c):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, OptimizersContainer([model], cls, kwargs)

    ours_kwargs = dict(**HP, bucket_params=3, slots=2, host_fraction=0.5)  # streamed and CPU-updated halves
    ref_kwargs = dict(**HP, foreach=False)
    full, full_opt = build(0, OffloadStreamAdamW, ours_kwargs)
    ref, ref_opt = build(0, torch.optim.AdamW, ref_kwargs)
    _train(full, full_opt, 5, rank=rank)
    _train(ref, ref_opt, 5, rank=rank)
    for (name, p), q in zip(full.named_parameters(), ref.parameters()):
        assert_close(p.to_local(), q.to_local(), rtol=RTOL, atol=ATOL, name=f"rank {rank} {name}")
    ours_sd = full_opt.optimizers[0].state_dict()
    _assert_state_close(ours_sd, ref_opt.optimizers[0].state_dict())
    for entry, p in zip(ours_sd["state"].values(), full.parameters()):
        assert entry["exp_avg"].placements == p.placements and entry["master"].shape == p.shape
        assert not entry["exp_avg"].requires_grad  # the state stays outside autograd

    first, first_opt = build(0, OffloadStreamAdamW, ours_kwargs)
    _train(first, first_opt, 3, rank=rank)
    dcp.save({"model": get_model_state_dict(first), "optimizer": first_opt}, checkpoint_id=path)
    resumed, resumed_opt = build(1, OffloadStreamAdamW, dict(ours_kwargs, bucket_params=2))
    target = {"model": get_model_state_dict(resumed), "optimizer": resumed_opt}
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(resumed, target["model"])
    _train(resumed, resumed_opt, 5, start=3, rank=rank)
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert_bitwise_equal(p.to_local(), q.to_local(), name=f"rank {rank} {name}")
    full_sd, resumed_sd = full_opt.optimizers[0].state_dict(), resumed_opt.optimizers[0].state_dict()
    for a, b in zip(full_sd["state"].values(), resumed_sd["state"].values()):
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert_bitwise_equal(a[key].to_local(), b[key].to_local(), name=f"rank {rank} {key}")

    # a full (unsharded) optimizer state dict loads into the sharded optimizer too
    full_osd = get_optimizer_state_dict(full, full_opt.optimizers[0],
                                        options=StateDictOptions(full_state_dict=True))
    fresh, fresh_opt = build(2, OffloadStreamAdamW, ours_kwargs)
    set_optimizer_state_dict(fresh, fresh_opt.optimizers[0], full_osd,
                             options=StateDictOptions(full_state_dict=True))
    for a, b in zip(full_sd["state"].values(), fresh_opt.optimizers[0].state_dict()["state"].values()):
        assert_bitwise_equal(a["exp_avg_sq"].to_local(), b["exp_avg_sq"].to_local(), name="full load")
    # ... and so do plain full tensors given straight to load_state_dict (each rank takes its own rows), this
    # rank's plain local shards, and DTensors of another placement (redistributed on load)
    forms = (("plain full", lambda v: v.full_tensor()), ("plain local", lambda v: v.to_local()),
             ("replicated", lambda v: v.redistribute(v.device_mesh, [Replicate()])))
    for seed, (form, convert) in enumerate(forms, start=3):
        saved = {"param_groups": full_sd["param_groups"],
                 "state": {i: {k: convert(v) if isinstance(v, DTensor) else v for k, v in e.items()}
                           for i, e in full_sd["state"].items()}}
        other, other_opt = build(seed, OffloadStreamAdamW, ours_kwargs)
        other_opt.optimizers[0].load_state_dict(saved)
        for a, b in zip(full_sd["state"].values(), other_opt.optimizers[0].state_dict()["state"].values()):
            for key in ("exp_avg", "exp_avg_sq", "master"):
                assert_bitwise_equal(a[key].to_local(), b[key].to_local(), name=f"rank {rank} {form} {key}")
        if form == "plain full":
            plain, fresh_opt = saved, other_opt
    plain["state"][0]["exp_avg"] = plain["state"][0]["exp_avg"][:1]
    with pytest.raises(ValueError, match="does not fit parameter 0"):
        fresh_opt.optimizers[0].load_state_dict(plain)


@pytest.mark.slow
def test_fsdp2_dtensor_params_two_ranks(tmp_path):
    run_distributed(_fsdp2_worker, 2, str(tmp_path))


def test_staging_bound_and_bytes_moved():
    params = _params(3)
    numel = sum(p.numel() for p in params)
    for bucket_params, slots in [(1, 1), (7, 2), (8, 3), (numel + 5, 4)]:
        opt = OffloadStreamAdamW(params, bucket_params=bucket_params, slots=slots)
        assert opt.staging_bytes <= staging_bytes_bound(bucket_params, slots)
        assert opt.staging_bytes == staging_bytes_bound(min(bucket_params, numel), slots)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        assert opt.last_step.h2d_bytes - 4 * len(params) == opt.last_step.d2h_bytes == 12 * numel  # + step counts
        assert opt.last_step.buckets == -(-numel // bucket_params)
        assert opt.step_seconds() >= 0.0
    fresh = OffloadStreamAdamW(params, bucket_params=7)
    assert fresh.step_seconds() == 0.0 and fresh.last_step.h2d_bytes == fresh.last_step.buckets == 0  # no step yet
    # nothing streamed: no slots, only the gradient buffer of the largest device-resident bucket (if any)
    assert OffloadStreamAdamW(params, bucket_params=7, device_fraction=1.0, piece_align=1).staging_bytes == 4 * 7
    assert OffloadStreamAdamW(params, bucket_params=7, host_fraction=1.0, piece_align=1).staging_bytes == 0
    for kwargs in (dict(), dict(device_fraction=0.4, host_fraction=0.3)):  # reported bytes = allocated bytes
        opt = OffloadStreamAdamW(params, bucket_params=7, slots=2, **kwargs, piece_align=1)
        staged = [*opt._slot_buffers, opt._grad_buffer]
        assert sum(t.untyped_storage().nbytes() for t in staged) == opt.staging_bytes
        assert opt._host.nbytes == host_state_bytes(numel - opt._dev_end) and opt.device_state_bytes == 8 * opt._dev_end
    gen = torch.Generator().manual_seed(fresh_seed(13))
    for _ in range(5):  # the planner's pinned gradient bytes of a CPU share are the ones allocated
        # drawn in [1/numel, 1): a share of at least one element, so the buffer is there to be counted
        fraction = (1 + float(torch.rand(1, generator=gen)) * (numel - 1)) / numel
        opt = OffloadStreamAdamW(params, bucket_params=7, host_fraction=fraction, piece_align=1)
        assert host_update.host_share_bytes(numel, fraction) == opt.host_buffer_bytes > 0, fraction


def test_device_fraction_fits_the_staging_bound_exactly():
    """fit_device_fraction on random sizes: the share d (in 1/1000) it returns fits beside the streamed
    part's staging bound (`staging_bytes_bound`, with the CPU share's temporaries when on) and the
    margin, and d + 1/1000 would not; d = 1 only when everything is resident with one bucket's
    gradient buffer; no parameters fit anywhere, one parameter in no memory fits nowhere."""
    gen = torch.Generator().manual_seed(fresh_seed(97))
    for _ in range(200):
        big = bool(torch.randint(0, 2, (1,), generator=gen))            # beyond the CPU share's 32 MiB temporaries
        n = int(torch.randint(1, 1 << 25 if big else 5000, (1,), generator=gen))
        B = int(torch.randint(1, 3000, (1,), generator=gen))
        s, fp32, host = int(torch.randint(1, 4, (1,), generator=gen)), bool(torch.randint(0, 2, (1,), generator=gen)), \
            bool(torch.randint(0, 2, (1,), generator=gen))
        per, margin = device_bytes_per_element(fp32), int(torch.randint(0, 100, (1,), generator=gen))
        stage = staging_bytes_bound(B, s, host_share=host)
        free = margin + stage + int(torch.randint(-100, per * n + 200, (1,), generator=gen))
        d = fit_device_fraction(free, n, fp32_weights=fp32, bucket_params=B, slots=s, host_share=host, margin_bytes=margin)
        tag = (n, B, s, fp32, host, margin, free, d)
        if d == 1.0 and margin + per * n + min(B, n) * 4 <= free:
            continue                                                  # all resident
        k = round(d * 1000)
        assert d == k / 1000 and 0 <= k < 1000, tag
        room = (free - margin - stage) * 1000                         # in 1/1000 of an element's bytes
        assert k == 0 or k * per * n <= room, tag                     # fits
        assert (k + 1) * per * n > room, tag                          # one step more would not
    assert fit_device_fraction(0, 0, fp32_weights=True, bucket_params=4, slots=2) == 1.0
    assert fit_device_fraction(0, 1, fp32_weights=True, bucket_params=4, slots=2, margin_bytes=0) == 0.0


def test_host_state_owns_whole_pages():
    import mmap
    from mop_train.ops.offload_adamw.buckets import allocate_host_state
    for numel in (0, 1, 81, 5000):
        state, registered = allocate_host_state(numel, pin=False)
        assert state.shape == (3, numel) and state.dtype == torch.float32 and not registered
        if numel == 0:
            continue
        storage = state.untyped_storage()
        assert state.data_ptr() == storage.data_ptr() and storage.data_ptr() % mmap.PAGESIZE == 0
        assert storage.nbytes() == -(-state.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages
        state.fill_(1.5)
        assert float(state.sum()) == 1.5 * state.numel()


@pytest.mark.parametrize("bucket_params", [1, 3, 7, 64])
def test_bucket_plan_tiles_every_parameter_once(bucket_params):
    gen = torch.Generator().manual_seed(fresh_seed(bucket_params))
    numels = torch.randint(0, 20, (9,), generator=gen).tolist()
    covered = [[0] * n for n in numels]
    buckets = plan_buckets(numels, bucket_params)
    for b in buckets:
        assert 0 < b.numel <= bucket_params
        assert sum(s.numel for s in b.segments) == b.numel
        pos = 0
        for s in b.segments:
            assert s.bucket_start == pos and s.numel > 0
            pos += s.numel
            for j in range(s.param_start, s.param_start + s.numel):
                covered[s.param][j] += 1
    assert all(c == 1 for row in covered for c in row)


def test_no_gradients_leaves_everything_unchanged():
    params = _params(4)
    opt = OffloadStreamAdamW(params, bucket_params=5)
    before = [p.detach().clone() for p in params]
    opt.step()
    for a, b in zip(params, before):
        assert_bitwise_equal(a.detach(), b)
    assert all(float(s["step"]) == 0.0 for s in opt.state_dict()["state"].values())


def test_bad_arguments_raise_value_error():
    params = _params(6)
    bad = [
        (dict(bucket_params=0), r"bucket_params \(0\)"),
        (dict(bucket_params=2.5), r"bucket_params \(2.5\)"),
        (dict(bucket_params=True), r"bucket_params \(True\)"),
        (dict(slots=0), r"slots \(0\)"),
        (dict(slots=True), r"slots \(True\)"),
        (dict(slots=2.5), r"slots \(2.5\)"),
        (dict(lr=-1.0), r"lr \(-1.0\)"),
        (dict(betas=(1.0, 0.9)), r"betas \(\(1.0, 0.9\)\)"),
        (dict(eps=-1e-8), r"eps \(-1e-08\)"),
        (dict(weight_decay=-0.1), r"weight_decay \(-0.1\)"),
        (dict(host_fraction=-0.1), r"host_fraction \(-0.1\)"),
        (dict(host_fraction=1.5), r"host_fraction \(1.5\)"),
        (dict(host_fraction=True), r"host_fraction \(True\)"),
        (dict(host_fraction="0.5"), r"host_fraction \('0.5'\)"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            OffloadStreamAdamW(params, **kwargs, piece_align=1)
    with pytest.raises(ValueError, match="amsgrad"):
        OffloadStreamAdamW([{"params": params, "amsgrad": True}])
    with pytest.raises(ValueError, match="contiguous"):
        OffloadStreamAdamW([nn.Parameter(torch.randn(4, 3).t())])
    with pytest.raises(ValueError, match="one device"):
        OffloadStreamAdamW([nn.Parameter(torch.randn(2)), nn.Parameter(torch.empty(2, device="meta"))])
    opt = OffloadStreamAdamW(params[:2])
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": params[2:]})
    with pytest.raises(ValueError, match=r"slots \(-2\)"):
        opt.resize_staging(10, -2)
    with pytest.raises(ValueError, match=r"sizes \[1\]"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0], **HP}]})
    opt.resize_staging(4, 2)  # host_fraction left as it is
    with pytest.raises(ValueError, match=r"host_fraction \(1.5\)"):
        opt.resize_staging(4, 2, host_fraction=1.5)
    saved = opt.state_dict()
    saved["state"][1]["exp_avg"] = saved["state"][1]["exp_avg"][:-1]
    with pytest.raises(ValueError, match="does not fit parameter 1"):
        opt.load_state_dict(saved)
    with pytest.raises(ValueError, match="bucket_params"):
        plan_buckets([3, 4], 0)
    with pytest.raises(ValueError, match=r"range \[5, 2\)"):
        plan_buckets([3, 4], 2, start=5, end=2)
    with pytest.raises(ValueError, match="meta"):
        OffloadStreamAdamW([nn.Parameter(torch.empty(2, device="meta"))])
    for flag in ("maximize", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=flag):
            OffloadStreamAdamW([{"params": params, flag: True}])
    OffloadStreamAdamW(params, lr=0.0, betas=(0.0, 0.0), eps=0.0)  # the edges of the valid ranges
    weight = nn.Parameter(torch.randn(6))
    opt = OffloadStreamAdamW([weight])
    weight.grad = torch.randn(6).to_sparse()
    with pytest.raises(ValueError, match="sparse gradients"):
        opt.step()
    weight.grad = torch.randn(6)
    weight.data = torch.randn(2, 3)  # the gradient no longer has the parameter's shape
    with pytest.raises(ValueError, match=r"gradient shape \(6,\) != local parameter shape \(2, 3\)"):
        opt.step()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host_fraction", [0.0, 0.5])
def test_cuda_matches_torch_fused_adamw(dtype, host_fraction, monkeypatch):
    monkeypatch.setattr(host_update, "CHUNK", 6)
    seed = fresh_seed(41)
    ours_p = _params(seed, dtype, "cuda")
    ref_p = [nn.Parameter(p.detach().float().clone()) for p in ours_p]  # never alias ours
    opt = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=7, slots=2, host_fraction=host_fraction, piece_align=1)
    assert opt._host.is_pinned()
    ref = torch.optim.AdamW(_groups(ref_p), **HP, fused=True)
    steps = 5
    for step in range(steps):
        for p, q, g in zip(ours_p, ref_p, _grads(step, SHAPES, dtype, seed)):
            p.grad = None if g is None else g.cuda()
            q.grad = None if g is None else g.float().cuda()
        opt.step()
        ref.step()
    # The host share is updated by torch's CPU fused kernel, the reference by its CUDA one: each step's
    # update lr * m_hat / (sqrt(v_hat) + eps), at most about lr in size, is rounded differently by a few
    # ulps of lr (seen: 18 ulps of the master, 4.2e-9, over 5 steps at lr 2e-3), whatever the master's size.
    atol = ATOL if host_fraction == 0 else steps * 8 * HP["lr"] * torch.finfo(torch.float32).eps
    ours = opt.state_dict()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        assert_close(ours["state"][i]["master"], q, rtol=RTOL, atol=atol, name=f"master {i}")
        assert_bitwise_equal(p.detach(), ours["state"][i]["master"].cuda().to(dtype), name=f"weight {i}")
    _assert_state_close(ours, ref.state_dict())


@pytest.mark.gpu
def test_cuda_resume_is_exact():
    seed = fresh_seed(43)
    full_p = _params(seed, torch.bfloat16, "cuda")
    full = OffloadStreamAdamW(_groups(full_p), **HP, bucket_params=6, slots=3, piece_align=1)
    _run(full, full_p, 5, seed)
    first_p = _params(seed, torch.bfloat16, "cuda")
    first = OffloadStreamAdamW(_groups(first_p), **HP, bucket_params=6, slots=3, piece_align=1)
    _run(first, first_p, 3, seed)
    saved = {k: v for k, v in first.state_dict().items()}
    resumed = OffloadStreamAdamW(_groups(first_p), **HP, bucket_params=6, slots=2, piece_align=1)
    resumed.load_state_dict(saved)
    _run(resumed, first_p, 5, seed, start=3)
    _assert_same_run(full_p, full, first_p, resumed)


@pytest.mark.gpu
@pytest.mark.parametrize("host_fraction", [0.0, 0.5])
def test_cuda_staging_memory_within_bound(host_fraction):
    bucket, slots = 1 << 16, 2
    params = [nn.Parameter(torch.randn(1_000_003, device="cuda", dtype=torch.bfloat16))]
    params[0].grad = torch.randn_like(params[0])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = OffloadStreamAdamW(params, bucket_params=bucket, slots=slots, host_fraction=host_fraction, piece_align=1)
    assert opt.staging_bytes == staging_bytes_bound(bucket, slots)
    assert torch.cuda.memory_allocated() - before <= opt.staging_bytes + 512 * (slots + 1)  # block rounding
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    bound = staging_bytes_bound(bucket, slots, host_share=host_fraction > 0)
    assert torch.cuda.max_memory_allocated() - before <= bound + 4096


# ---- the CPU-updated share (host_update.py) and the page-locked host buffers on CUDA ----------------
_SLEEP = 1 << 29  # torch.cuda._sleep cycles: about 0.27 s at the H200's 1.98 GHz, 100x what step() takes


def _cuda_pair(seed: int, dtype, **kwargs):
    """Our optimizer on CUDA parameters and torch's fused AdamW on fp32 copies of them."""
    ours_p = _params(seed, dtype, "cuda")
    ref_p = [nn.Parameter(p.detach().float().clone()) for p in ours_p]  # never alias ours
    opt = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=7, slots=2, **kwargs, piece_align=1)
    return ours_p, opt, ref_p, torch.optim.AdamW(_groups(ref_p), **HP, fused=True)


def _assert_matches_fused(ours_p, opt, ref_p, ref):
    ours = opt.state_dict()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        assert_close(ours["state"][i]["master"], q, rtol=RTOL, atol=ATOL, name=f"master {i}")
        assert_bitwise_equal(p.detach(), ours["state"][i]["master"].cuda().to(p.dtype), name=f"weight {i}")
    _assert_state_close(ours, ref.state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [6, 1 << 20], ids=["chunks", "one-chunk"])
def test_cuda_host_share_waits_for_its_gradients(chunk, monkeypatch):
    """Gradients still being written on the compute stream when step() is called (behind a long
    kernel) are the ones the CPU share updates with: the downloads wait for the step's start, and
    the CPU waits for each chunk's downloads (several chunks, the first of one segment; or one)."""
    monkeypatch.setattr(host_update, "CHUNK", chunk)
    seed = fresh_seed(45)
    ours_p, opt, ref_p, ref = _cuda_pair(seed, torch.bfloat16, host_fraction=1.0)
    chunks = opt._host_update.chunks
    if chunk > 81:
        assert len(chunks) == 1
    else:  # 14 chunks; the first lies inside parameter 0
        assert len(chunks) == 14 and len(chunks[0].segments) == 1
    for step in range(4):
        grads = [None if g is None else g.cuda() for g in _grads(step, SHAPES, torch.bfloat16, seed)]
        for p, q, g in zip(ours_p, ref_p, grads):
            p.grad = None if g is None else (g * -2).add_(1)  # stale values until the kernel is done
            q.grad = None if g is None else g.float()
        torch.cuda._sleep(_SLEEP)
        for p, g in zip(ours_p, grads):
            if g is not None:
                p.grad.copy_(g)  # the final gradients, on the compute stream after the long kernel
        opt.step()
        ref.step()
    _assert_matches_fused(ours_p, opt, ref_p, ref)


@pytest.mark.gpu
def test_cuda_host_share_copies_on_its_own_streams_without_host_syncs(monkeypatch):
    """The CPU share on CUDA: step() never blocks the host on a copy (sync debug mode "error"); the
    downloads and uploads run on their own streams (they finish while the compute stream is still
    busy behind a long kernel queued after the step's start); when the uploads are held back, the
    compute stream still reads the new weights after step() and wait_for_writeback() waits for them;
    step_seconds() times the uploads (0 < it <= the wall time around step() on the compute stream)."""
    monkeypatch.setattr(host_update, "CHUNK", 6)
    seed = fresh_seed(47)
    ours_p, opt, ref_p, ref = _cuda_pair(seed, torch.float32, host_fraction=1.0)
    host, streams, compute = opt._host_update, opt._streams, torch.cuda.current_stream()
    download = host.download

    def download_behind_a_busy_compute_stream(*args):
        torch.cuda._sleep(_SLEEP)  # on the compute stream, after the step's start event
        download(*args)

    for step in range(5):
        for p, q, g in zip(ours_p, ref_p, _grads(step, SHAPES, torch.float32, seed)):
            p.grad = None if g is None else g.cuda()
            q.grad = None if g is None else g.cuda()
        if step == 1:
            host.download = download_behind_a_busy_compute_stream
        if step == 2:
            with torch.cuda.stream(streams.up):
                torch.cuda._sleep(_SLEEP)  # the uploads queue behind this
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        with no_host_syncs():
            opt.step()
        after.record()
        if step == 1:
            del host.download
            opt.wait_for_writeback()  # returns once the uploads are done
            assert not compute.query(), "the downloads or uploads waited for the compute stream's kernel"
        if step == 2:
            weights = [p.detach().clone() for p in ours_p]  # read on the compute stream right after step()
            opt.wait_for_writeback()
            assert streams.up.query(), "wait_for_writeback() returned while an upload was still queued"
            torch.cuda.synchronize()
            for i, (w, p) in enumerate(zip(weights, ours_p)):
                assert_bitwise_equal(w, p.detach(), name=f"weight {i} read after step()")
        after.synchronize()
        assert 0.0 < opt.step_seconds() <= before.elapsed_time(after) / 1e3
        ref.step()
    _assert_matches_fused(ours_p, opt, ref_p, ref)


@pytest.mark.gpu
def test_cuda_host_buffers_are_registered_until_released(monkeypatch):
    """Host buffers are page-locked (cudaHostRegister) while they are used and unregistered when
    released: directly, and the CPU share's gradient buffer once its HostUpdate is dropped (a new
    host_fraction); a refused registration raises, naming the bytes and the CUDA error."""
    import mmap

    from mop_train.ops.offload_adamw.buckets import (allocate_host_buffer, allocate_host_state, release_when_idle,
                                                     unregister_host_state)
    from mop_train.ops.offload_adamw.streams import Streams
    buffer, registered = allocate_host_buffer(5000, pin=True)
    assert registered and buffer.is_pinned()
    release_when_idle(buffer.data_ptr(), Streams(torch.device("cuda")))
    assert not buffer.is_pinned()
    state, registered = allocate_host_state(81, pin=True)
    assert registered and state.is_pinned() and state.shape == (3, 81)
    unregister_host_state(state.data_ptr())
    assert not state.is_pinned()

    params = _params(fresh_seed(53), torch.bfloat16, "cuda")
    opt = OffloadStreamAdamW(params, bucket_params=7, slots=2, host_fraction=0.5, piece_align=1)
    grads = opt._host_update._grad_views[0]  # keeps the old buffer's memory alive
    assert grads.is_pinned()
    opt.resize_staging(7, 2, host_fraction=0.25)  # drops the previous HostUpdate
    assert not grads.is_pinned()
    assert opt._host_update._grad_views[0].is_pinned()

    cudart = torch.cuda.cudart()

    class Refusing:
        def __getattr__(self, name):
            return getattr(cudart, name)

        @staticmethod
        def cudaHostRegister(ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", Refusing)
    span = -(-5000 // mmap.PAGESIZE) * mmap.PAGESIZE
    with pytest.raises(RuntimeError, match=rf"cudaHostRegister of {span} host bytes failed \(cudaError 2\); "
                                           "free host memory"):
        allocate_host_buffer(5000, pin=True)


@pytest.mark.gpu
def test_cuda_straddler_state_is_a_host_copy():
    """On CUDA, the state of the parameter that straddles the device share's end is a host copy of
    its two pieces (device head, host tail); wholly resident state stays a live view on the device."""
    seed = fresh_seed(49)
    ours_p, opt, ref_p, ref = _cuda_pair(seed, torch.float32, device_fraction=0.4)
    assert opt._dev_end == 32  # flat offsets 0, 15, 22, 23, 23, 56, 68: parameter 4 holds [23, 56)
    for step in range(3):
        for p, q, g in zip(ours_p, ref_p, _grads(step, SHAPES, torch.float32, seed)):
            p.grad = None if g is None else g.cuda()
            q.grad = None if g is None else g.cuda()
        opt.step()
        ref.step()
    state = opt.state_dict()["state"]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert state[4][key].device.type == "cpu", key
        assert state[0][key].is_cuda and state[6][key].device.type == "cpu", key
    _assert_matches_fused(ours_p, opt, ref_p, ref)
