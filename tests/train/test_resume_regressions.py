"""Resume regressions found by an adversarial probe of checkpoint / resume (CPU, 2 gloo ranks).

A checkpoint written by AdamW, resumed with optimizer.name = OffloadStreamAdamW (and the reverse),
met DCP's "Missing key in checkpoint state_dict: optimizer.state....master" (resp. "...param_groups
....amsgrad") inside a CheckpointException, a BaseException carrying every rank's traceback, which
the CLI's error handling does not catch (a traceback and exit 1, not one line). It is now refused by
name before anything loads (ValueError, exit 2): the checkpoint, both optimizers, and what to do.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG

pytestmark = pytest.mark.slow
BASE = ["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
        "--debug.seed", "5", "--training.seq_len", "64", "--training.local_batch_size", "1",
        "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.no-last_save_model_only", "--lr_scheduler.total_steps", "4",
        "--lr_scheduler.warmup_steps", "1"]
OFFLOAD = ["--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.bucket_params", "3000"]
ADAMW = ["--optimizer.name", "AdamW"]


def _train(folder: str, args: list[str], steps: int) -> None:
    import torch
    import torch.distributed as dist

    from mop_train.config import load_job_config  # (first: a CPU install has no triton; see optional_triton)
    from mop_train.models import zoo
    from mop_train.train.loop import train
    from mop_train.train.reliability import StopFlag
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    cfg = load_job_config([*BASE, *args, "--training.steps", str(steps), "--job.dump_folder", folder],
                          model_flavors=zoo.names(), world_size=dist.get_world_size())
    train(cfg, torch.device("cpu"), StopFlag())


def _cross_optimizer_worker(rank, world, root):
    import torch.distributed as dist

    for wrote, resumes in ((ADAMW, OFFLOAD), (OFFLOAD, ADAMW)):
        source, folder = os.path.join(root, f"{wrote[1]}"), os.path.join(root, f"{wrote[1]}-into-{resumes[1]}")
        _train(source, wrote, 1)
        if rank == 0:
            os.makedirs(os.path.join(folder, "checkpoint"))
            shutil.copytree(os.path.join(source, "checkpoint", "step-1"), os.path.join(folder, "checkpoint", "step-1"))
        dist.barrier()
        with pytest.raises(ValueError) as err:
            _train(folder, resumes, 2)
        text = str(err.value)
        assert os.path.join(folder, "checkpoint", "step-1") in text, text
        assert "OffloadStreamAdamW" in text and "AdamW or Adam" in text, text
        assert "--optimizer.name" in text and "--checkpoint.initial_load_path" in text, text
        dist.barrier()


def test_resume_into_the_other_optimizer_is_refused_by_name(tmp_path):
    run_distributed(_cross_optimizer_worker, 2, str(tmp_path), timeout_s=300)


def _lowered_lr_worker(rank, world, root, factor, decay):
    import contextlib
    import io
    import json

    def records(folder):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            return {r["step"]: r for r in map(json.loads, f)}

    straight, resumed = os.path.join(root, "straight"), os.path.join(root, "resumed")
    _train(straight, ADAMW, 3)
    _train(resumed, ADAMW, 2)
    lowered = ["--optimizer.lr", repr(3e-3 * factor), "--optimizer.weight_decay", repr(decay)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _train(resumed, [*ADAMW, *lowered], 3)
    if rank == 0:
        want, got = records(straight), records(resumed)
        assert (got[2]["lr"], got[2]["loss"]) == (want[2]["lr"], want[2]["loss"])
        assert abs(got[3]["lr"] - factor * want[3]["lr"]) <= 1e-12 * want[3]["lr"], (got[3]["lr"], want[3]["lr"])
        assert got[3]["loss"] == want[3]["loss"]   # step 3's forward ran on step 2's weights, as before
        text = out.getvalue()
        assert f"optimizer.lr = {3e-3 * factor:g} replaces the checkpoint's 0.003" in text, text
        assert f"optimizer.weight_decay = {decay} replaces the checkpoint's 0.1" in text, text


def test_a_resume_takes_the_configured_lr_not_the_checkpoints(tmp_path):
    """torch's optimizer load_state_dict restores each param group's lr and weight_decay, and torchtitan's
    scheduler its base_lrs: a run resumed with a lowered --optimizer.lr (the advice a diverging run is given)
    trained on at the saved lr, while the schedule's shape followed the config. The configured values now
    apply from the next step, at the schedule's position, and the launch says so."""
    import random

    from tests.utils import fresh_seed

    rng = random.Random(fresh_seed(7100))
    run_distributed(_lowered_lr_worker, 1, str(tmp_path), rng.uniform(0.2, 0.8), round(rng.uniform(0.01, 0.09), 3),
                    timeout_s=300)
