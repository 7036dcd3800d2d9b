"""The device memory plan against the GPU's memory before the first step (plan.terms.check_device_memory,
train.build._check_device_plan): refused above DEVICE_PLAN_REFUSED x the GPU (measured peaks have been
0.93-1.03x the plan), a warning between 1x and that, nothing below; the refusal can be turned into a
warning by its key, and says "out of memory" so that sweeps count such a point as one. The plan held to
the GPU is the one on paper, before the model is built: it must be the built run's, term by term."""

from __future__ import annotations

import random

import pytest
import torch

from mop_train.config import load_job_config
from mop_train.plan.terms import DEVICE_PLAN_REFUSED, GIB, check_device_memory
from mop_train.train.build import _check_device_plan
from mop_train.sweep import classify_failure
from tests.dist_utils import run_distributed
from tests.utils import fresh_seed

DEBUG_CONFIG = "configs/debug_cpu.toml"


def _terms(rng):
    names = ["parameters", "gradients", "optimizer", "block", "loss", "gathered"]
    return [(n, rng.randint(1, 40) * GIB // 4, "how") for n in names]


def test_fits_warns_and_refuses_by_the_plans_ratio_to_the_gpu():
    rng = random.Random(fresh_seed(7351))
    for _ in range(20):
        terms = _terms(rng)
        total = sum(b for _, b, _ in terms)
        assert check_device_memory(terms, capacity_bytes=total) is None                   # exactly fits
        assert check_device_memory(terms, capacity_bytes=total + rng.randint(1, GIB)) is None
        between = int(total / rng.uniform(1.0001, DEVICE_PLAN_REFUSED - 1e-4))
        warning = check_device_memory(terms, capacity_bytes=between)
        assert warning.startswith("warning: device memory") and "may run out of memory" in warning
        over = int(total / rng.uniform(DEVICE_PLAN_REFUSED + 1e-3, 4.0))
        with pytest.raises(ValueError) as refused:
            check_device_memory(terms, capacity_bytes=over)
        message = str(refused.value)
        largest = max(terms, key=lambda t: t[1])[0]
        for needle in (f"{total / GIB:.1f} GiB", f"{total / over:.2f}x", f"{over / GIB:.1f} GiB", largest,
                       "out of memory", "mop.reliability.refuse_over_memory_plan = false", "plan --auto"):
            assert needle in message, (needle, message)
        assert classify_failure(message)[0] == "oom"                # a sweep counts the refusal as out of memory
        assert check_device_memory(terms, capacity_bytes=over, refuse=False).startswith("warning: device memory")


def test_the_launch_check_follows_its_key_and_skips_a_cpu_device():
    terms = [("parameters", 30 * GIB, "how"), ("block", 20 * GIB, "how")]
    cfg = load_job_config(["--job.config_file", DEBUG_CONFIG])
    assert cfg.mop.reliability.refuse_over_memory_plan is True
    assert _check_device_plan(cfg, terms, torch.device("cpu")) is None          # no GPU memory to hold it to
    with pytest.raises(ValueError, match="would run out of memory"):
        _check_device_plan(cfg, terms, torch.device("cpu"), capacity_bytes=40 * GIB)
    assert "may run out of memory" in _check_device_plan(cfg, terms, torch.device("cpu"), capacity_bytes=48 * GIB)
    off = load_job_config(["--job.config_file", DEBUG_CONFIG, "--mop.reliability.no-refuse_over_memory_plan"])
    assert _check_device_plan(off, terms, torch.device("cpu"), capacity_bytes=40 * GIB).startswith("warning")


PAPER_VARIANTS = {
    "plain": [],
    "expert group, pipelined_llep": ["--mop.layout.expert_degree", "2", "--mop.moe.dispatch", "pipelined_llep"],
    "vocab group": ["--mop.layout.vocab_degree", "2"],
    "sequence group": ["--mop.layout.seq_degree", "2"],
    "streamed weights and gradients": ["--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.weights",
                                       "stream", "--mop.offload_adamw.gradients", "stream"],
    "sco, tiles, keep, no checkpointing": ["--mop.sco.host_budget", "1MiB", "--mop.tiling.ffn_tokens", "32",
                                           "--mop.attention.keep", "--activation_checkpoint.mode", "none"],
}


def _paper_against_built(rank, world, folder):
    from mop_train.models import zoo
    from mop_train.plan.job import plan_for_config, plan_from_parts
    from mop_train.train.build import build_run

    for name, extra in PAPER_VARIANTS.items():
        cfg = load_job_config(["--job.config_file", DEBUG_CONFIG, "--training.seq_len", "128", "--checkpoint.no-enable",
                               "--job.dump_folder", f"{folder}/{rank}", *extra], model_flavors=zoo.names())
        run = build_run(cfg, torch.device("cpu"))
        built, _ = plan_from_parts(cfg, run.layout.plan, run.parts, run.spec.args, run.spec.total_params)
        paper = plan_for_config(cfg, world=world, ranks_per_node=world, args=run.spec.args).device_terms
        assert [(n, b) for n, b, _ in paper] == [(n, b) for n, b, _ in built], name


def test_the_plan_on_paper_is_the_built_runs_plan(tmp_path):
    """The plan the ranks hold to the GPU before building the model (a meta model: `plan_for_config`, what
    `mop-train plan` prints) equals, term by term, the plan of the built parts the launch prints, across
    layouts and operators (gloo, W = 2)."""
    run_distributed(_paper_against_built, 2, str(tmp_path))
