"""FSDP2's gradient reduction as `apply_fsdp` configures it (mop_train/parallel/parallelize.py): gradients are
summed over ranks, and with a world of one nothing divides them.

torch 2.11-2.13's `foreach_reduce` divides each unit's fp32 gradients by a set gradient divide factor even at
world size 1 (`reduce_scatter_input / factor` into a temporary, then a copy): with factor 1.0 that is a kernel
and one unit's gradients of memory per unit for the same values. The test runs a real training step of the
debug model at W=1 (bf16 compute, gloo) and counts every division of a gradient-sized fp32 tensor by one
during it; the step must still train (finite, positive loss).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG

DIVISIONS = {torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar, torch.ops.aten.div_.Tensor,
             torch.ops.aten.div_.Scalar}


class DivisionsByOne(TorchDispatchMode):
    """Counts divisions of fp32 tensors of at least `min_numel` elements by exactly one."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.count = min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in DIVISIONS and len(args) > 1:
            x, divisor = args[0], args[1]
            if isinstance(divisor, torch.Tensor) and divisor.numel() == 1:
                divisor = divisor.item()
            if (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.numel() >= self.min_numel
                    and isinstance(divisor, (int, float)) and divisor == 1):
                self.count += 1
        return func(*args, **(kwargs or {}))


def _worker(rank, world, root):
    import torch.distributed as dist

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.train.build import build_run
    from tests.train.offload_steps import drive
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")

    seed = int(os.environ.get("MOP_TEST_SEED", "5")) % 100_000
    cfg = load_job_config(["--job.config_file", DEBUG_CONFIG, "--training.seq_len", "64", "--training.steps", "1",
                           "--training.mixed_precision_param", "bfloat16", "--checkpoint.no-enable",
                           "--metrics.no-enable-tensorboard", "--debug.seed", str(seed),
                           "--mop.moe.dispatch", "local", "--job.dump_folder", root],
                          model_flavors=zoo.names(), world_size=dist.get_world_size())
    device = torch.device("cpu")
    run = build_run(cfg, device)
    smallest_unit = min(p.numel() for p in run.parts.model.layers.parameters())
    mode = DivisionsByOne(min_numel=smallest_unit)
    [(loss, norm)] = drive(cfg, run, device, steps=1, around_step=lambda step: mode)
    assert torch.isfinite(loss) and loss > 0 and torch.isfinite(norm), (loss, norm)
    assert mode.count == 0, f"{mode.count} division(s) of fp32 gradients by 1 in a one-rank step"
    dist.barrier()


def test_one_rank_step_divides_no_gradient_by_one(tmp_path):
    run_distributed(_worker, 1, str(tmp_path), timeout_s=300)
