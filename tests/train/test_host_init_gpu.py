"""[mop.offload_adamw] host_init on one CUDA device: the start-up's device bytes (torch.cuda.max_memory_allocated
from before `build_run` to its end) drop by the fp32 copy of every local parameter, less the largest piece
init_pieces_to_host holds at a time, and each parameter's value is on the host before the optimizer takes it.

The debug model widened (H = 512, 6 blocks, expert width 512: about 40M parameters, so 4 B x N is some
160 MiB against pieces of a few MiB), forced to per-shard initialisation (HOST_INIT_MAX_PARAMS = 0),
weights and gradients streamed, bf16 compute, NCCL at W=1. Passed on one H200 on 2026-12-02 (tree 7e5833c).
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace

import pytest
import torch

from tests.dist_utils import requires_gpus, run_distributed, worker_device
from tests.train.test_host_init import COMMON, LAYOUTS, STREAM

pytestmark = [pytest.mark.gpu, requires_gpus(1)]
SLACK = 32 * 2**20  # allocator rounding and the few small buffers built meanwhile


def _worker(rank, world, root):
    import mop_train.train.build as build
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    build.HOST_INIT_MAX_PARAMS = 0
    args = replace(zoo.get_model_args("debug"), dim=512, n_layers=6, moe_inter_dim=512, dense_ffn_dim=1536)
    device, peaks, seen = worker_device(), {}, {}
    original = build.build_optimizers

    def watched(parts, *a, **kw):  # where the values are when the optimizer takes them
        seen[key] = {p.to_local().device.type for p in parts[0].parameters()}
        return original(parts, *a, **kw)
    build.build_optimizers = watched
    for key in (False, True):
        cfg = load_job_config([*COMMON, *STREAM, *LAYOUTS[1], "--training.steps", "1", "--job.dump_folder",
                               os.path.join(root, str(key)), "--mop.offload_adamw." + ("host_init" if key else
                                                                                        "no-host_init")],
                              model_flavors=zoo.names())
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run = build.build_run(cfg, device, model_args=args)
        torch.cuda.synchronize()
        peaks[key] = torch.cuda.max_memory_allocated() - before
        locals_ = [p.to_local() for p in run.parts.module.parameters()]
        n = sum(t.numel() for t in locals_)
        pieces = [sum(p.to_local().numel() for p in piece.parameters())
                  for piece, _ in run.parts.model.init_pieces(buffer_device=device)]
        del run, locals_
    assert seen[True] == {"cpu"} and seen[False] == {device.type}, seen
    assert peaks[False] >= 4 * n, (peaks, n)
    saved = peaks[False] - peaks[True]
    assert saved >= 4 * n - 2 * 4 * max(pieces) - SLACK, (peaks, n, max(pieces))


def test_host_init_keeps_the_fp32_model_off_the_device_at_start_up(tmp_path):
    run_distributed(_worker, 1, str(tmp_path), backend="nccl", timeout_s=300)
