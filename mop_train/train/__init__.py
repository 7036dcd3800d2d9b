"""The mop_train training loop (torchrun entry point: `python -m mop_train.train`).

    torchrun --standalone --nproc_per_node=2 -m mop_train.train --job.config_file configs/debug_cpu.toml

Modules: loop (the steps), data (offline tokenizer + packed dataloader), loss (chunked
cross-entropy), parallelize (activation checkpointing + FSDP2), optim (optimizers, LR schedule),
checkpoint (DCP with RNG and train state), integrity (checksum manifests of checkpoints),
reliability (non-finite steps, clean stops, exit codes, the dump-folder lock), metrics (console,
jsonl, TensorBoard, W&B), plan (the pre-launch per-rank memory estimate).
"""

from mop_train.train.loop import main

__all__ = ["main"]
