"""Distributed checkpoints (DCP) through torchtitan's CheckpointManager, resumable bit for bit.

    train_state = TrainState(rank)
    checkpointer = build_checkpointer(cfg.checkpoint, cfg.job.dump_folder, model=..., optimizers=...,
                                      lr_schedulers=..., dataloader=..., train_state=train_state)
    checkpointer.load(step=cfg.checkpoint.load_step)   # resumes if {dump}/{folder}/step-N exists
    ...
    checkpointer.save(step, last_step=step == steps)

A checkpoint holds: the model (router biases included: they are persistent buffers), the
optimizer, the LR schedulers, every rank's dataloader position (sample index + token buffer),
and `train_state`: the step, the tokens seen, and every rank's RNG states (torch CPU, CUDA,
Python, NumPy), which torchtitan's own checkpoints leave out. Per-rank entries use per-rank keys,
so each rank writes and reads only its own.
"""

from __future__ import annotations

import pickle
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device, Python `random`, NumPy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState(Stateful):
    """Step counter, tokens seen, and this rank's RNG states, as one checkpointable entry."""

    def __init__(self, rank: int):
        self.rank = rank
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64),
                "tokens_seen": torch.tensor(self.tokens_seen, dtype=torch.int64),
                f"rng_rank{self.rank}": pickle.dumps(capture_rng_state())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        key = f"rng_rank{self.rank}"
        if key not in state_dict:
            raise ValueError(f"the checkpoint holds no RNG state for rank {self.rank} (saved with fewer "
                             f"ranks?); resume with the world size it was saved with")
        restore_rng_state(pickle.loads(state_dict[key]))


def build_checkpointer(checkpoint, dump_folder: str, *, model: nn.Module, optimizers, lr_schedulers,
                       dataloader, train_state: TrainState) -> CheckpointManager:
    """torchtitan's CheckpointManager over our states.

    Args:
        checkpoint: the `[checkpoint]` section (enable, folder, interval, keep_latest_k, ...).
            `last_save_model_only = true` (torchtitan's default) saves only weights at the
            last step; set it to false for a checkpoint that can be resumed from.
    """
    if checkpoint.last_save_in_hf:
        raise ValueError("checkpoint.last_save_in_hf = true needs a state-dict adapter, which mop_train "
                         "models do not have; set it to false")
    return CheckpointManager(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, states={"train_state": train_state},
                             checkpoint_config=checkpoint, sd_adapter=None, base_folder=dump_folder)
