"""FSDP2's gradient reduction as `apply_fsdp` configures it (mop_train/parallel/parallelize.py): gradients are
summed over ranks, and with a world of one nothing divides or copies them.

torch 2.11-2.13's `foreach_reduce` divides each unit's fp32 gradients by a set gradient divide factor even at
world size 1 (`reduce_scatter_input / factor` into a temporary, then a copy): with factor 1.0 that is a kernel
and one unit's gradients of memory per unit for the same values. The test runs a real training step of the
debug model at W=1 (bf16 compute, gloo) and counts every division of a gradient-sized fp32 tensor by one
during it; the step must still train (finite, positive loss).

At world size 1 the reduction's output is its input (mop_train/parallel/one_rank_reduce.py): a step with two
micro-batches (the second accumulates into the first's gradients) copies no unit's gradients from one fp32
buffer to another, and two such steps give the losses, gradient norms and parameters of FSDP2's own comm
bit for bit (bf16 and fp32 compute; on one GPU with NCCL, bf16).
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_utils import requires_gpus, run_distributed, worker_device
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


def _inside_foreach_reduce() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "foreach_reduce":
            return True
        frame = frame.f_back
    return False


class ReductionCopies(TorchDispatchMode):
    """Counts copies inside FSDP2's `foreach_reduce` between two distinct buffers its comm handed out
    (`handed`: storage pointers; the allocator reuses addresses, hence the frame test too)."""

    def __init__(self, handed: set[int]):
        super().__init__()
        self.handed, self.count = handed, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = (a.untyped_storage().data_ptr() for a in args[:2])
            self.count += dst in self.handed and src in self.handed and dst != src and _inside_foreach_reduce()
        return func(*args, **(kwargs or {}))


def _two_steps(root, precision, seed, mode):
    import torch.distributed as dist

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.parallel.sharding import local
    from mop_train.train.build import build_run
    from tests.train.offload_steps import drive

    cfg = load_job_config(["--job.config_file", DEBUG_CONFIG, "--training.seq_len", "32", "--training.steps", "2",
                           "--training.local_batch_size", "2", "--training.global_batch_size", "4",
                           "--training.mixed_precision_param", precision, "--checkpoint.no-enable",
                           "--metrics.no-enable-tensorboard", "--debug.seed", str(seed),
                           "--mop.moe.dispatch", "local", "--job.dump_folder", root],
                          model_flavors=zoo.names(), world_size=dist.get_world_size())
    device = worker_device()
    run = build_run(cfg, device)
    assert run.micro_batches == 2
    results = drive(cfg, run, device, steps=2, around_step=lambda step: mode)
    return results, {n: local(p).detach().clone() for n, p in run.parts.model.named_parameters()}


def _reference_worker(rank, world, root, precisions=("bfloat16", "float32")):
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")

    from mop_train.parallel.one_rank_reduce import OneRankReduce
    seed = int(os.environ.get("MOP_TEST_SEED", "5")) % 100_000 + 11
    ours_allocate = OneRankReduce.allocate
    fresh = lambda self, size, *, dtype, device: torch.empty(tuple(size), dtype=dtype, device=device)  # noqa: E731
    for precision in precisions:
        runs = {}
        for name, allocate in (("ours", ours_allocate), ("torch", fresh)):    # torch: FSDP2's own fresh output
            handed: set[int] = set()

            def recording(self, size, *, dtype, device, allocate=allocate, handed=handed):
                buffer = allocate(self, size, dtype=dtype, device=device)
                handed.add(buffer.untyped_storage().data_ptr())
                return buffer
            mode = ReductionCopies(handed)
            with mock.patch.object(OneRankReduce, "allocate", recording):
                runs[name] = _two_steps(os.path.join(root, f"{precision}-{name}"), precision, seed, mode)
            runs[name] += (mode.count, len(handed))
        (ours, ours_params, ours_copies, ours_handed), (want, want_params, copies, handed) = runs["ours"], runs["torch"]
        assert ours_handed > 0 and handed > 0, "the units' reductions did not go through the comm"
        assert ours_copies == 0, f"{precision}: {ours_copies} copies of a unit's gradients in the reduction"
        assert copies > 0, f"{precision}: the reference reduction should copy each unit's gradients"
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, want), 1):
            assert torch.equal(loss, ref_loss) and torch.equal(norm, ref_norm), (precision, step, loss, ref_loss)
        for name, value in want_params.items():
            assert torch.equal(ours_params[name], value), f"{precision}: {name} differs after two steps"


@pytest.mark.slow
def test_one_rank_reduction_copies_nothing_and_changes_no_bit(tmp_path):
    run_distributed(_reference_worker, 1, str(tmp_path), timeout_s=600)


@pytest.mark.gpu
@requires_gpus(1)
def test_one_rank_reduction_on_a_gpu(tmp_path):
    """The same on one CUDA device under NCCL, as a one-GPU run trains (bf16 compute)."""
    run_distributed(_reference_worker, 1, str(tmp_path), ("bfloat16",), backend="nccl", timeout_s=300)
