"""Steps of the debug model with OffloadStreamAdamW driven in process through the loop's `train_step`,
so that tests can reach the run's parts (its optimizer, weight windows, gradient stream) between steps.

    cfg = offload_config(folder, weights="stream", gradients="stream")
    run = build_run(cfg, device)
    losses = drive(cfg, run, device, steps=2)

Used by tests/train/test_offload_streaming_gpu.py (one CUDA device); offload_config also by
tests/train/test_offload_link_bytes.py (CPU, gloo). Call inside a process group (tests.dist_utils.run_distributed).
"""

from __future__ import annotations

import contextlib

import torch

import mop_train  # noqa: F401  (before torchtitan: a CPU install has no triton)

from tests.train.cli import DEBUG_CONFIG

BASE = ["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
        "--mop.moe.dispatch", "ep", "--checkpoint.no-enable", "--lr_scheduler.total_steps", "3",
        "--lr_scheduler.warmup_steps", "1", "--optimizer.name", "OffloadStreamAdamW",
        "--mop.offload_adamw.bucket_params", "3000", "--training.mixed_precision_param", "bfloat16"]
"""The debug model at W=1: B=2 x 64 tokens, two micro-batches per step (global batch 4), experts kept
out of FSDP2 (dispatch "ep"), every block checkpointed (the config's mode "full"), bf16 compute."""


def offload_config(folder: str, *, weights: str, gradients: str, window: int = 2, steps: int = 3,
                   seed: int = 17, extra: tuple = ()):
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    return load_job_config([*BASE, "--mop.offload_adamw.weights", weights, "--mop.offload_adamw.gradients",
                            gradients, "--mop.offload_adamw.weight_window", str(window), "--debug.seed", str(seed),
                            "--training.steps", str(steps), "--job.dump_folder", folder, *extra],
                           model_flavors=zoo.names())


def drive(cfg, run, device: torch.device, steps: int, *, around_step=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` optimizer steps of `run` as mop_train.train.loop.run_steps takes them (no logging,
    no checkpoints); returns each step's (loss, gradient norm), 0-dim fp32 on the device.
    `around_step(step)`: a context manager entered around each step's `train_step`."""
    from mop_train.train.loop import StepGuards, train_step
    from mop_train.train.reliability import NonFiniteGuard, StopFlag
    guards = StepGuards(NonFiniteGuard(cfg.mop.reliability, rank=0, world=1, device=device,
                                       last_checkpoint=lambda: None), StopFlag(), run.schedule_steps)
    batches = iter(run.dataloader)
    run.train_state.restore_rng()
    results = []
    for step in range(1, steps + 1):
        micro = [next(batches) for _ in range(run.micro_batches)]
        with around_step(step) if around_step is not None else contextlib.nullcontext():
            out = train_step(run.parts, run.layout, micro, run.optimizers, run.lr_schedulers,
                             max_norm=cfg.training.max_norm, bias_rate=cfg.mop.moe.bias_update_rate, device=device,
                             eos_id=run.eos_id, guards=guards, step=step)
        assert not out["verdict"].skip, f"step {step} was skipped (non-finite)"
        results.append((out["loss_sum"] / out["n_tokens"], out["grad_norm"]))
    return results
