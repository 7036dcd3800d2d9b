"""Optimizer and LR schedule: torchtitan's containers, plus OffloadStreamAdamW by name.

    optimizers = build_optimizers([module], cfg.optimizer, cfg.mop.offload_adamw, world_size=W)
    lr_schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, cfg.training.steps)

`[optimizer] name` = "AdamW" | "Adam" goes to torchtitan's `build_optimizers`;
"OffloadStreamAdamW" builds `mop_train.ops.offload_adamw.OffloadStreamAdamW` (fp32 master weights
and moments in pinned host memory, streamed through the device in buckets) inside torchtitan's
`OptimizersContainer`, so it checkpoints through DCP like the others. The LR schedule is
torchtitan's warmup + (stable) + decay over `lr_scheduler.total_steps` (default: training.steps).
Setting total_steps fixes the curve whatever training.steps is, so a run stopped early and resumed
follows the same learning rates as a straight one.
"""

from __future__ import annotations

from torch import nn
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.lr_scheduler import build_lr_schedulers as titan_build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import build_optimizers as titan_build_optimizers
from torchtitan.distributed import ParallelDims

OFFLOAD_ADAMW = "OffloadStreamAdamW"
TITAN_OPTIMIZERS = ("AdamW", "Adam")

__all__ = ["build_optimizers", "build_lr_schedulers", "OFFLOAD_ADAMW"]


def _offload_adamw_cls():
    try:
        from mop_train.ops.offload_adamw import OffloadStreamAdamW
    except ImportError as err:
        raise ValueError(f"optimizer.name = {OFFLOAD_ADAMW!r} but mop_train.ops.offload_adamw is not "
                         f"available ({err}); use \"AdamW\"") from None
    return OffloadStreamAdamW


def build_optimizers(model_parts: list[nn.Module], optimizer, offload_adamw, *,
                     world_size: int) -> OptimizersContainer:
    """Args:
        optimizer: the `[optimizer]` section (name, lr, beta1, beta2, eps, weight_decay, implementation).
        offload_adamw: the `[mop.offload_adamw]` section (bucket_params, slots).
        world_size: W; the model is FSDP-sharded over all W ranks (pure data parallel).
    """
    if optimizer.name == OFFLOAD_ADAMW:
        kwargs = dict(lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.eps,
                      weight_decay=optimizer.weight_decay, bucket_params=offload_adamw.bucket_params,
                      slots=offload_adamw.slots, host_fraction=offload_adamw.host_fraction)
        return OptimizersContainer(model_parts, _offload_adamw_cls(), kwargs)
    if optimizer.name not in TITAN_OPTIMIZERS:
        raise ValueError(f"optimizer.name = {optimizer.name!r} is not supported; use one of "
                         f"{[*TITAN_OPTIMIZERS, OFFLOAD_ADAMW]}")
    if optimizer.early_step_in_backward:
        raise ValueError("optimizer.early_step_in_backward = true is not supported (it skips gradient "
                         "clipping and the router-bias update order); set it to false")
    dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1, etp=1,
                        world_size=world_size)
    return titan_build_optimizers(model_parts, optimizer, dims)


def build_lr_schedulers(optimizers: OptimizersContainer, lr_scheduler, training_steps: int) -> LRSchedulersContainer:
    """torchtitan's warmup + decay schedule; refuses to run past its end (the decay would turn
    the learning rate negative there).

    Args:
        lr_scheduler: the `[lr_scheduler]` section (warmup_steps, total_steps, decay_ratio, ...).
        training_steps: `training.steps`, the schedule length when total_steps is unset.
    """
    total = lr_scheduler.total_steps
    if total is not None and training_steps > total:
        raise ValueError(f"training.steps = {training_steps} runs past lr_scheduler.total_steps = {total}; "
                         f"raise --lr_scheduler.total_steps to at least {training_steps}")
    return titan_build_lr_schedulers(optimizers, lr_scheduler, training_steps)
