"""Distributed checkpoints (DCP) through torchtitan's CheckpointManager, resumable bit for bit.

    train_state = TrainState(rank)
    checkpointer = build_checkpointer(cfg.checkpoint, cfg.job.dump_folder, model=..., optimizers=...,
                                      lr_schedulers=..., dataloader=..., train_state=train_state,
                                      reliability=cfg.mop.reliability, device=device)
    checkpointer.load(step=cfg.checkpoint.load_step)   # resumes if {dump}/{folder}/step-N exists
    batches = iter(dataloader)                         # draws a seed from the torch CPU generator
    train_state.restore_rng()                          # the loaded RNG states, after every start-up draw
    ...
    checkpointer.save(step, last_step=step == steps)

A checkpoint holds: the model (router biases included: they are persistent buffers), the
optimizer, the LR schedulers, every rank's dataloader position (sample index + token buffer),
and `train_state`: the step, the tokens seen, and every rank's RNG states (torch CPU, CUDA,
Python, NumPy), which torchtitan's own checkpoints leave out. Per-rank entries use per-rank keys,
so each rank writes and reads only its own. The loaded RNG states are applied by
`TrainState.restore_rng()`, which the loop calls after the last draw of its start-up (the
dataloader iterator's seed), so the steps after a resume draw what an uninterrupted run's draw.

Nothing in a checkpoint runs code on load: non-tensor entries load with `weights_only=True`, the
RNG states are tensors, and the dataloader's pickled state is checked to be plain data first.
`Checkpointer` wraps the manager with what it leaves out: a model or optimizer state holding a
NaN/inf is never saved (CheckpointError); a re-save into an existing step folder first removes
it; after each commit every file gets a checksum in `manifest.json` (`integrity`), and a load
skips newer saves that were cut short (no manifest: set aside, said in one line), verifies the
one it takes (or falls back to an older verified one when asked) and then checks the loaded state
finite; `keep_latest_k` also holds after the last save.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager

from mop_train.hf.load import load_hf_weights
from mop_train.train import integrity
from mop_train.train.device_count import DeviceCount
from mop_train.train.optim import wait_for_weights
from mop_train.train.reliability import CheckpointError, state_is_finite, tensors_of


def capture_rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors (nothing to unpickle on load): torch CPU, every CUDA
    device, Python `random` (version, 625 words, gauss), NumPy (624 words, pos, gauss)."""
    version, words, gauss = random.getstate()
    _, np_words, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": torch.tensor([version, *words], dtype=torch.int64),
             "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
             "numpy": torch.from_numpy(np_words.astype(np.int64)),
             "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
             "numpy_gauss": torch.tensor(cached, dtype=torch.float64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), gauss if has_gauss else None))
    pos, np_has_gauss = state["numpy_pos"].tolist()
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), pos, np_has_gauss,
                         float(state["numpy_gauss"])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise CheckpointError(f"the checkpoint's dataloader state refers to {module}.{name}; only plain data "
                              f"(dicts, lists, numbers, strings) is accepted, nothing that runs code on load")


class SafeDataloaderState(Stateful):
    """The dataloader as a checkpoint entry whose pickled per-rank state (torchtitan's format) is
    checked to be plain data before torchtitan unpickles it."""

    def __init__(self, dataloader):
        self.dataloader = dataloader

    def state_dict(self) -> dict[str, Any]:
        return self.dataloader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            if isinstance(value, bytes):
                _PlainData(io.BytesIO(value)).load()
        self.dataloader.load_state_dict(state_dict)


def missing_key(text: str) -> str | None:
    """The state-dict key a DCP load found missing from the checkpoint, from its CheckpointException's
    text (every rank's traceback), or None. The traceback's source line `raise RuntimeError(f"Missing
    key in checkpoint state_dict: {fqn}.")` matches the message's pattern too: it is passed over."""
    found = re.findall(r"Missing key in checkpoint state_dict: (\S+?)\.?$", text, re.M)
    return next((key for key in found if not re.search(r"[{}\"']", key)), None)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries load with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _weights_only_dcp_load(manager: CheckpointManager):
    """torchtitan's `dcp_load` with the weights-only planner (DCP), or our HF import (from_hf)."""
    def dcp_load(state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:  # [checkpoint] initial_load_in_hf: Hugging Face DeepseekV3 safetensors (mop_train.hf.load)
            return load_hf_weights(manager.states["model"], state_dict, checkpoint_id)
        dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=WeightsOnlyLoadPlanner())
        manager.states["model"].load_state_dict(state_dict)
    return dcp_load


class TrainState(Stateful):
    """Step counter, tokens seen, and this rank's RNG states, as one checkpointable entry. Tokens are
    counted on the device (`tokens.add`, mop_train.train.device_count) and read when logged or saved."""

    def __init__(self, rank: int):
        self.rank = rank
        self.step = 0
        self.tokens = DeviceCount()
        self.skipped_steps = 0   # non-finite steps that updated nothing
        self.rng_source = rank   # whose saved RNG state a load takes (another when the world shrank/grew)
        self.loaded_rng: dict[str, torch.Tensor] | None = None   # applied by restore_rng()

    @property
    def tokens_seen(self) -> int:
        return self.tokens.value

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self.tokens.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64),
                "tokens_seen": torch.tensor(self.tokens_seen, dtype=torch.int64),
                "skipped_steps": torch.tensor(self.skipped_steps, dtype=torch.int64),
                f"rng_rank{self.rng_source}": capture_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        key = f"rng_rank{self.rng_source}"
        self.rng_source = self.rank
        if key not in state_dict:
            raise ValueError(f"the checkpoint holds no RNG state for rank {self.rank} (saved with fewer "
                             f"ranks?); resume with the world size it was saved with")
        if not isinstance(state_dict[key], dict):
            raise CheckpointError(f"the checkpoint keeps rank {self.rank}'s RNG state pickled (written before "
                                  f"issue 19); it is not unpickled (arbitrary code); resume with the commit "
                                  f"that wrote it or start afresh")
        self.loaded_rng = dict(state_dict[key])

    def restore_rng(self) -> None:
        """Apply the RNG states a load brought (no-op without one). Call it after everything that
        draws at start-up and before the first step: the saved states are those after step N's
        draws, and the start-up draws happen again on resume."""
        if self.loaded_rng is not None:
            restore_rng_state(self.loaded_rng)
            self.loaded_rng = None


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
        raise ValueError("checkpoint.last_save_in_hf = true is not implemented (no in-run HF save); set it "
                         "to false and run `mop-train export` on the saved checkpoint")
    manager = CheckpointManager(dataloader=SafeDataloaderState(dataloader), model_parts=[model],
                                optimizers=optimizers, lr_schedulers=lr_schedulers,
                                states={"train_state": train_state}, checkpoint_config=checkpoint,
                                sd_adapter=None, base_folder=dump_folder)
    manager.dcp_load = _weights_only_dcp_load(manager)
    return Checkpointer(manager, model=model, optimizers=optimizers, device=device,
                        fallback=reliability.resume_from_verified)


class Checkpointer:
    """torchtitan's CheckpointManager plus integrity: finite state only, checksummed, verified."""

    def __init__(self, manager: CheckpointManager, *, model: nn.Module, optimizers, device: torch.device,
                 fallback: bool):
        self.manager, self.model, self.optimizers, self.device = manager, model, optimizers, device
        self.fallback = fallback
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.note: str | None = None  # set by load: saves it skipped, or the fallback it took
        self.last_saved: str | None = None  # the newest complete checkpoint of this run (loaded or saved)

    @property
    def folder(self) -> str:
        return self.manager.folder

    @property
    def enabled(self) -> bool:
        return self.manager.enable

    def _state_tensors(self) -> list:
        # state_dict(), not .state: OffloadStreamAdamW refreshes its host rows into it there
        return tensors_of(self.model.state_dict()) + [
            t for opt in self.optimizers for t in tensors_of(opt.state_dict()["state"])]

    def load(self, step: int = -1) -> bool:
        """Resume from the verified checkpoint `step` (-1: the newest); False when there is none."""
        if not self.manager.enable or not os.path.isdir(self.folder):
            return self.manager.load(step=step)   # torchtitan's initial_load_path, if any
        resume = integrity.choose_step(self.folder, step, fallback=self.fallback, rank=self.rank,
                                       world=self.world)
        chosen, notes = resume.step, [resume.note] if resume.note else []
        if resume.incomplete:
            moved = integrity.set_aside(self.folder, resume.incomplete, rank=self.rank, world=self.world)
            notes.insert(0, integrity.describe_skipped(self.folder, resume.incomplete, moved, chosen))
        if resume.superseded:   # a roll-back: the abandoned history's newer checkpoints out of the next resume's way
            moved = integrity.set_aside(self.folder, resume.superseded, rank=self.rank, world=self.world,
                                        name=integrity.SUPERSEDED)
            notes.append(integrity.describe_superseded(self.folder, resume.superseded, moved, chosen))
        self.note = "\n".join(notes) or None
        if chosen == -1:
            return False
        self._match_saved_world(os.path.join(self.folder, f"step-{chosen}"))
        try:
            loaded = self.manager.load(step=chosen)
        except CheckpointException as err:   # a BaseException, with every rank's traceback in its text
            missing = missing_key(str(err))
            if missing is None:
                raise
            raise ValueError(f"checkpoint {self.folder}/step-{chosen} does not fit this run: it has no "
                             f"{missing!r}, which this run's state has; resume with the model "
                             f"flavor and optimizer it was written with") from None
        if not state_is_finite(self._state_tensors(), self.device):
            raise CheckpointError(f"checkpoint {self.folder}/step-{chosen} passed its checksums but holds "
                                  f"NaN/inf in the model or optimizer state (saved before manifests "
                                  f"existed?); resume from an older step with --checkpoint.load_step",
                                  agreed=True)
        self.last_saved = os.path.join(self.folder, f"step-{chosen}")
        return loaded

    def _match_saved_world(self, folder: str) -> None:
        """A checkpoint saved at another world size: rank r takes the RNG state of saved rank
        r mod W_saved; the number of sequence groups (W/D, the dataloader's ranks) must match."""
        keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        self._match_saved_optimizer(folder, keys)
        saved = sorted({int(m.group(1)) for k in keys if (m := re.match(r"train_state\.rng_rank(\d+)\.", k))})
        state = self.manager.states.get("train_state")
        if saved and state is not None and self.rank not in saved:
            state.rng_source = saved[self.rank % len(saved)]
        readers = {k for k in keys if re.match(r"dataloader\.dp_rank_\d+$", k)}
        loader = getattr(self.manager.states.get("dataloader"), "dataloader", None)
        now = getattr(loader, "dp_world_size", None)
        if readers and now is not None and len(readers) != now:
            raise ValueError(f"checkpoint {folder} was written by {len(readers)} sequence groups (W/D) and this "
                             f"run has {now}; the data position cannot be split differently: resume with "
                             f"W / mop.layout.seq_degree = {len(readers)}")

    def _match_saved_optimizer(self, folder: str, keys) -> None:
        """OffloadStreamAdamW's state holds an fp32 "master" per parameter beside the moments and its
        param groups lack torch's flags (amsgrad, foreach, ...): DCP cannot load one optimizer's state
        into the other (it raised "Missing key in checkpoint state_dict: optimizer....", a
        BaseException with every rank's traceback). Refuse by name, on every rank alike (the keys
        are the checkpoint's .metadata)."""
        state = [k for k in keys if k.startswith("optimizer.state.")]
        if not state:
            return   # a model-only checkpoint: no optimizer state to carry over
        saved_offload = any(k.endswith(".master") for k in state)
        offload = [hasattr(opt, "reset_masters_from_params") for opt in self.optimizers]
        if not offload or all(offload) == saved_offload:
            return
        from mop_train.ops.offload_adamw import OFFLOAD_ADAMW
        saved = OFFLOAD_ADAMW if saved_offload else "AdamW or Adam (torchtitan's)"
        now = OFFLOAD_ADAMW if all(offload) else "AdamW or Adam (torchtitan's)"
        back = OFFLOAD_ADAMW if saved_offload else "AdamW or Adam, as it had"
        raise ValueError(f"checkpoint {folder} holds the optimizer state of optimizer.name = {saved} and this run "
                         f"uses {now}: that state cannot be loaded into this optimizer ({OFFLOAD_ADAMW} keeps an "
                         f"fp32 master beside each parameter's moments, the others do not); resume with the "
                         f"optimizer that wrote it (--optimizer.name {back}), or start a run in another --job.dump_folder from its "
                         f"weights alone (fresh moments) with --checkpoint.initial_load_path {folder} "
                         f"--checkpoint.initial_load_model_only")

    def save(self, step: int, *, last_step: bool = False, resumable: bool = False) -> bool:
        """Save when the interval, the last step or `resumable` (a full checkpoint now, whatever
        last_save_model_only says) asks; returns whether it saved."""
        m = self.manager
        if not (m._should_save(step, last_step) or (resumable and m.enable and not m.load_only)):
            return False
        wait_for_weights(self.optimizers)
        if not state_is_finite(self._state_tensors(), self.device):
            raise CheckpointError(f"step {step}: the model or optimizer state holds NaN/inf; not saving it "
                                  f"(the newest checkpoint in {self.folder} is the last finite state)",
                                  agreed=True)
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
        if not (m.last_save_model_only and last_step and not resumable):
            self.last_saved = folder   # a model-only last save cannot be resumed from
        if last_step or resumable:  # torchtitan's last-step save skips the purge
            m._purge_stale_checkpoints()
        return True

    def close(self) -> None:
        self.manager.close()   # joins the purge thread: keep_latest_k holds when this returns
