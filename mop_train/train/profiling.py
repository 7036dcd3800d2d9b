"""Profiler traces and CUDA memory snapshots ([profiling], torchtitan 0.2.2's keys).

    profiler = RunProfiler(cfg.profiling, cfg.job.dump_folder, rank=rank, device=device)  # checks first
    with profiler.running(start_step=s) as prof:
        for step in ...:
            ...                      # one training step, its logging, validation and checkpoint
            prof.step(step)          # at the end of each step

Traces (`enable_profiling`): torch.profiler records the last `profiler_active` steps of every
cycle of `profile_freq` steps, after `profiler_warmup` warm-up steps, so the step a multiple of
`profile_freq` names is recorded; each rank writes it as a Chrome trace (Perfetto and
chrome://tracing open it) to `<dump_folder>/<save_traces_folder>/iteration_<N>/rank<r>_trace.json`,
with CPU activity, plus CUDA kernels on a GPU. Its events carry torch.profiler's "ProfilerStep#<N>"
label of our step N.
Memory snapshots (`enable_memory_snapshot`, CUDA only): the caching allocator's history is
recorded from the start and dumped at every multiple of `profile_freq` to
`<dump_folder>/<save_memory_snapshot_folder>/iteration_<N>/rank<r>_memory_snapshot.pickle`
(open it at https://pytorch.org/memory_viz), and when anything in the steps raises
torch.OutOfMemoryError: then to `iteration_<N>_exit/` before the error goes on, re-raised with the
file's name in its message. On a CPU-only machine the snapshot is refused before the run starts.
While the history records, non-reentrant checkpoints recompute without early stopping
(`torch.utils.checkpoint.set_checkpoint_early_stop(False)`): early stopping ends a recompute by
raising from a saved-tensor hook inside an ATen op, and on one H200 (2026-12-01) with the history
recording that exception came out as "SystemError: <built-in function cross_entropy_loss> returned
NULL without setting an exception" in the loss's recompute (the likely cause: the allocator's
stack capture on the frees made while the op unwinds). Without early stop a recompute runs its
function to the end, which for our checkpointed functions (a block, one loss chunk) adds no saved
tensor; `benchmarks/snapshot_repro.py` checks the cause apart from the loop (not yet run on a GPU).

torchtitan's `tools/profiling.py` (maybe_enable_profiling, maybe_enable_memory_snapshot) is the
model, with the same folders and file names; the code is ours (one object, the step numbers ours).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept by the memory history (torchtitan's figure): older ones are dropped."""


def profile_action(step: int, *, freq: int, warmup: int, active: int) -> ProfilerAction:
    """What torch.profiler does during our step `step` (1-based): record the last `active` steps of
    each cycle of `freq` steps, saving at the multiple of `freq`, after `warmup` steps."""
    phase = step % freq                          # 0: the step that ends a cycle
    if phase == 0:
        return ProfilerAction.RECORD_AND_SAVE
    if phase > freq - active:
        return ProfilerAction.RECORD
    if phase > freq - active - warmup:
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


class RunProfiler:
    """The [profiling] tools of one rank; `step(n)` after each step (see the module docstring)."""

    def __init__(self, profiling, dump_folder: str, *, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = profiling, rank, device
        self.trace_dir = os.path.join(dump_folder, profiling.save_traces_folder)
        self.snapshot_dir = os.path.join(dump_folder, profiling.save_memory_snapshot_folder)
        self.last_step = 0                       # the last step completed
        self.torch_profiler = None
        self._held = contextlib.ExitStack()      # the checkpoint setting held while the history records
        if profiling.enable_memory_snapshot and device.type != "cuda":
            raise ValueError(f"profiling.enable_memory_snapshot = true needs CUDA (it records the CUDA caching "
                             f"allocator's history), but this run is on {device.type}; set it to false "
                             f"(profiling.enable_profiling's traces work on CPU)")

    def start(self) -> None:
        if self.cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._held.enter_context(torch.utils.checkpoint.set_checkpoint_early_stop(False))
        if self.cfg.enable_profiling:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            p = self.cfg
            self.torch_profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, on_trace_ready=self._save_trace,
                schedule=lambda s: profile_action(s, freq=p.profile_freq, warmup=p.profiler_warmup,
                                                  active=p.profiler_active))
            # Its schedule and its "ProfilerStep#" labels count our steps (it would start at 0).
            self.torch_profiler.step_num = self.last_step + 1
            self.torch_profiler.current_action = self.torch_profiler.schedule(self.last_step + 1)
            self.torch_profiler.start()

    def step(self, step: int) -> None:
        """Step `step` is done (its logging, validation and checkpoint included)."""
        self.last_step = step
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if self.cfg.enable_memory_snapshot and step % self.cfg.profile_freq == 0:
            self.dump_snapshot(f"iteration_{step}")

    def stop(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.on_trace_ready = None   # a cycle cut short by the end of the run: not saved
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
        self._held.close()

    def dump_snapshot(self, folder: str) -> str:
        """Write the allocator's snapshot (with its recorded history) and return the file's path."""
        path = os.path.join(self.snapshot_dir, folder, f"rank{self.rank}_memory_snapshot.pickle")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        return path

    def _save_trace(self, prof) -> None:
        step = prof.step_num - 1                 # called by the step() that ended the saved step
        path = os.path.join(self.trace_dir, f"iteration_{step}", f"rank{self.rank}_trace.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        begin = time.perf_counter()
        prof.export_chrome_trace(path)
        if self.rank == 0:
            print(f"profiler trace of step {step}: {path} ({time.perf_counter() - begin:.1f} s to write)", flush=True)


    @contextlib.contextmanager
    def running(self, start_step: int = 0):
        """Started for the steps inside the block (the run resumes after `start_step`), stopped after
        them. An out-of-memory error inside dumps the memory snapshot (with enable_memory_snapshot)
        and is re-raised naming its file."""
        self.last_step = start_step
        self.start()
        try:
            yield self
        except torch.OutOfMemoryError as err:
            if not self.cfg.enable_memory_snapshot:
                raise
            step = self.last_step + 1
            path = self.dump_snapshot(f"iteration_{step}_exit")
            raise torch.OutOfMemoryError(f"rank {self.rank}, step {step}: {err}\nmemory snapshot of this rank at "
                                         f"the error: {path} (open it at https://pytorch.org/memory_viz)") from err
        finally:
            self.stop()
