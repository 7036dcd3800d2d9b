"""Resharded resume: a checkpoint written at (W=4, D=2, E_p=4, P=2) resumes at (W=2, D=1, E_p=2, P=1)
and the reverse, continuing with the losses of a run that never changed layout (fp32 CPU, relative
1e-5), with OffloadStreamAdamW's host state and the data position carried over (both layouts read
W/D = 2 sequence groups of 2 sequences per step)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close

pytestmark = pytest.mark.slow
COMMON = ["--job.config_file", DEBUG_CONFIG, "--training.local_batch_size", "2", "--training.seq_len", "128",
          "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", "--debug.seed", "11",
          "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.no-last_save_model_only",
          "--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2",
          "--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.bucket_params", "40000",
          "--mop.moe.dispatch", "ep"]
WIDE = ["--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "4", "--mop.layout.vocab_degree", "2"]
NARROW = ["--mop.layout.expert_degree", "2"]


def _train(folder: str, steps: int, nproc: int, layout: list[str]) -> None:
    check_ok(run_train([*COMMON, *layout, "--training.steps", str(steps), "--job.dump_folder", folder],
                       nproc=nproc, timeout=300))


def test_resume_at_another_layout(tmp_path):
    straight, shrunk, grown = (str(tmp_path / n) for n in ("straight", "shrunk", "grown"))
    _train(straight, 8, 2, NARROW)
    ref = torch.tensor([r["loss"] for r in read_metrics(straight)])
    _train(shrunk, 4, 4, WIDE)             # written wide, resumed narrow
    _train(shrunk, 8, 2, NARROW)
    os.makedirs(os.path.join(grown, "checkpoint"))   # written narrow (the straight run's step 4), resumed wide
    shutil.copytree(os.path.join(straight, "checkpoint", "step-4"), os.path.join(grown, "checkpoint", "step-4"))
    _train(grown, 8, 4, WIDE)
    shrunk_losses = torch.tensor([r["loss"] for r in read_metrics(shrunk)])
    grown_records = read_metrics(grown)
    assert [r["step"] for r in grown_records] == [5, 6, 7, 8]
    assert_close(shrunk_losses, ref, rtol=1e-5, atol=0, name="W=4 -> W=2 losses")
    assert_close(torch.tensor([r["loss"] for r in grown_records]), ref[4:], rtol=1e-5, atol=0,
                 name="W=2 -> W=4 losses")
