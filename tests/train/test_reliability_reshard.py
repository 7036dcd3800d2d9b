"""Resharded resume: a checkpoint written at (W=4, D=2, E_p=4, P=2) resumes at (W=2, D=1, E_p=2, P=1)
and the reverse, continuing with the losses of a run that never changed layout (fp32 CPU, relative
1e-5), with OffloadStreamAdamW's host state and the data position carried over (both layouts read
W/D = 2 sequence groups of 2 sequences per step). Sequences of 64 tokens (32 per rank at D=2): the
layouts and the state carried over are the same at any length, and each step costs half of 128's."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close

pytestmark = pytest.mark.slow
COMMON = ["--job.config_file", DEBUG_CONFIG, "--training.local_batch_size", "2", "--training.seq_len", "64",
          "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", "--debug.seed", "11",
          "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
          "--checkpoint.no-last_save_model_only",
          "--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2",
          "--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.bucket_params", "40000",
          "--mop.moe.dispatch", "ep"]
WIDE = ["--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "4", "--mop.layout.vocab_degree", "2"]
NARROW = ["--mop.layout.expert_degree", "2"]


def _train(folder: str, steps: int, nproc: int, layout: list[str]) -> None:
    check_ok(run_train([*COMMON, *layout, "--training.steps", str(steps), "--job.dump_folder", folder],
                       nproc=nproc, timeout=300))


def _straight_worker(rank, world, folder):
    from tests.train.in_process import train_here

    train_here(folder, [*COMMON, *NARROW, "--training.steps", "6"])


def test_resume_at_another_layout(tmp_path):
    """The unchanged narrow run (1-6, checkpoints every 2 steps; the training function the CLI calls, in
    2 spawned ranks: tests/train/in_process.py); then two launches: from its step 2 the wide layout
    trains 3-4 and saves; from that step 4 the narrow layout trains 5-6. (Resuming from step 2 rather
    than 4 saves two steps of the straight run; step 2's checkpoint holds the same kinds of state as
    step 4's: OffloadStreamAdamW moments after updates, the data position, the LR step.)"""
    from tests.dist_utils import run_distributed

    straight, chain = str(tmp_path / "straight"), str(tmp_path / "chain")
    run_distributed(_straight_worker, 2, straight, timeout_s=300)
    ref = {r["step"]: r["loss"] for r in read_metrics(straight)}
    os.makedirs(os.path.join(chain, "checkpoint"))
    shutil.copytree(os.path.join(straight, "checkpoint", "step-2"), os.path.join(chain, "checkpoint", "step-2"))
    _train(chain, 4, 4, WIDE)             # written narrow, resumed wide
    _train(chain, 6, 2, NARROW)           # written wide, resumed narrow
    records = read_metrics(chain)
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    losses = torch.tensor([r["loss"] for r in records])
    assert_close(losses[:2], torch.tensor([ref[3], ref[4]]), rtol=1e-5, atol=0, name="W=2 -> W=4 losses")
    assert_close(losses[2:], torch.tensor([ref[5], ref[6]]), rtol=1e-5, atol=0, name="W=4 -> W=2 losses")
