"""OffloadStreamAdamW.stage_ahead ([mop.offload_adamw] stage_in_backward): the first `slots` buckets'
masters and moments copied in before the gradients exist give the same bits as staging them in the step,
whatever happens between the staging and the step: a skipped step, a second call, a state load (which
must drop what was staged from the state it replaces), a re-cut of the buckets; with a device share,
bf16 working weights and streamed-style host working copies. On CUDA (marked gpu): the same, with
the staging queued before a backward that runs while the copies are in flight."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from mop_train.ops.offload_adamw import OffloadStreamAdamW
from tests.ops.test_offload_adamw import HP, _assert_same_run
from tests.utils import fresh_seed


def _net(seed: int, device="cpu") -> nn.Module:
    torch.manual_seed(fresh_seed(seed))
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 3)).to(device)


def _loss(model, step: int, seed: int, device):
    gen = torch.Generator().manual_seed(fresh_seed(seed * 100 + step))
    x = torch.randn(4, 7, generator=gen).to(device)
    return model(x).square().sum()


def _run(seed: int, *, staged: bool, steps: int = 4, device="cpu", skip_at: int | None = None,
         reload_at: int | None = None, recut_at: int | None = None, **kwargs):
    """Train `steps` steps; with `staged`, stage_ahead before every backward (twice at step 1). At
    `skip_at` the step has no gradients (a skipped step); at `reload_at` the optimizer is reloaded from
    its own state dict after staging; at `recut_at` the buckets are re-cut after staging."""
    model = _net(seed, device)
    opt = OffloadStreamAdamW(list(model.parameters()), **HP, piece_align=1, **kwargs)
    for step in range(steps):
        opt.zero_grad()
        if staged:
            opt.stage_ahead()
            if step == 1:
                opt.stage_ahead()           # a second call before the step: a no-op
        if step == reload_at:
            opt.load_state_dict(opt.state_dict())
        if step == recut_at:
            opt.resize_staging(opt.bucket_params + 17, opt.slots + 1)
        if step != skip_at:
            _loss(model, step, seed, device).backward()
        opt.step()
    return list(model.parameters()), opt


SETTINGS = [dict(bucket_params=20, slots=2), dict(bucket_params=33, slots=3, device_fraction=0.3),
            dict(bucket_params=16, slots=1), dict(bucket_params=10_000, slots=2)]


@pytest.mark.parametrize("kwargs", SETTINGS, ids=["many-buckets", "device-share", "one-slot", "one-bucket"])
def test_staged_is_bitwise_unstaged(kwargs):
    seed = fresh_seed(11)
    rng = random.Random(seed)
    events = dict(skip_at=rng.choice([None, 1, 2]), reload_at=rng.choice([None, 2, 3]), recut_at=rng.choice([None, 3]))
    plain = _run(seed, staged=False, **events, **kwargs)
    staged = _run(seed, staged=True, **events, **kwargs)
    _assert_same_run(*plain, *staged)


def test_a_load_after_staging_takes_the_loaded_state():
    """Staged from state A, loaded with state B before the step: the step must update B, not A."""
    seed = fresh_seed(12)
    model_a, opt_a = _run(seed, staged=False, steps=2, bucket_params=20, slots=3)
    model_b, opt_b = _run(seed + 1, staged=False, steps=3, bucket_params=20, slots=3)
    other = opt_b.state_dict()
    reference = _net(seed + 2)
    ref_opt = OffloadStreamAdamW(list(reference.parameters()), **HP, piece_align=1, bucket_params=20, slots=3)
    ref_opt.load_state_dict(other)
    opt_a.stage_ahead()                     # staged from A ...
    opt_a.load_state_dict(other)            # ... then B loaded
    for model, opt in ((model_a, opt_a), (reference.parameters(), ref_opt)):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p, q in zip(list(model), model_b):
                p.copy_(q)
                p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    ref = list(reference.parameters())
    _assert_same_run(list(model_a), opt_a, ref, ref_opt)


def test_stage_in_backward_must_be_a_bool():
    with pytest.raises(ValueError, match=r"stage_in_backward \('yes'\) must be true or false"):
        OffloadStreamAdamW(list(_net(1).parameters()), stage_in_backward="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kwargs", SETTINGS[:2], ids=["many-buckets", "device-share"])
def test_cuda_staged_during_backward_is_bitwise_unstaged(kwargs):
    """The staging is queued on the h2d stream and the backward launched right after it, on CUDA."""
    seed = fresh_seed(13)
    plain = _run(seed, staged=False, device="cuda", **kwargs)
    staged = _run(seed, staged=True, device="cuda", **kwargs)
    torch.cuda.synchronize()
    _assert_same_run(*plain, *staged)


def test_masters_reset_after_staging_are_the_ones_the_step_updates():
    """reset_masters_from_params between stage_ahead and step (weights loaded without optimizer state): the
    step must read the reset masters, as an unstaged step does (found by a probe: it used the staged ones)."""
    seed = fresh_seed(14)
    runs = []
    for staged in (False, True):
        model = _net(seed)
        opt = OffloadStreamAdamW(list(model.parameters()), **HP, piece_align=1, bucket_params=20, slots=2)
        for step in range(3):
            opt.zero_grad()
            if staged:
                opt.stage_ahead()
            if step == 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
                opt.reset_masters_from_params()
            _loss(model, step, seed, "cpu").backward()
            opt.step()
        runs.append((list(model.parameters()), opt))
    _assert_same_run(*runs[0], *runs[1])
