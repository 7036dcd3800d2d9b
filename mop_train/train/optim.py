"""Optimizer and LR schedule: torchtitan's containers, plus OffloadStreamAdamW by name.

    share = resolve_device_fraction(cfg.mop.offload_adamw, local_numel=n, fp32_weights=True,
                                    free_device_bytes=free_device_bytes(plan_terms, device))
    optimizers = build_optimizers([module], cfg.optimizer, cfg.mop.offload_adamw,
                                  device_fraction=share)
    print(describe_offload(optimizers))
    lr_schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, cfg.training.steps)

`[optimizer] name` = "AdamW" | "Adam" builds torchtitan's `OptimizersContainer` with the kwargs its
`build_optimizers` gives, around torch's optimizer stepping the DTensor parameters' local shards
(`local_shard_optim`: the same kernels and bits, without DTensor's per-step dispatch);
"OffloadStreamAdamW" builds `mop_train.ops.offload_adamw.OffloadStreamAdamW` (fp32 master weights
and moments in pinned host memory, streamed through the device in buckets) inside torchtitan's
`OptimizersContainer`, so it checkpoints through DCP like the others; its parameters are laid out in
the order the forward consumes them (FSDP2 units: the embedding, block by block, the head), so that its
device-resident share is what the forward needs first and, with `overlap`, each unit's forward
waits for its own buckets only. `device_fraction = "auto"` is resolved from the device bytes the
rest of the plan leaves free (`resolve_device_fraction`). The LR schedule is
torchtitan's warmup + (stable) + decay over `lr_scheduler.total_steps` (default: training.steps).
Setting total_steps fixes the curve whatever training.steps is, so a run stopped early and resumed
follows the same learning rates as a straight one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.lr_scheduler import build_lr_schedulers as titan_build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer

from mop_train.ops.offload_adamw import OFFLOAD_ADAMW  # noqa: F401  (re-exported for the loop)
from mop_train.ops.offload_adamw.buckets import PIECE_ALIGN
from mop_train.train.local_shard_optim import LOCAL_SHARD_OPTIMIZERS
from mop_train.units import parse_device_fraction

TITAN_OPTIMIZERS = tuple(LOCAL_SHARD_OPTIMIZERS)  # torchtitan's names, stepped on local shards

__all__ = ["build_optimizers", "build_lr_schedulers", "resolve_device_fraction", "free_device_bytes",
           "describe_offload", "OFFLOAD_ADAMW"]


def free_device_bytes(plan_terms: list[tuple[str, int, str]], device) -> int:
    """Device bytes the memory plan leaves free on this rank for the optimizer: the device's total
    memory minus the plan's terms other than the optimizer's own line (`plan.memory_plan`;
    `fit_device_fraction` counts OffloadStreamAdamW's staging and device share itself); 0 on a
    CPU-only build, where "auto" keeps everything streamed."""
    if torch.device(device).type != "cuda":
        return 0
    planned = sum(b for name, b, _ in plan_terms if name != "optimizer")
    return torch.cuda.get_device_properties(device).total_memory - planned


def resolve_device_fraction(offload_adamw, *, local_numel: int, fp32_weights: bool,
                            free_device_bytes: int | None) -> float:
    """The device_fraction to build OffloadStreamAdamW with: the configured number, or for "auto"
    the share whose device state fits `free_device_bytes` (device memory minus the memory plan's
    total) less `AUTO_MARGIN_BYTES` (2 GiB) and the streamed part's staging."""
    share = parse_device_fraction(getattr(offload_adamw, "device_fraction", 0.0))
    if share != "auto":
        return share
    if free_device_bytes is None:
        raise ValueError("mop.offload_adamw.device_fraction = \"auto\" needs the device memory left by the "
                         "plan (free_device_bytes); set a number in [0, 1] instead")
    from mop_train.ops.offload_adamw import fit_device_fraction
    return fit_device_fraction(free_device_bytes, local_numel, fp32_weights=fp32_weights,
                               bucket_params=offload_adamw.bucket_params, slots=offload_adamw.slots,
                               host_share=offload_adamw.host_fraction > 0)


def _build_offload_adamw(model_parts, kwargs, *, overlap: bool) -> OptimizersContainer:
    """torchtitan's container around OffloadStreamAdamW with each part's parameters in forward order;
    with overlap, every FSDP2 unit's forward waits for its own pieces of the step."""
    from mop_train.ops.offload_adamw import forward_order, forward_units
    cls = _offload_adamw_cls()
    position = {id(p): i for part in model_parts for i, p in enumerate(forward_order(part))}

    def in_forward_order(params, **kw):
        return cls(sorted(params, key=lambda p: position.get(id(p), len(position))), **kw)

    container = OptimizersContainer(model_parts, in_forward_order, dict(kwargs, overlap=overlap))
    for opt, part in zip(container.optimizers, model_parts):
        opt.wait_in_forward(forward_units(part))
    return container


def describe_offload(optimizers: OptimizersContainer, *, free_device_bytes: int | None = None) -> str:
    """One line per OffloadStreamAdamW for the launch plan ("" for other optimizers): the device
    share and its bytes (with the free bytes "auto" saw), staging, the CPU share, overlap."""
    from mop_train.ops.offload_adamw import AUTO_MARGIN_BYTES
    gib = 2**30
    lines = []
    for opt in getattr(optimizers, "optimizers", optimizers):
        if not hasattr(opt, "device_state_bytes"):
            continue
        auto = "" if free_device_bytes is None else (
            f" (auto: {free_device_bytes / gib:.2f} GiB free after the plan, {AUTO_MARGIN_BYTES / gib:.0f} GiB margin)")
        lines.append(
            f"OffloadStreamAdamW: device_fraction {opt.device_fraction:.3f}{auto}, {opt.device_state_bytes / gib:.2f} "
            f"GiB of state on the device; buckets {opt.bucket_params:,} x {opt.slots} slots, "
            f"{opt.staging_bytes / gib:.2f} GiB staging; host_fraction {opt.host_fraction:g} of the rest on the CPU; "
            f"overlap with the next forward {'on' if opt.overlap and opt.forward_waits.hooked else 'off'}"
            + ("; the first slots staged during the last backward" if opt.stage_in_backward else "")
            + _describe_streaming(opt))
    return "\n".join(lines)


def _describe_streaming(opt) -> str:
    """'; weights ..., gradients ...' for the launch line ('' with both on the device)."""
    weights, gradients = getattr(opt, "weights", "device"), getattr(opt, "gradients", "device")
    if (weights, gradients) == ("device", "device"):
        return ""
    working = getattr(opt, "working", None)
    held = f" ({working.device_bytes() / 2**30:.2f} GiB of working weights on the device)" if working else ""
    line = f"; weights {weights}{held}, gradients {gradients}"
    if opt.device_fraction >= 1:
        # Measured on one H200 (small, 2 x 4K, RESULTS 2026-12-02): "auto" filled the device with the
        # state beside stream/stream, and the streamed weights and gradients, 41 GB a step, were then
        # the step's whole host traffic and 1.95x its link floor.
        line += (" (every master is on the device, yet the working weights and gradients still cross the host "
                 "link each step; `mop-train plan --auto` weighs weights/gradients = \"device\" with a smaller "
                 "device_fraction against this)")
    return line


def _expert_blocks(model, expert_params, checkpointed) -> list[tuple[tuple, bool]]:
    """[(a MoE layer's expert shards w1, w2, w3, whether its block is checkpointed)] in layer order."""
    kept_out = {id(p) for p in expert_params}
    blocks = []
    for index, layer in enumerate(model.layers.values()):
        for module in layer.modules():
            if hasattr(module, "experts") and hasattr(module, "dispatch"):
                params = tuple(p for p in module.experts.parameters() if id(p) in kept_out)
                if params:
                    blocks.append((params, index in checkpointed))
    return blocks


def attach_streaming(optimizers, parts, layout, offload_adamw) -> None:
    """[mop.offload_adamw] weights / gradients != "device": each OffloadStreamAdamW's working weights
    (`WorkingWeights`, bound to the model's weight_source seams, with FSDP2's forward prefetch of the
    next block for "stream") and its gradient stream (`GradientStream`, with the expert and vocab
    blocks' replica sums); they are kept on the optimizer as `.working` and `.grad_stream`."""
    from mop_train.ops.offload_adamw.grad_stream import GradBlock, GradientStream
    from mop_train.ops.offload_adamw.working import WorkingWeights, bind_weight_sources
    from mop_train.parallel.sharding import grad_norm_term, reduce_replica_grad
    experts = _expert_blocks(parts.model, parts.expert_params, set(parts.checkpointed))
    vocab = [(tuple(parts.vocab_params), False)] if parts.vocab_params else []
    reduce_dtype = parts.precision.reduce_dtype
    for opt in getattr(optimizers, "optimizers", optimizers):
        opt.working = opt.grad_stream = None
        if offload_adamw.weights != "device":
            opt.working = WorkingWeights(opt, [parts.module], mode=offload_adamw.weights,
                                         dtype=parts.precision.param_dtype, blocks=experts + vocab,
                                         window=offload_adamw.weight_window,
                                         one_off_units=parts.once_a_step_units)
            bind_weight_sources(list(parts.module.modules()), opt.working)
            if offload_adamw.weights == "stream":
                units = list(parts.model.layers.values())
                for unit, following in zip(units, units[1:]):
                    unit.set_modules_to_forward_prefetch([following])  # the next block's copy-in and gather
        if offload_adamw.gradients == "stream":
            def replica(group):
                return lambda grad: reduce_replica_grad(grad, group, reduce_dtype=reduce_dtype)
            blocks = []  # a block waits for all its gradients only when its replica group sums them
            for group, shards in ((layout.expert_replica_group, experts), (layout.vocab_replica_group, vocab)):
                if group is not None and dist.get_world_size(group) > 1:
                    blocks += [GradBlock(params, replica(group)) for params, _ in shards]
            opt.grad_stream = GradientStream(opt, blocks, grad_norm_term)


def _offload_adamw_cls():
    try:
        from mop_train.ops.offload_adamw import OffloadStreamAdamW
    except ImportError as err:
        raise ValueError(f"optimizer.name = {OFFLOAD_ADAMW!r} but mop_train.ops.offload_adamw is not "
                         f"available ({err}); use \"AdamW\"") from None
    return OffloadStreamAdamW


def grad_streams(optimizers) -> list:
    """The GradientStreams of the optimizers that stream gradients ([] with gradients = "device")."""
    return [s for opt in optimizers if (s := getattr(opt, "grad_stream", None)) is not None]


def stage_ahead(optimizers) -> None:
    """Before the step's last backward: OffloadStreamAdamW with `stage_in_backward` copies its first
    buckets' state in while the backward runs (OffloadStreamAdamW.stage_ahead)."""
    for opt in optimizers:
        if getattr(opt, "stage_in_backward", False):
            opt.begin_staging()   # paced by the units' backward where `pace_staging` hooked them


def wait_for_weights(optimizers) -> None:
    """Make the current stream wait for the weights of every optimizer's last step: an overlapped
    OffloadStreamAdamW step may still be writing them. Call it before anything but the next
    forward reads the weights (a checkpoint save, a finiteness check)."""
    for opt in optimizers:
        if hasattr(opt, "wait_for_weights"):
            opt.wait_for_weights()


def build_optimizers(model_parts: list[nn.Module], optimizer, offload_adamw, *,
                     device_fraction: float | None = None,
                     piece_align: int = PIECE_ALIGN) -> OptimizersContainer:
    """Args:
        optimizer: the `[optimizer]` section (name, lr, beta1, beta2, eps, weight_decay, implementation).
        offload_adamw: the `[mop.offload_adamw]` section (bucket_params, slots, host_fraction,
            device_fraction, overlap).
        device_fraction: the resolved share (`resolve_device_fraction`); None takes the section's
            number (ValueError if it is "auto").
        piece_align: OffloadStreamAdamW's lane alignment of its cuts (its docstring; 1 for tests that
            place cuts inside tiny tensors).
    """
    if optimizer.name == OFFLOAD_ADAMW:
        if device_fraction is None:
            device_fraction = resolve_device_fraction(offload_adamw, local_numel=0, fp32_weights=True,
                                                      free_device_bytes=None)
        kwargs = dict(lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.eps,
                      weight_decay=optimizer.weight_decay, bucket_params=offload_adamw.bucket_params,
                      slots=offload_adamw.slots, host_fraction=offload_adamw.host_fraction,
                      device_fraction=device_fraction, weights=getattr(offload_adamw, "weights", "device"),
                      gradients=getattr(offload_adamw, "gradients", "device"), piece_align=piece_align,
                      stage_in_backward=bool(getattr(offload_adamw, "stage_in_backward", False)))
        return _build_offload_adamw(model_parts, kwargs, overlap=bool(getattr(offload_adamw, "overlap", False)))
    if optimizer.name not in TITAN_OPTIMIZERS:
        raise ValueError(f"optimizer.name = {optimizer.name!r} is not supported; use one of "
                         f"{[*TITAN_OPTIMIZERS, OFFLOAD_ADAMW]}")
    if optimizer.early_step_in_backward:
        raise ValueError("optimizer.early_step_in_backward = true is not supported (it skips gradient "
                         "clipping and the router-bias update order); set it to false")
    if optimizer.implementation not in ("fused", "foreach", "for-loop"):
        raise ValueError(f"optimizer.implementation = {optimizer.implementation!r} is not one of "
                         f"'fused', 'foreach', 'for-loop'")
    # torchtitan's build_optimizers' kwargs and container, with the optimizer stepping local shards
    kwargs = dict(lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.eps,
                  weight_decay=optimizer.weight_decay, fused=optimizer.implementation == "fused",
                  foreach=optimizer.implementation == "foreach")
    return OptimizersContainer(model_parts, LOCAL_SHARD_OPTIMIZERS[optimizer.name], kwargs)


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


def apply_configured_hyperparameters(optimizers, lr_schedulers, optimizer) -> list[str]:
    """After a resume: the `[optimizer]` section's lr, betas, eps and weight_decay, not the checkpoint's.

    torch's `load_state_dict` restores every param group's hyperparameters and torchtitan's scheduler
    its `base_lrs`, so a run resumed with a lowered `--optimizer.lr` (the advice after a divergence)
    trained on at the saved one while the schedule's shape (warmup, decay) followed the config. The
    schedule keeps its position: the next step's LR is the new lr times the schedule's factor there.
    Returns one line per changed key; nothing is touched when nothing changed (the resume stays bit
    for bit)."""
    notes = []
    want = {"betas": (optimizer.beta1, optimizer.beta2), "eps": optimizer.eps, "weight_decay": optimizer.weight_decay}
    for sched in lr_schedulers.schedulers:
        if all(base == optimizer.lr for base in sched.base_lrs):
            continue
        notes.append(f"optimizer.lr = {optimizer.lr:g} replaces the checkpoint's {sched.base_lrs[0]:g}")
        sched.base_lrs = [optimizer.lr] * len(sched.base_lrs)
        lrs = [base * lam(sched.last_epoch) for base, lam in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(sched.optimizer.param_groups, lrs):
            group["lr"], group["initial_lr"] = lr, optimizer.lr
        sched._last_lr = lrs
    for opt in optimizers:
        for group in opt.param_groups:
            for key, value in want.items():
                if key not in group:
                    continue
                saved = tuple(group[key]) if key == "betas" else group[key]
                if saved != value:
                    notes.append(f"optimizer.{key} = {value} replaces the checkpoint's {saved}")
                    group[key] = value
    return list(dict.fromkeys(notes))
