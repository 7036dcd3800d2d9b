"""[profiling]: torch.profiler traces of the steps profile_freq names (CPU and GPU), CUDA memory
snapshots at those steps and at an out-of-memory error (GPU), and the snapshot's refusal on CPU.

- The schedule against torch.profiler.schedule(wait, warmup, active) (torchtitan's) at our step numbers.
- A RunProfiler around labelled work (CPU): a Chrome trace per saved step, holding that step's work
  and torch.profiler's "ProfilerStep#N" label of it, and no other step's work.
- The training CLI on 2 gloo ranks (slow): one trace per rank of the named step; a memory snapshot
  asked for on CPU stops the run before it starts, saying it needs CUDA.
- GPU: snapshots at the named steps and on a real out-of-memory error, whose message names the file.
"""

from __future__ import annotations

import json
import os
import pickle
import random

import pytest
import torch
from torch.profiler import ProfilerAction
from torchtitan.config.job_config import Profiling

from mop_train.train.profiling import RunProfiler, profile_action
from tests.train.cli import DEBUG_CONFIG, check_ok, run_train
from tests.utils import fresh_seed


def test_schedule_records_the_steps_the_frequency_names():
    rng = random.Random(fresh_seed(9601))
    for _ in range(30):
        freq = rng.randint(1, 12)
        active = rng.randint(1, freq)
        warmup = rng.randint(0, freq - active)
        titan = torch.profiler.schedule(wait=freq - active - warmup, warmup=warmup, active=active)
        for step in range(1, 4 * freq + 1):
            ours = profile_action(step, freq=freq, warmup=warmup, active=active)
            assert ours == titan(step - 1), (freq, warmup, active, step)   # its index 0 is our step 1
            assert (ours == ProfilerAction.RECORD_AND_SAVE) == (step % freq == 0)


def _events(path: str) -> set[str]:
    with open(path) as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_trace_of_each_named_step_on_cpu(tmp_path):
    rng = random.Random(fresh_seed(9602))
    freq, warmup = rng.randint(2, 4), 1
    cfg = Profiling(enable_profiling=True, profile_freq=freq, profiler_warmup=warmup, profiler_active=1)
    prof = RunProfiler(cfg, str(tmp_path), rank=3, device=torch.device("cpu"))
    start, steps = rng.randint(0, 5), 2 * freq + 1
    x = torch.randn(64, 64)
    with prof.running(start_step=start):
        for step in range(start + 1, start + steps + 1):
            with torch.profiler.record_function(f"work of step {step}"):
                x = (x @ x).tanh()
            prof.step(step)
    saved = [s for s in range(start + 1, start + steps + 1) if s % freq == 0]
    folders = sorted(os.listdir(tmp_path / cfg.save_traces_folder))
    assert folders == sorted(f"iteration_{s}" for s in saved)
    for s in saved:
        names = _events(str(tmp_path / cfg.save_traces_folder / f"iteration_{s}" / "rank3_trace.json"))
        assert f"work of step {s}" in names and f"ProfilerStep#{s}" in names and "aten::mm" in names
        assert not any(n.startswith("work of step") and n != f"work of step {s}" for n in names), names


def test_memory_snapshot_is_refused_on_cpu(tmp_path):
    cfg = Profiling(enable_memory_snapshot=True)
    with pytest.raises(ValueError, match=r"profiling.enable_memory_snapshot = true needs CUDA .* on cpu; set it to false"):
        RunProfiler(cfg, str(tmp_path), rank=0, device=torch.device("cpu"))


@pytest.mark.slow
def test_training_cli_writes_a_trace_per_rank_and_refuses_a_cpu_snapshot(tmp_path):
    folder = str(tmp_path / "run")
    common = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--training.steps", "3",
              "--checkpoint.no-enable", "--metrics.no-enable-tensorboard"]
    proc = run_train([*common, "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                      "--profiling.profiler_warmup", "0", "--profiling.save_traces_folder", "traces"], nproc=2,
                     timeout=600)
    check_ok(proc)
    assert sorted(os.listdir(os.path.join(folder, "traces"))) == ["iteration_2"]
    for rank in (0, 1):
        names = _events(os.path.join(folder, "traces", "iteration_2", f"rank{rank}_trace.json"))
        assert "ProfilerStep#2" in names and "ProfilerStep#1" not in names and "aten::mm" in names
    # One plain process, so the exit code is the rank's own (torchrun reports a failed rank as 1).
    proc = run_train([*common, "--job.dump_folder", str(tmp_path / "snap"), "--profiling.enable_memory_snapshot"],
                     nproc=None, timeout=300)
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "snap" / "metrics.jsonl")       # stopped before any step


def _snapshot_ok(path: str) -> None:
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"]), "no allocator history"


@pytest.mark.gpu
def test_cuda_memory_snapshots_at_the_named_steps_and_at_out_of_memory(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=2, save_memory_snapshot_folder="snaps")
    prof = RunProfiler(cfg, str(tmp_path), rank=0, device=device)
    keep = []
    with pytest.raises(torch.OutOfMemoryError) as info:
        with prof.running(start_step=0):
            for step in (1, 2, 3):
                keep.append(torch.randn(1 << 20, device=device))
                prof.step(step)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=device)      # step 4 runs out of memory
    snaps = tmp_path / "snaps"
    assert sorted(os.listdir(snaps)) == ["iteration_2", "iteration_4_exit"]
    exit_file = str(snaps / "iteration_4_exit" / "rank0_memory_snapshot.pickle")
    assert exit_file in str(info.value) and "step 4" in str(info.value)
    for path in (str(snaps / "iteration_2" / "rank0_memory_snapshot.pickle"), exit_file):
        _snapshot_ok(path)


TOOLS = {"traces": ["--profiling.enable_profiling"], "snapshots": ["--profiling.enable_memory_snapshot"],
         "both": ["--profiling.enable_profiling", "--profiling.enable_memory_snapshot"]}


@pytest.mark.gpu
@pytest.mark.parametrize("tools", list(TOOLS))  # apart and together: the H200 run of both at 017e763 failed
def test_training_on_gpu_writes_snapshots_and_traces(tmp_path, tools):
    folder = str(tmp_path / "run")
    proc = run_train(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--training.steps", "2",
                      "--checkpoint.no-enable", "--metrics.no-enable-tensorboard", *TOOLS[tools],
                      "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "0"], nproc=1, timeout=600)
    check_ok(proc)
    if tools != "traces":
        _snapshot_ok(os.path.join(folder, "memory_snapshot", "iteration_2", "rank0_memory_snapshot.pickle"))
    if tools != "snapshots":
        names = _events(os.path.join(folder, "profile_traces", "iteration_2", "rank0_trace.json"))
        assert "ProfilerStep#2" in names
