"""Spawn gloo process groups on CPU for distributed tests.

    run_distributed(fn, world_size, *args)

runs `fn(rank, world_size, *args)` in `world_size` fresh processes that have joined one gloo
process group (the default group). Any exception in any rank fails the calling test with that
rank's traceback. `fn` must be a module-level function (it is pickled into the children).

Spawning costs a couple of seconds per call, so a test should run all its cases inside one
spawn rather than one spawn per case.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, error_queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        error_queue.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 300.0) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; re-raise the first failure."""
    ctx = mp.get_context("spawn")
    error_queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, error_queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not error_queue.empty():
        rank, tb = error_queue.get()
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} did not finish within {timeout_s}s (hang?)")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with non-zero codes: {bad}")
