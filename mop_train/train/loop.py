"""The training loop, launched by torchrun on CPU (gloo) or GPU (NCCL) through the same code:

    torchrun --standalone --nproc_per_node=2 -m mop_train.train --job.config_file configs/debug_cpu.toml \
        --training.steps 8 --job.dump_folder outputs/x --metrics.log_freq 1 --debug.seed 7

One step: every rank reads its own B sequences of S tokens; the FSDP2-sharded model returns the
summed token loss; the loop divides by the global count of target tokens (all-reduced), runs
backward (gradients are summed over ranks), clips the global gradient norm, steps the optimizer
and LR schedule, then moves the router biases from the all-reduced expert loads; a step whose loss
or gradient norm is non-finite on any rank updates none of that (mop_train.train.reliability). With
[mop.data] document_mask, document ids are taken from the full sequences (before the sequence
split) at the tokenizer's EOS, and attention stays inside each packed document. Checkpoints
(DCP) save and restore every piece of that state, so a resumed run repeats the same losses.
The run's parts (layout, data, model under the layout, optimizer, schedule, checkpointer) are built
by mop_train.train.build.build_run; this file is the steps.

Legend: W ranks, B local batch, S sequence length.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torchtitan.tools.logging import init_logger, logger

from mop_train.config import load_job_config
from mop_train.models import zoo
from mop_train.models.document_mask import document_ids
from mop_train.ops.offload_adamw.link import LinkBytes
from mop_train.parallel.apply import dispatch_metrics
from mop_train.parallel.fake_world import COMM_MODE as FAKE_MODE
from mop_train.parallel.fake_world import fake_world_from_env, fake_world_note, in_fake_world, init_fake_world
from mop_train.parallel.sharding import (clip_coefficient, clip_grads_with_norm_, reduce_replica_grads,
                                         total_grad_norm)
from mop_train.train.build import ModelParts, Run, build_run
from mop_train.train.loss import IGNORE_INDEX
from mop_train.train.optim import grad_streams, stage_ahead
from mop_train.train.metrics import DeviceSpan, MetricLogger, flops_per_token, peak_tflops
from mop_train.train.profiling import RunProfiler
from mop_train.train.reliability import (CollectiveTimeout, DumpFolderLock, DumpFolderLocked, Fault,
                                         NonFiniteGuard, StepVerdict, StopFlag, StopRequested,
                                         exit_with_parent, install_a2a_split_check, is_timeout,
                                         set_collective_timeout)
from mop_train.train.validate import build_validator


def init_distributed(timeout_s: float = 300, comm_mode: str = "default") -> torch.device:
    """Join the torchrun world, or make a world of one (in-memory store) under plain python; with
    comm_mode "fake_backend", join a fake world as rank RANK of WORLD_SIZE on the local GPU (or CPU).
    `timeout_s`: how long a collective may wait before it fails (comm.init_timeout_seconds)."""
    if comm_mode == FAKE_MODE:
        world_size, rank = fake_world_from_env()
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        init_fake_world(world_size, rank, device, timeout_s)
        return device
    single = "RANK" not in os.environ
    kwargs = dict(store=dist.HashStore(), rank=0, world_size=1) if single else {}
    kwargs["timeout"] = timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **kwargs)
    return device


def shard_sequence(tokens: torch.Tensor, labels: torch.Tensor, layout):
    """This rank's S/D consecutive positions of its group's sequences, and their global positions."""
    S, D = tokens.shape[1], layout.seq_size
    start = layout.seq_rank * (S // D)
    positions = torch.arange(start, start + S // D, device=tokens.device)   # [S/D]
    return tokens[:, start:start + S // D], labels[:, start:start + S // D], positions


@dataclass
class StepGuards:
    """What a step checks besides its arithmetic (see mop_train.train.reliability)."""
    nonfinite: NonFiniteGuard
    stop: StopFlag
    schedule_steps: int              # the LR schedule's length: past it, the final LR is held
    fault: Fault | None = None       # tests: a NaN injected at a given step and rank
    phase: str = "setup"             # the part of the step running now (named when a collective hangs)


def _micro_batch(batch, layout, device: torch.device, eos_id: int | None):
    """This rank's S/D positions of one micro-batch: tokens, labels, positions [B, S/D], doc ids [B, S]."""
    inputs, labels = batch
    tokens, labels = inputs["input"].to(device), labels.to(device)   # [B, S], [B, S]
    doc_ids = None if eos_id is None else document_ids(tokens, eos_id)  # [B, S]: full sequences
    return (*shard_sequence(tokens, labels, layout), doc_ids)


def train_step(parts: ModelParts, layout, batches: list, optimizers, lr_schedulers, *, max_norm: float,
               bias_rate: float, device: torch.device, guards: StepGuards, step: int,
               eos_id: int | None = None) -> dict:
    """One optimizer step on this rank's micro-batches (gradient accumulation when there are
    several); returns this step's tensors for logging.

    The loss is every micro-batch's summed token loss over the step's global target count, so the
    accumulated gradient is exactly that of one step over the whole batch. FSDP2 reduce-scatters
    after each micro-batch's backward (its fp32 gradient shards accumulate; skipping that sync would
    hold the whole model's unsharded gradients), the expert and vocab shards' replica sums run once
    per step, and the router-bias update counts every micro-batch's loads once.
    `eos_id`: None (plain causal attention) or the EOS token id that closes packed documents.
    A step whose loss or gradient norm is non-finite on any rank updates nothing (`verdict.skip`)."""
    module, model, rank = parts.module, parts.model, dist.get_rank()
    micro = [_micro_batch(b, layout, device, eos_id) for b in batches]
    if guards.fault is not None and guards.fault.fires(step, rank, "hang"):
        guards.fault.hang(guards.stop)
    guards.phase = "the target-token count all-reduce"
    n_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels, _, _ in micro)
    dist.all_reduce(n_tokens)                                          # global target count of the step
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    streams = grad_streams(optimizers)  # [mop.offload_adamw] gradients = "stream": copied out as they are final
    for k, (tokens, labels, positions, doc_ids) in enumerate(micro):
        for stream in streams:
            stream.begin_micro_batch(k, len(micro))
        guards.phase = "the forward (FSDP all-gathers, expert all-to-alls, Ulysses, Ring-DTP)"
        micro_sum = module(tokens, labels, positions, doc_ids)         # fp32 sum over local tokens
        if guards.fault is not None and guards.fault.fires(step, rank, "nan_loss"):
            micro_sum = micro_sum * float("nan")
        loss = micro_sum / n_tokens
        if model.args.aux_loss_coef > 0:                               # gradients sum over ranks
            loss = loss + model.aux_loss() / (dist.get_world_size() * len(micro))
        guards.phase = "the backward (FSDP reduce-scatters, expert all-to-alls, replica sums)"
        if k == len(micro) - 1:
            stage_ahead(optimizers)  # [mop.offload_adamw] stage_in_backward: state in while gradients go out
        loss.backward()
        loss_sum = loss_sum + micro_sum.detach()
    loss = loss_sum / n_tokens
    for stream in streams:
        stream.end_backward()
    # Ranks holding the same expert / vocab shard saw different tokens: sum their gradients (streamed
    # gradients were summed as they became final, and have no .grad left here).
    reduce_dtype = parts.precision.reduce_dtype
    reduce_replica_grads(parts.expert_params, layout.expert_replica_group, reduce_dtype=reduce_dtype)
    reduce_replica_grads(parts.vocab_params, layout.vocab_replica_group, reduce_dtype=reduce_dtype)
    params = list(module.parameters())
    if guards.fault is not None and guards.fault.fires(step, rank, "nan_grad"):
        guards.fault.poison_grad(list(module.named_parameters()))
    guards.phase = "the gradient-norm all-reduce and the non-finite check"
    terms = {key: term for stream in streams for key, term in stream.terms().items()}
    grad_norm = total_grad_norm(params, terms=terms)                   # the global norm, not clipped yet
    verdict = guards.nonfinite.check(loss, grad_norm, stop_requested=guards.stop.requested)
    guards.nonfinite.after(verdict, step=step, named_params=list(module.named_parameters()), grad_terms=terms)
    lr = lr_schedulers.schedulers[0].get_last_lr()[0]
    optimizer_span = DeviceSpan(device)
    if verdict.skip:  # nothing moves: parameters, optimizer state, schedule, router biases
        for opt in optimizers:  # (OffloadStreamAdamW: the step's host-link account ends here)
            if hasattr(opt, "close_link_account"):
                opt.close_link_account()
        optimizers.zero_grad()
        for moe in model.moe_layers():
            moe.router.tokens_per_expert.zero_()
    else:
        clip_grads_with_norm_(params, max_norm, grad_norm)
        for stream in streams:  # the optimizer scales streamed gradients as it copies them back
            stream.set_scale(clip_coefficient(max_norm, grad_norm))
        guards.phase = "the optimizer step and the router-bias all-reduce"
        with optimizer_span:
            optimizers.step()
        if lr_schedulers.schedulers[0].last_epoch < guards.schedule_steps - 1:
            lr_schedulers.step()                                           # past its end: final LR held
        optimizers.zero_grad()
        model.update_router_biases(bias_rate, reduce_fn=dist.all_reduce)
    return {"loss_sum": loss_sum, "n_tokens": n_tokens, "grad_norm": grad_norm, "lr": lr,
            "optimizer_span": optimizer_span, "verdict": verdict}


def lock_dump_folder(cfg) -> DumpFolderLock | None:
    """Rank 0 takes the dump folder's lock; every rank raises DumpFolderLocked when it is held."""
    if not cfg.mop.reliability.lock_dump_folder:
        return None
    lock, outcome, alone = DumpFolderLock(cfg.job.dump_folder), [None, None], in_fake_world()
    if dist.get_rank() == 0 or alone:  # a fake world's one process takes it and tells no one
        try:
            outcome[0] = lock.acquire()
        except DumpFolderLocked as err:
            outcome[1] = str(err)
    if not alone:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise DumpFolderLocked(outcome[1])
    if outcome[0] and (dist.get_rank() == 0 or alone):
        print(outcome[0], flush=True)
    return lock


def train(cfg, device: torch.device, stop: StopFlag, *, model_args=None) -> None:
    """Build the run (mop_train.train.build), run its steps, and say where its outputs are.
    `model_args`: MoEModelArgs replacing model.flavor's (benchmarks and tests: a variant of a zoo model)."""
    lock = lock_dump_folder(cfg)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        logs = rank == 0 or in_fake_world()           # a fake world's one process is its own log
        profiler = RunProfiler(cfg.profiling, cfg.job.dump_folder, rank=rank, device=device)  # checked first
        run = build_run(cfg, device, model_args=model_args)
        validator = build_validator(cfg, run, prepare=partial(_micro_batch, layout=run.layout, device=device,
                                                              eos_id=run.eos_id))
        metrics = MetricLogger(cfg.metrics, cfg.job.dump_folder, rank=0 if logs else rank, device=device,
                               run_config=cfg.to_dict(), total_steps=cfg.training.steps,
                               resume_step=run.train_state.step)
        if metrics.note:
            print(metrics.note, flush=True)
        if logs and device.type == "cuda":  # beside the plan's "start-up" line: the peak before any step
            print(f"start-up: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB device peak before the "
                  "first step (torch.cuda.max_memory_allocated; each step's peak_mem includes it)", flush=True)
        flops = flops_per_token(run.spec.args, cfg.training.seq_len, active_params=run.spec.active_params)
        guards = StepGuards(NonFiniteGuard(cfg.mop.reliability, rank=rank, world=world, device=device,
                                           last_checkpoint=lambda: run.checkpointer.last_saved), stop,
                            run.schedule_steps, Fault.from_env())
        try:
            with profiler.running(start_step=run.train_state.step):
                run_steps(cfg, run, metrics, device=device, flops_per_token=flops, guards=guards,
                          validator=validator, profiler=profiler)
        finally:
            metrics.close()
            run.checkpointer.close()
        if logs:
            print((f"{fake_world_note()}\n" if in_fake_world() else "") + f"done: metrics in {metrics.jsonl_path}"
                  + (f", TensorBoard events in {metrics.tb_dir}" if cfg.metrics.enable_tensorboard else "")
                  + (f", W&B run in {metrics.wandb_dir}" if cfg.metrics.enable_wandb else "")
                  + (f", checkpoints in {run.checkpointer.folder}" if cfg.checkpoint.enable else ""), flush=True)
    finally:
        if lock is not None:
            lock.release()


def run_steps(cfg, run: Run, metrics, *, device, flops_per_token: float, guards: StepGuards,
              validator=None, profiler: RunProfiler | None = None) -> None:
    """Steps from the run's position to training.steps: one `train_step` each, metrics at the log
    interval (and on a skipped step), checkpoints at the checkpointer's interval; a collective that
    times out names the step's phase, a stop signal saves and stops at the step boundary.
    `validator` (mop_train.train.validate) scores the held-out batches at its steps, logged in the
    step's record (its time left out of tokens/s); `profiler` (mop_train.train.profiling) is told
    each step's end."""
    steps, peak, sco = cfg.training.steps, peak_tflops(device, cfg.mop.metrics.peak_tflops), run.parts.sco
    train_state, checkpointer, optimizers = run.train_state, run.checkpointer, run.optimizers
    micro_batches = run.micro_batches
    batches = iter(run.dataloader)        # draws its seed from the torch CPU generator
    train_state.restore_rng()             # so a resumed run's generators continue where they were saved
    # the throughput window: its start time and the tokens seen then (read only at a record)
    window_start, window_first = time.perf_counter(), train_state.tokens_seen
    timeout_set = in_fake_world()  # a fake world's collectives never wait: no timeout to set
    while train_state.step < steps:
        train_state.step += 1
        step = train_state.step
        if sco is not None:
            sco.begin_step()
        try:
            out = train_step(run.parts, run.layout, [next(batches) for _ in range(micro_batches)], optimizers,
                             run.lr_schedulers,
                             max_norm=cfg.training.max_norm, bias_rate=cfg.mop.moe.bias_update_rate,
                             device=device, eos_id=run.eos_id, guards=guards, step=step)
        except RuntimeError as err:
            if not is_timeout(err):
                raise
            raise CollectiveTimeout(
                f"rank {dist.get_rank()}, step {step}: a collective did not complete within its timeout, "
                f"during {guards.phase} (comm.train_timeout_seconds = {cfg.comm.train_timeout_seconds}; "
                f"comm.init_timeout_seconds before the first step): {str(err).splitlines()[0]}") from None
        if not timeout_set:  # the first step (compilation, allocation) ran under the init timeout
            set_collective_timeout(cfg.comm.train_timeout_seconds)
            timeout_set = True
        verdict: StepVerdict = out["verdict"]
        train_state.skipped_steps += verdict.skip
        # A fake world's count all-reduce leaves this rank's own count; its world of identical ranks
        # trains W times as many, which tokens/s (and so TFLOP/s and MFU) and tokens_seen count.
        # The count stays on the device until a record or a checkpoint needs it: no read ends a step that logs nothing.
        train_state.tokens.add(out["n_tokens"], dist.get_world_size() if in_fake_world() else 1)
        last = step == steps
        validating = validator is not None and validator.due(step) and not verdict.stop_requested
        logging = metrics.should_log(step, last) or verdict.skip or validating
        # read before validation's forward refills them (each MoE layer keeps its last call's figures)
        dispatch = dispatch_metrics(run.parts.model) if logging else {}
        validation = validator.run(step) if validating else {}
        window_start += validation.get("validation/s", 0.0)               # tokens/s: training time only
        if logging:
            loss_sum = out["loss_sum"].clone()
            dist.all_reduce(loss_sum)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - window_start
            tokens_seen = train_state.tokens_seen
            tokens_per_s = (tokens_seen - window_first) / elapsed
            values = {"loss": (loss_sum / out["n_tokens"]).item(), "grad_norm": float(out["grad_norm"]),
                      "lr": out["lr"], "tokens_per_s": tokens_per_s,
                      "tokens_per_s_per_rank": tokens_per_s / dist.get_world_size(),
                      "tokens_seen": tokens_seen, "elapsed_s": elapsed,
                      "optimizer_s": None if verdict.skip else out["optimizer_span"].seconds(),
                      "optimizer_exposed_s": None if verdict.skip else exposed_optimizer_seconds(optimizers),
                      "skipped": verdict.skip, "skipped_steps": train_state.skipped_steps,
                      "micro_batches": micro_batches}
            if device.type == "cuda":
                tflops = flops_per_token * tokens_per_s / dist.get_world_size() / 1e12
                values["tflops"] = tflops
                values["mfu_pct"] = 100.0 * tflops / peak if peak else None
                values["mfu_peak_tflops"] = peak
            values.update(offload_link_metrics(optimizers))
            if sco is not None:
                values.update({f"sco_{k}": v for k, v in sco.last_step_stats().items()})
            values.update({f"moe_{k}": v for k, v in dispatch.items()})
            values.update(validation)
            if in_fake_world():
                values["fake_world"] = fake_world_note()
            metrics.log(step, values)
            window_start, window_first = time.perf_counter(), tokens_seen
        if verdict.stop_requested:
            stop_cleanly(cfg, checkpointer, step)
        checkpointer.save(step, last_step=last)
        if profiler is not None:
            profiler.step(step)


def exposed_optimizer_seconds(optimizers) -> float | None:
    """What the step waited for the optimizer (OffloadStreamAdamW's own figure; None for others)."""
    offload = [o for o in optimizers if hasattr(o, "exposed_seconds")]
    return sum(o.exposed_seconds() for o in offload) if offload else None


def offload_link_metrics(optimizers) -> dict:
    """OffloadStreamAdamW's host-link bytes of the logged step, in GiB, summed over its optimizers:
    offload_h2d_gib / offload_d2h_gib and per source (_optimizer, _windows, _gradients; link.py);
    {} for other optimizers."""
    accounts = [o.link_bytes() for o in optimizers if hasattr(o, "link_bytes")]
    if not accounts:
        return {}
    return LinkBytes.summed(accounts).metrics()


def stop_cleanly(cfg, checkpointer, step: int) -> None:
    """A rank got SIGTERM: every rank is at the same step boundary; save (when configured) and stop."""
    saved = cfg.mop.reliability.save_on_sigterm and checkpointer.save(step, resumable=True)
    raise StopRequested(f"stopped by a signal at the end of step {step}; "
                        + (f"saved a resumable checkpoint in {checkpointer.folder}/step-{step}" if saved else
                           "no checkpoint saved (checkpoint.enable = false or "
                           "mop.reliability.save_on_sigterm = false)"))


def main(argv: list[str] | None = None, *, model_args=None) -> None:
    init_logger()
    logger.setLevel("ERROR")  # torchtitan warns that hf_assets_path = "embedded" is not a folder
    cfg = load_job_config(argv, model_flavors=zoo.names())
    # The layout against W: a fake world's W is its WORLD_SIZE, checked first (a missing or bad one is
    # named, not met as "must divide the world size (1 ranks)").
    world = fake_world_from_env()[0] if cfg.comm.mode == FAKE_MODE else int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_job_config(argv, model_flavors=zoo.names(), world_size=world)
    logger.setLevel("INFO")
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    exit_with_parent()
    stop = StopFlag().install()
    device = init_distributed(cfg.comm.init_timeout_seconds, cfg.comm.mode)
    if cfg.mop.reliability.check_a2a_splits:
        install_a2a_split_check()
    if dist.get_rank() != 0 and not in_fake_world():
        logger.setLevel("WARNING")
    try:
        train(cfg, device, stop, model_args=model_args)
    finally:
        dist.destroy_process_group()
