"""OffloadStreamAdamW's device-resident share (device_fraction) against torch.optim.AdamW: values and
state at every split (tensors straddling the device/streamed/CPU boundaries), resume across splits,
DCP, FSDP2 at 2 ranks, and the "auto" share (fit_device_fraction)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from mop_train.ops.offload_adamw import (
    AUTO_MARGIN_BYTES, OffloadStreamAdamW, fit_device_fraction, forward_order, forward_units, host_update, reference_adamw,
    staging_bytes_bound)
from mop_train.train.optim import resolve_device_fraction
from mop_train.units import parse_device_fraction
from tests.dist_utils import run_distributed
from tests.ops.test_offload_adamw import (
    ATOL, HP, RTOL, SHAPES, _assert_same_run, _assert_state_close, _give_grads, _grads, _groups, _lambda, _params, _run, _Tiny,
    _train, dcp_resume_matches_straight_run)
from tests.utils import assert_bitwise_equal, assert_close, fresh_seed

NUMELS = [torch.Size(s).numel() for s in SHAPES]


def _straddles(boundary: int) -> bool:
    """Some parameter has elements on both sides of flat position `boundary`."""
    start = 0
    for n in NUMELS:
        if start < boundary < start + n:
            return True
        start += n
    return False


def _train_with_torch(dtype, seed, **kwargs):
    ours_p = _params(seed, dtype)
    ref_p = [nn.Parameter(p.detach().float().clone()) for p in ours_p]
    opt = OffloadStreamAdamW(_groups(ours_p), **HP, **kwargs, piece_align=1)
    ref = reference_adamw(_groups(ref_p), **HP)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _lambda) for o in (opt, ref)]
    for step in range(5):
        _give_grads(ours_p, ref_p, step, dtype, seed)
        opt.step()
        ref.step()
        for sched in scheds:
            sched.step()
    return ours_p, opt, ref_p, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_fraction,host_fraction", [(0.25, 0.0), (0.25, 0.4), (0.5, 0.4), (1.0, 0.0),
                                                           (0.6, 1.0)])
def test_device_share_matches_fp32_adamw(dtype, device_fraction, host_fraction, monkeypatch):
    """Masters and moments follow fp32 AdamW at every split; the working weights are the masters in
    their dtype; on CPU every split gives the same bits as streaming everything."""
    monkeypatch.setattr(host_update, "CHUNK", 6)  # several CPU chunks, tensors split across them
    seed = fresh_seed(71 + int(100 * device_fraction) + int(10 * host_fraction) + (dtype == torch.bfloat16))
    kwargs = dict(bucket_params=7, slots=2, host_fraction=host_fraction, device_fraction=device_fraction)
    ours_p, opt, ref_p, ref = _train_with_torch(dtype, seed, **kwargs)
    total = sum(NUMELS)
    n_dev = round(device_fraction * total)
    n_host = round(host_fraction * (total - n_dev))
    assert device_fraction == 1.0 or _straddles(n_dev)
    assert host_fraction in (0.0, 1.0) or _straddles(total - n_host)  # a tensor on both sides of each boundary
    ours = opt.state_dict()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        master = ours["state"][i]["master"]
        assert_close(master, q, rtol=RTOL, atol=ATOL, name=f"master {i}")
        assert_bitwise_equal(p.detach(), master.to(dtype), name=f"weight {i}")
    _assert_state_close(ours, ref.state_dict())
    assert opt.last_step.device_updated_elements == n_dev
    assert opt.last_step.host_updated_elements == n_host
    streamed = total - n_dev - n_host
    assert opt.last_step.h2d_bytes - 4 * len(ours_p) == opt.last_step.d2h_bytes == 12 * streamed + 4 * n_host
    assert opt.device_state_bytes == (8 if dtype == torch.float32 else 12) * n_dev
    plain_p, plain, _, _ = _train_with_torch(dtype, seed, bucket_params=7, slots=2)
    _assert_same_run(plain_p, plain, ours_p, opt)


def test_resume_across_splits_is_exact(monkeypatch, tmp_path):
    """Saved at one (device, host) split, resumed at another: the same bits as a straight run (on
    CPU every path runs the same kernel; on CUDA the same holds while host_fraction is 0)."""
    monkeypatch.setattr(host_update, "CHUNK", 5)
    seed = fresh_seed(81)
    first_kwargs = dict(**HP, bucket_params=6, slots=2, device_fraction=0.3, host_fraction=0.4)
    full_p = _params(seed, torch.bfloat16)
    full = OffloadStreamAdamW(_groups(full_p), **first_kwargs, piece_align=1)
    _run(full, full_p, 5, seed)
    first_p = _params(seed, torch.bfloat16)
    first = OffloadStreamAdamW(_groups(first_p), **first_kwargs, piece_align=1)
    _run(first, first_p, 3, seed)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed_p = _params(seed + 1, torch.bfloat16)
    for p, q in zip(resumed_p, first_p):
        p.data.copy_(q)
    resumed = OffloadStreamAdamW(_groups(resumed_p), **dict(first_kwargs, device_fraction=0.65, host_fraction=0.0,
                                                            bucket_params=4, slots=3), piece_align=1)
    resumed.load_state_dict(torch.load(buf))
    _run(resumed, resumed_p, 5, seed, start=3)
    _assert_same_run(full_p, full, resumed_p, resumed)


def test_device_share_resumes_through_dcp(tmp_path):
    kwargs = dict(**HP, bucket_params=4, slots=2, device_fraction=0.4)
    dcp_resume_matches_straight_run(tmp_path, kwargs, dict(kwargs, device_fraction=0.8))


def test_state_dict_holds_live_views_except_the_straddler():
    """state_dict() entries are views of the state (later steps show in them) for parameters wholly on
    the device or wholly on the host, a copy for the one straddling N_d; editing the returned dict does
    not edit the optimizer's own `state`."""
    params = _params(23)
    opt = OffloadStreamAdamW(params, **HP, bucket_params=5, device_fraction=0.4, piece_align=1)
    boundary = opt._dev_end
    assert _straddles(boundary) and 0 < boundary < sum(NUMELS)
    gen = torch.Generator().manual_seed(fresh_seed(29))

    def step():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    step()
    saved = opt.state_dict()
    before = {i: {k: v.clone() for k, v in entry.items()} for i, entry in saved["state"].items()}
    step()
    now = opt.state_dict()["state"]
    start = 0
    for i, n in enumerate(NUMELS):
        expected = before[i] if start < boundary < start + n else now[i]  # the straddler: a copy
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert_bitwise_equal(saved["state"][i][key], expected[key], name=f"param {i} {key}")
        start += n
    latest = opt.state_dict()
    latest["state"][0].pop("exp_avg")
    assert "exp_avg" in opt.state[params[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_fraction,host_fraction", [(0.0, 0.0), (0.5, 0.0), (0.5, 0.3), (1.0, 0.0),
                                                           (0.0, 0.3), (0.3, 1.0)])
def test_state_dict_holds_detached_tensors(dtype, device_fraction, host_fraction, monkeypatch):
    """A state dict holds detached tensors, like torch.optim.AdamW's (issue 32, item 6): with a device
    share, "master" was an autograd view of the fp32 parameter (grad_fn=ViewBackward0), which
    copy.deepcopy refuses. Two groups, values changed after construction, 4 steps; the deep copy holds
    the same bits as the state."""
    import copy
    monkeypatch.setattr(host_update, "CHUNK", 6)
    seed = fresh_seed(97 + int(10 * device_fraction) + int(100 * host_fraction))
    params = _params(seed, dtype)
    opt = OffloadStreamAdamW(_groups(params), **HP, bucket_params=5, slots=2, device_fraction=device_fraction,
                             host_fraction=host_fraction, piece_align=1)
    with torch.no_grad():
        for p in params:
            p.mul_(1.5)
    opt.reset_masters_from_params()
    _run(opt, params, 4, seed)
    state = opt.state_dict()
    for i, entry in state["state"].items():
        for key, value in entry.items():
            assert not value.requires_grad and value.grad_fn is None, (i, key, value.grad_fn)
    copied = copy.deepcopy(state)
    for i, entry in state["state"].items():
        for key, value in entry.items():
            assert_bitwise_equal(copied["state"][i][key], value, name=f"param {i} {key}")
    assert copied["param_groups"] == state["param_groups"]


def _fsdp2_share_worker(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from mop_train.train.optim import build_optimizers
    mesh = init_device_mesh("cpu", (world_size,))
    section = SimpleNamespace(bucket_params=3, slots=2, host_fraction=0.5, device_fraction=0.4, overlap=True)
    optimizer = SimpleNamespace(name="OffloadStreamAdamW", lr=HP["lr"], beta1=HP["betas"][0],
                                beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])

    def build(seed, share=None):
        model = _Tiny(seed)
        for layer in (model.a, model.b, model.c):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if share is None:
            from torchtitan.components.optimizer import OptimizersContainer
            return model, OptimizersContainer([model], torch.optim.AdamW, dict(**HP, foreach=False))
        cfg = SimpleNamespace(**dict(vars(section), device_fraction=share))
        return model, build_optimizers([model], optimizer, cfg, piece_align=1)

    full, full_opt = build(0, 0.4)  # device-resident, streamed and CPU-updated parts, forward order, overlap
    ref, ref_opt = build(0)
    _train(full, full_opt, 5, rank=rank)
    _train(ref, ref_opt, 5, rank=rank)
    for (name, p), q in zip(full.named_parameters(), ref.parameters()):
        assert_close(p.to_local(), q.to_local(), rtol=RTOL, atol=ATOL, name=f"rank {rank} {name}")
    ours_opt = full_opt.optimizers[0]
    ours_sd = get_optimizer_state_dict(full, ours_opt)
    ref_sd = get_optimizer_state_dict(ref, ref_opt.optimizers[0])
    for key, entry in ref_sd["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            local = entry[name].to_local()
            scale = float(local.abs().max()) if local.numel() else 0.0
            assert_close(ours_sd["state"][key][name].to_local(), local, rtol=RTOL, atol=RTOL * scale + ATOL,
                         name=f"rank {rank} {key} {name}")
        assert ours_sd["state"][key]["exp_avg"].placements == entry["exp_avg"].placements
    assert ours_opt.last_step.device_updated_elements > 0 and ours_opt.last_step.host_updated_elements > 0
    waits = ours_opt.forward_waits  # a unit that prefetches another's all-gather waits for its pieces too
    full.a.set_modules_to_forward_prefetch([full.c])  # (b's 1-row weight leaves rank 1 nothing of b)
    assert waits._prefetched_ranges(full.a) == waits._ranges_of[full.c] and waits._ranges_of[full.c]
    assert waits._prefetched_ranges(full.c) == [] and full not in waits._ranges_of  # the root owns none
    full.c.set_modules_to_forward_prefetch([full.b])  # rank 1 holds nothing of b: no ranges, nothing to wait for
    assert waits._prefetched_ranges(full.c) == waits._ranges_of.get(full.b, [])
    pre, pre_opt = build(3, 0.4)  # ... and makes those waits in its own pre-forward
    _train(pre, pre_opt, 1, rank=rank)
    pre_waits, done_at_a = pre_opt.optimizers[0].forward_waits, []
    pre.a.set_modules_to_forward_prefetch([pre.c])
    pre.a.register_forward_pre_hook(lambda mod, args: done_at_a.append(list(pre_waits._done)))  # after ours
    pre(torch.randn(4, 5))
    for lo, hi in pre_waits._ranges_of.get(pre.c, []):
        for lane, pieces in enumerate(pre_waits._lanes):
            hit = [j for j, r in enumerate(pieces) if r.lo < hi and r.hi > lo]
            assert not hit or max(hit) <= done_at_a[0][lane], (rank, lane, hit, done_at_a)
    root = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))  # a root unit with parameters of its own:
    fully_shard(root[0], mesh=mesh)                                      # its wait runs before FSDP2's lazy init
    fully_shard(root, mesh=mesh)
    root_opt = OffloadStreamAdamW(forward_order(root), **HP, bucket_params=3, overlap=True, piece_align=1)
    root_opt.wait_in_forward(forward_units(root))
    root(torch.randn(4, 5)).square().sum().backward()
    root_opt.step()
    root(torch.randn(4, 5))
    assert root_opt.forward_waits.log and not root_opt.forward_waits.pending()

    first, first_opt = build(0, 0.4)
    _train(first, first_opt, 3, rank=rank)
    dcp.save({"model": get_model_state_dict(first), "optimizer": first_opt}, checkpoint_id=path)
    resumed, resumed_opt = build(1, 0.7)
    target = {"model": get_model_state_dict(resumed), "optimizer": resumed_opt}
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(resumed, target["model"])
    _train(resumed, resumed_opt, 5, start=3, rank=rank)
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert_bitwise_equal(p.to_local(), q.to_local(), name=f"rank {rank} {name}")

    full_osd = get_optimizer_state_dict(full, ours_opt, options=StateDictOptions(full_state_dict=True))
    fresh, fresh_opt = build(2, 0.2)
    set_optimizer_state_dict(fresh, fresh_opt.optimizers[0], full_osd, options=StateDictOptions(full_state_dict=True))
    a_sd, b_sd = get_optimizer_state_dict(full, ours_opt), get_optimizer_state_dict(fresh, fresh_opt.optimizers[0])
    for key in a_sd["state"]:
        for name in ("exp_avg_sq", "master"):
            assert_bitwise_equal(a_sd["state"][key][name].to_local(), b_sd["state"][key][name].to_local(),
                                 name=f"full load {key} {name}")


@pytest.mark.slow
def test_fsdp2_device_share_two_ranks(tmp_path):
    run_distributed(_fsdp2_share_worker, 2, str(tmp_path))


def test_fit_device_fraction():
    n, bucket, slots = 1000, 100, 3
    staging = staging_bytes_bound(bucket, slots)
    margin = AUTO_MARGIN_BYTES
    fit = dict(bucket_params=bucket, slots=slots)
    assert fit_device_fraction(margin + 8 * n + 4 * bucket, n, fp32_weights=True, **fit) == 1.0
    assert fit_device_fraction(margin + 12 * n + 4 * bucket, n, fp32_weights=False, **fit) == 1.0
    assert fit_device_fraction(margin + 12 * n + 4 * bucket - 1, n, fp32_weights=False, **fit) < 1.0
    assert fit_device_fraction(margin + staging + 8 * n // 4, n, fp32_weights=True, **fit) == 0.25
    assert fit_device_fraction(margin + staging + 12 * n // 2, n, fp32_weights=False, **fit) == 0.5
    assert fit_device_fraction(margin + staging + 8 * 333, n, fp32_weights=True, **fit) == 0.333
    assert fit_device_fraction(margin + staging - 1, n, fp32_weights=True, **fit) == 0.0
    assert fit_device_fraction(0, n, fp32_weights=True, **fit) == 0.0
    assert fit_device_fraction(staging + 8 * n // 2, n, fp32_weights=True, margin_bytes=0, **fit) == 0.5
    assert fit_device_fraction(staging + 8 * n // 2, n, fp32_weights=True, margin_bytes=0, host_share=True,
                               **fit) == 0.0  # the CPU share's cast temporaries (32 MiB) do not fit
    gen = torch.Generator().manual_seed(fresh_seed(91))
    for _ in range(20):  # the share it returns fits, and 1/1000 more would not
        free = int(torch.randint(0, 1 << 20, (1,), generator=gen)) + margin + staging
        d = fit_device_fraction(free, n, fp32_weights=True, **fit)
        assert margin + staging + 8 * d * n <= free or d == 1.0
        assert d == 1.0 or margin + staging + 8 * (d + 0.001) * n > free


def test_resolve_device_fraction_and_bad_values():
    section = SimpleNamespace(bucket_params=100, slots=2, host_fraction=0.0, device_fraction="auto")
    free = AUTO_MARGIN_BYTES + staging_bytes_bound(100, 2) + 8 * 500
    assert resolve_device_fraction(section, local_numel=1000, fp32_weights=True, free_device_bytes=free) == 0.5
    with pytest.raises(ValueError, match="auto"):
        resolve_device_fraction(section, local_numel=1000, fp32_weights=True, free_device_bytes=None)
    assert resolve_device_fraction(SimpleNamespace(device_fraction="0.25"), local_numel=1, fp32_weights=True,
                                   free_device_bytes=None) == 0.25
    assert parse_device_fraction(" AUTO ") == "auto" and parse_device_fraction(1) == 1.0
    for bad in ("x", 1.5, -0.1, True, None):
        with pytest.raises(ValueError, match="device_fraction"):
            parse_device_fraction(bad)
    params = _params(6)
    for bad, match in ((1.5, r"device_fraction \(1.5\)"), ("auto", r"device_fraction \('auto'\)"),
                       (True, r"device_fraction \(True\)")):
        with pytest.raises(ValueError, match=match):
            OffloadStreamAdamW(params, device_fraction=bad, piece_align=1)
    with pytest.raises(ValueError, match="overlap"):
        OffloadStreamAdamW(params, overlap=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_fraction,host_fraction", [(0.3, 0.0), (0.3, 0.5), (1.0, 0.0)])
def test_cuda_device_share_matches_torch_fused_adamw(dtype, device_fraction, host_fraction, monkeypatch):
    monkeypatch.setattr(host_update, "CHUNK", 6)
    seed = fresh_seed(61)
    runs = {}
    for share in (0.0, device_fraction):
        ours_p = _params(seed, dtype, "cuda")
        ref_p = [nn.Parameter(p.detach().float().clone()) for p in ours_p]  # never alias ours
        opt = OffloadStreamAdamW(_groups(ours_p), **HP, bucket_params=7, slots=2, host_fraction=host_fraction,
                                 device_fraction=share, piece_align=1)
        ref = torch.optim.AdamW(_groups(ref_p), **HP, fused=True)
        for step in range(5):
            for p, q, g in zip(ours_p, ref_p, _grads(step, SHAPES, dtype, seed)):
                p.grad = None if g is None else g.cuda()
                q.grad = None if g is None else g.float().cuda()
            opt.step()
            ref.step()
        runs[share] = (ours_p, opt)
    ours = opt.state_dict()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        assert_close(ours["state"][i]["master"], q, rtol=RTOL, atol=ATOL, name=f"master {i}")
        assert_bitwise_equal(p.detach(), ours["state"][i]["master"].cuda().to(dtype), name=f"weight {i}")
    _assert_state_close(ours, ref.state_dict())
    if host_fraction == 0.0:  # device-resident or streamed: the same CUDA kernel, the same bits
        _assert_same_run(*runs[0.0], *runs[device_fraction])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_device_share_memory(dtype):
    bucket, slots, n = 1 << 16, 2, 1_000_003
    params = [nn.Parameter(torch.randn(n, device="cuda", dtype=dtype))]
    params[0].grad = torch.randn_like(params[0])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = OffloadStreamAdamW(params, bucket_params=bucket, slots=slots, device_fraction=0.5, piece_align=1)
    n_dev = round(0.5 * n)
    assert opt.device_state_bytes == (8 if dtype == torch.float32 else 12) * n_dev
    held = torch.cuda.memory_allocated() - before
    # Alone this is exact to 512-byte rounding (240 B over, H200 2026-11-30); after the rest of the
    # GPU suite, 190 KB more were live that the optimizer does not hold (allocator state of earlier
    # tests). 1 MiB of slack still fails on any extra staging slot or state copy (>= 1.8 MB here).
    assert held <= opt.staging_bytes + opt.device_state_bytes + (1 << 20)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    bound = staging_bytes_bound(bucket, slots) + opt.device_state_bytes
    # Alone within 4 KiB of the bound (H200, 2026-11-30); after the rest of the GPU suite 583 KB over,
    # not explained yet (the same order-dependent excess as the construction check above). The slack
    # stays below one staging slot (786 KB here), so an extra slot or a state copy still fails.
    assert torch.cuda.max_memory_allocated() - before < bound + 3 * bucket * 4
    free = AUTO_MARGIN_BYTES + staging_bytes_bound(bucket, slots) + opt.device_state_bytes
    assert fit_device_fraction(free, n, fp32_weights=dtype == torch.float32, bucket_params=bucket,
                               slots=slots) >= 0.499


def test_build_optimizers_forward_order_and_plan_line():
    from mop_train.train.optim import build_optimizers, describe_offload, free_device_bytes
    model = _Tiny(5)
    section = SimpleNamespace(bucket_params=4, slots=3, host_fraction=0.0, device_fraction="auto", overlap=False)
    optimizer = SimpleNamespace(name="OffloadStreamAdamW", lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="auto"):
        build_optimizers([model], optimizer, section)
    numel = sum(p.numel() for p in model.parameters())
    free = AUTO_MARGIN_BYTES + staging_bytes_bound(4, 3) + 8 * numel // 2
    share = resolve_device_fraction(section, local_numel=numel, fp32_weights=True, free_device_bytes=free)
    container = build_optimizers([model], optimizer, section, device_fraction=share, piece_align=1)
    opt = container.optimizers[0]
    assert opt.device_fraction == 0.5 and opt.device_state_bytes == 8 * round(0.5 * numel)
    assert free_device_bytes([("parameters", 10, ""), ("gradients", 10, "")], "cpu") == 0
    line = describe_offload(container, free_device_bytes=free)
    assert "device_fraction 0.500 (auto:" in line and "4 x 3 slots" in line and "overlap with the next forward off" in line


def test_plan_line_says_when_streaming_moves_what_the_device_already_holds():
    from mop_train.train.optim import _describe_streaming
    for share, hinted in ((1.0, True), (0.999, False), (0.0, False)):
        line = _describe_streaming(SimpleNamespace(weights="stream", gradients="stream", working=None,
                                                   device_fraction=share))
        assert line.startswith("; weights stream, gradients stream")
        assert ("every master is on the device" in line) == hinted, (share, line)
    assert _describe_streaming(SimpleNamespace(weights="device", gradients="device", device_fraction=1.0)) == ""
