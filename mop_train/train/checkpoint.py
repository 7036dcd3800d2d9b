"""Distributed checkpoints (DCP) through torchtitan's CheckpointManager, resumable bit for bit.

    train_state = TrainState(rank)
    checkpointer = build_checkpointer(cfg.checkpoint, cfg.job.dump_folder, model=..., optimizers=...,
                                      lr_schedulers=..., dataloader=..., train_state=train_state,
                                      reliability=cfg.mop.reliability, device=device)
    checkpointer.load(step=cfg.checkpoint.load_step)   # resumes if {dump}/{folder}/step-N exists
    ...
    checkpointer.save(step, last_step=step == steps)

A checkpoint holds: the model (router biases included: they are persistent buffers), the
optimizer, the LR schedulers, every rank's dataloader position (sample index + token buffer),
and `train_state`: the step, the tokens seen, and every rank's RNG states (torch CPU, CUDA,
Python, NumPy), which torchtitan's own checkpoints leave out. Per-rank entries use per-rank keys,
so each rank writes and reads only its own.

`Checkpointer` wraps the manager with what it leaves out: a model or optimizer state holding a
NaN/inf is never saved (CheckpointError); a re-save into an existing step folder first removes
it; after each commit every file gets a checksum in `manifest.json` (`integrity`), and a load
verifies the one it takes (or falls back to an older verified one when asked) and then checks
the loaded state finite; `keep_latest_k` also holds after the last save.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager

from mop_train.train import integrity
from mop_train.train.reliability import CheckpointError, state_is_finite, tensors_of


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
        self.skipped_steps = 0   # non-finite steps that updated nothing

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64),
                "tokens_seen": torch.tensor(self.tokens_seen, dtype=torch.int64),
                "skipped_steps": torch.tensor(self.skipped_steps, dtype=torch.int64),
                f"rng_rank{self.rank}": pickle.dumps(capture_rng_state())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        key = f"rng_rank{self.rank}"
        if key not in state_dict:
            raise ValueError(f"the checkpoint holds no RNG state for rank {self.rank} (saved with fewer "
                             f"ranks?); resume with the world size it was saved with")
        restore_rng_state(pickle.loads(state_dict[key]))


def build_checkpointer(checkpoint, dump_folder: str, *, model: nn.Module, optimizers, lr_schedulers,
                       dataloader, train_state: TrainState, reliability, device: torch.device) -> "Checkpointer":
    """torchtitan's CheckpointManager over our states, wrapped in a `Checkpointer`.

    Args:
        checkpoint: the `[checkpoint]` section (enable, folder, interval, keep_latest_k, ...).
            `last_save_model_only = true` (torchtitan's default) saves only weights at the
            last step; set it to false for a checkpoint that can be resumed from.
        reliability: the `[mop.reliability]` section (resume_from_verified).
    """
    if checkpoint.last_save_in_hf:
        raise ValueError("checkpoint.last_save_in_hf = true needs a state-dict adapter, which mop_train "
                         "models do not have; set it to false")
    manager = CheckpointManager(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                checkpoint_config=checkpoint, sd_adapter=None, base_folder=dump_folder)
    return Checkpointer(manager, model=model, optimizers=optimizers, device=device,
                        fallback=reliability.resume_from_verified)


class Checkpointer:
    """torchtitan's CheckpointManager plus integrity: finite state only, checksummed, verified."""

    def __init__(self, manager: CheckpointManager, *, model: nn.Module, optimizers, device: torch.device,
                 fallback: bool):
        self.manager, self.model, self.optimizers, self.device = manager, model, optimizers, device
        self.fallback = fallback
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.note: str | None = None  # set by load when it fell back to an older checkpoint

    @property
    def folder(self) -> str:
        return self.manager.folder

    @property
    def enabled(self) -> bool:
        return self.manager.enable

    def _state_tensors(self) -> list:
        return tensors_of(self.model.state_dict()) + [
            t for opt in self.optimizers for st in opt.state.values() for t in tensors_of(st)]

    def load(self, step: int = -1) -> bool:
        """Resume from the verified checkpoint `step` (-1: the newest); False when there is none."""
        if not self.manager.enable or not os.path.isdir(self.folder):
            return self.manager.load(step=step)   # torchtitan's initial_load_path, if any
        chosen, self.note = integrity.choose_step(self.folder, step, fallback=self.fallback,
                                                  rank=self.rank, world=self.world)
        if chosen == -1:
            return False
        loaded = self.manager.load(step=chosen)
        if not state_is_finite(self._state_tensors(), self.device):
            raise CheckpointError(f"checkpoint {self.folder}/step-{chosen} passed its checksums but holds "
                                  f"NaN/inf in the model or optimizer state (saved before manifests "
                                  f"existed?); resume from an older step with --checkpoint.load_step")
        return loaded

    def save(self, step: int, *, last_step: bool = False, resumable: bool = False) -> bool:
        """Save when the interval, the last step or `resumable` (a full checkpoint now, whatever
        last_save_model_only says) asks; returns whether it saved."""
        m = self.manager
        if not (m._should_save(step, last_step) or (resumable and m.enable and not m.load_only)):
            return False
        if not state_is_finite(self._state_tensors(), self.device):
            raise CheckpointError(f"step {step}: the model or optimizer state holds NaN/inf; not saving it "
                                  f"(the newest checkpoint in {self.folder} is the last finite state)")
        folder = m._create_checkpoint_id(step)
        if self.rank == 0 and os.path.isdir(folder):  # a re-save: never leave old files beside new ones
            shutil.rmtree(folder)
        dist.barrier()
        model_only = m.last_save_model_only
        m.last_save_model_only = model_only and not resumable
        try:
            m.save(step, last_step=last_step or resumable)
        finally:
            m.last_save_model_only = model_only
        integrity.write_manifest(folder, rank=self.rank, world=self.world)
        if last_step or resumable:  # torchtitan's last-step save skips the purge
            m._purge_stale_checkpoints()
        return True

    def close(self) -> None:
        self.manager.close()   # joins the purge thread: keep_latest_k holds when this returns
