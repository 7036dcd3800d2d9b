"""Run the real training loop inside a spawned gloo rank (tests.dist_utils.run_distributed), so one
spawn trains several cases of one world size instead of one torchrun start-up per case.

    stdout = train_here(folder, argv)          # in every rank of the spawn
    metrics = read_metrics(folder)             # tests.train.cli, in the test afterwards

`train_here` parses `argv` like `python -m mop_train.train` (load_job_config with the world's size)
and calls `mop_train.train.loop.train`, the function the CLI's `main` calls after it has joined the
process group; rank 0's stdout (the run's summary lines) is returned and kept in FOLDER/stdout.txt.
A checkpoint at step N, when one was written, is also converted to FOLDER/checkpoint/step-N.pt
(torch.save format) so the test can compare every tensor. Model: tests/train/test_offload_streaming.py's `_train`.
"""

from __future__ import annotations

import contextlib
import io
import os

import torch
import torch.distributed as dist


def train_here(folder: str, argv: list[str], *, convert_steps: tuple[int, ...] = ()) -> str:
    from mop_train.config import load_job_config  # (first: a CPU install has no triton; see optional_triton)
    from mop_train.models import zoo
    from mop_train.train.loop import train
    from mop_train.train.reliability import StopFlag
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    cfg = load_job_config([*argv, "--job.dump_folder", folder], model_flavors=zoo.names(),
                          world_size=dist.get_world_size())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(cfg, torch.device("cpu"), StopFlag())
    dist.barrier()
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        for step in convert_steps:
            ckpt = os.path.join(folder, "checkpoint", f"step-{step}")
            if os.path.isdir(ckpt) and not os.path.exists(ckpt + ".pt"):
                dcp_to_torch_save(ckpt, ckpt + ".pt")
        with open(os.path.join(folder, "stdout.txt"), "w") as f:
            f.write(out.getvalue())
    dist.barrier()
    return out.getvalue()


def final_model(folder: str, step: int) -> dict:
    """The model's state dict in FOLDER's step-`step` checkpoint (converted by `train_here`)."""
    state = torch.load(os.path.join(folder, "checkpoint", f"step-{step}.pt"), weights_only=False)
    return state.get("model", state)


def stdout_of(folder: str) -> str:
    with open(os.path.join(folder, "stdout.txt")) as f:
        return f.read()
