"""Spawn process groups for distributed tests: gloo ranks on CPU, or NCCL ranks on GPUs.

    run_distributed(fn, world_size, *args, backend="gloo")

runs `fn(rank, world_size, *args)` in `world_size` fresh processes that have joined one process
group (the default group) of `backend`. Under "nccl" rank r owns cuda:r (set as its current device).
Inside `fn`, `worker_device()` is the device its tensors belong on, so one worker serves both
backends. Any exception in any rank fails the calling test with that rank's traceback. `fn` must be
a module-level function (it is pickled into the children).

A test runs on both backends through `backend_params`: gloo at the world sizes it lists, NCCL at
2 GPUs under the `gpu` marker (skipped, with the reason, where fewer GPUs are present).

Ranks are forked from one fork server per test session that has imported torch, torchtitan and
mop_train (`PRELOAD`) and run nothing else (no threads, no process group, no CUDA): each rank then
starts as a spawned process would (fresh state, its own group; the caller's environment is handed
over), without paying those imports again, which were most of a rank's time on CI's 2 cores (about
12 s of CPU each). Starting ranks still costs, so a test should run all its cases inside one call
rather than one call per case.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mop_train  # noqa: F401  (spawned ranks import this module first: the triton stand-in before torchtitan)

BACKENDS = ("gloo", "nccl")
NCCL_WORLD_SIZE = 2  # the GPU test host has 2 GPUs

# Our GPU host's NVLink multicast (NVLS) is off limits; children inherit these unless already set.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def requires_gpus(n: int):
    """Skip marker for a test that needs `n` CUDA devices on this machine."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA devices; this machine has {have}")


def backend_params(world_sizes, nccl_world_size: int = NCCL_WORLD_SIZE) -> list:
    """pytest params (backend, world_size): gloo at each of `world_sizes`, and NCCL at
    `nccl_world_size` GPUs marked `gpu` (ids gloo-2, ..., nccl-2)."""
    params = [pytest.param("gloo", w, id=f"gloo-{w}") for w in world_sizes]
    params.append(pytest.param("nccl", nccl_world_size, id=f"nccl-{nccl_world_size}",
                               marks=(pytest.mark.gpu, requires_gpus(nccl_world_size))))
    return params


def worker_device() -> torch.device:
    """The device of this rank's tensors: its GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(backend: str, rank: int, world_size: int) -> None:
    if backend == "gloo":
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        return
    for key, value in _NCCL_ENV.items():
        os.environ.setdefault(key, value)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    # fp32 results are compared with fp32 references: no TF32 rounding in either.
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)


PRELOAD = ["mop_train", "torch.distributed.tensor", "torch.distributed.fsdp", "mop_train.config", "mop_train.train.build", "mop_train.train.loop",
           "mop_train.parallel.fake_world", "tests.utils",
           "tests.dist_utils"]
"""What the fork server imports once (module docstring); mop_train first, so that torchtitan finds its
triton stand-in on a CPU install (mop_train.optional_triton)."""


def rank_context(backend: str = "gloo"):
    """The multiprocessing context ranks start from: the fork server that has imported PRELOAD, or, for
    NCCL, a fresh interpreter per rank. Importing PRELOAD may initialise CUDA in the server (seen on the
    H200, 2026-12-01: "Cannot re-initialize CUDA in forked subprocess" at `torch.cuda.set_device`), and a
    forked child cannot use CUDA after that; GPU tests are few, so they pay for `spawn`."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (takes effect when the server starts: the first call's list)
    return ctx


def _worker(rank, world_size, port, backend, fn, args, error_queue, environ=None):
    if environ is not None:  # the caller's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        _init(backend, rank, world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        error_queue.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Every check passed and the group is gone: leave without interpreter finalization. There, gloo's
    # C++ worker threads can still be joinable while Python tears down, and the rank aborts with
    # "terminate called without an active exception" (exit -6; seen once in a CI run, 2026-12-01),
    # a failure of nothing under test. Failures above still raise and exit non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks of `backend`; re-raise the first failure."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"NCCL at world size {world_size} needs {world_size} CUDA devices, this machine has "
                         f"{torch.cuda.device_count()}; mark the test with requires_gpus({world_size})")
    ctx = rank_context(backend)
    error_queue = ctx.SimpleQueue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, error_queue, environ),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    # One deadline for the whole group (joining each rank for timeout_s in turn let a hung world of 4
    # run 4x over), and a failed rank ends the wait: the others are usually blocked in a collective
    # with it and would only run into the deadline.
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and error_queue.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
    failed_at = time.monotonic()
    if not error_queue.empty():
        for p in procs:
            p.join(min(5.0, max(0.0, deadline - time.monotonic())))  # a moment to report a second failure
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not error_queue.empty():
        rank, tb = error_queue.get()
        waited = time.monotonic() - failed_at
        late = f" (ranks {hung} were still running {waited:.0f} s after the failure and were killed)" if hung else ""
        raise AssertionError(f"rank {rank} of {world_size} ({backend}) failed{late}:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} ({backend}) did not finish within {timeout_s}s (hang?)")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with non-zero codes: {bad}")
