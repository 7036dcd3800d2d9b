"""A run's parts, built from its configuration in the launch order, and what rank 0 prints about them.

    run = build_run(cfg, device)    # layout -> checks -> seed -> data -> model -> plans -> optimizer -> resume
    run_steps(cfg, run, ...)        # mop_train.train.loop

Every check of the job against the layout and the model runs before anything is built
(mop_train.parallel.parallelize). The model is built on meta; a small one is materialised and
initialised whole (same RNG stream on every rank, so the shards are slices of the same weights
whatever the layout); the loss is chosen (chunked cross-entropy or Ring-DTP); `parallelize` applies
Ulysses cores, kept attention, expert and vocab shards, checkpointing (SCO's wrapper when it has a
host budget) and FSDP2; a large model is then initialised shard by shard. The memory plans
(mop_train.plan.job) are checked against the host, OffloadStreamAdamW's device share is
resolved from them, and the checkpointer resumes the run when the dump folder holds a checkpoint
(or a fresh run starts from `checkpoint.initial_load_path`: DCP, or Hugging Face safetensors through
mop_train.hf.load). Rank 0 records the model in `{dump_folder}/mop_model.json` (mop_train.hf.run_record)
so that `mop-train export` can convert the run's checkpoints alone.

Legend: W ranks, D sequence degree, E_p expert degree, P vocab degree, B local batch, S sequence.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from mop_train.config_checks import check_checkpoint_model, check_context_fits_model
from mop_train.hf.run_record import write_run_record
from mop_train.layout import RankLayout, plan_layout
from mop_train.models import zoo
from mop_train.models.zoo import HOST_INIT_MAX_PARAMS
from mop_train.models.args import MoEModelArgs
from mop_train.models.model import MoETransformer, model_tiles
from mop_train.ops.offload_adamw import forward_units
from mop_train.ops.offload_adamw.working import fsdp_param_groups
from mop_train.parallel.fake_world import apply_routing_profile, fake_world_note, in_fake_world
from mop_train.parallel.parallelize import (ParallelizeOptions, check_layout_fits, check_titan_parallelism,
                                            parallelize)
from mop_train.parallel.precision import MixedPrecision
from mop_train.parallel.sharding import local
from mop_train.plan.job import host_init_applies, plan_for_config, plan_from_parts
from mop_train.plan.terms import check_device_memory, check_host_memory, format_plan
from mop_train.train.checkpoint import TrainState, build_checkpointer
from mop_train.train.data import build_dataloader, build_tokenizer, default_cache_dir, tokenizer_folder
from mop_train.train.loss import IGNORE_INDEX, LanguageModelLoss, chunked_cross_entropy_sum
from mop_train.train.optim import (OFFLOAD_ADAMW, apply_configured_hyperparameters, attach_streaming,
                                   build_lr_schedulers, build_optimizers, describe_offload, free_device_bytes,
                                   resolve_device_fraction)
from mop_train.train.validate import check_validation_fits
from mop_train.units import parse_bytes, parse_device_fraction




@dataclass(frozen=True)
class ModelSpec:
    """The model a run trains, resolved once per launch: its args and parameter counts (one meta build)."""

    flavor: str
    args: MoEModelArgs
    total_params: int
    active_params: int                 # what one token touches (zoo.param_counts)

    @classmethod
    def resolve(cls, flavor: str, args: MoEModelArgs | None = None) -> ModelSpec:
        """`flavor`'s args from the zoo, or `args` (a variant of it) when given."""
        args = zoo.get_model_args(flavor) if args is None else args
        counts = zoo.param_counts(args)
        return cls(flavor, args, counts["total"], counts["active"])


@dataclass
class ModelParts:
    module: LanguageModelLoss          # the FSDP root: model + loss
    model: MoETransformer
    sco: object | None                 # SelectiveCheckpointOffload or None
    checkpointed: list[int]            # block indices under activation checkpointing
    expert_params: list                # DTensors sharded over the expert group (out of FSDP)
    vocab_params: list                 # the projection sharded over the vocab group (out of FSDP)
    init_mode: str                     # "whole" (layout-invariant) or "per-shard"
    precision: MixedPrecision          # one policy for FSDP2's units and the shards kept out of it
    once_a_step_units: list            # FSDP2 units gathered once a step (parallel.parallelize.apply_fsdp)


def uses_ring_dtp(cfg, layout) -> bool:
    """Ring-DTP is the loss when the projection is sharded (P > 1) or [mop.ring_dtp] enable."""
    return layout.vocab_size > 1 or cfg.mop.ring_dtp.enable


def build_loss_fn(cfg, layout, vocab_size: int):
    """The chunked cross-entropy, or Ring-DTP (`uses_ring_dtp`; same contract)."""
    if not uses_ring_dtp(cfg, layout):
        return partial(chunked_cross_entropy_sum, chunk_size=cfg.mop.data.loss_chunk_tokens)
    from mop_train.ops.ring_dtp import ring_dtp_cross_entropy

    rd, group = cfg.mop.ring_dtp, (layout.vocab_group if layout.vocab_size > 1 else None)
    budget = None if rd.memory_budget.strip() == "0" else parse_bytes(rd.memory_budget,
                                                                        key="mop.ring_dtp.memory_budget")

    def ring_loss(hidden, weight, targets):
        return ring_dtp_cross_entropy(hidden, local(weight), targets, group, vocab_size=vocab_size,
                                      mode=rd.mode, schedule=rd.schedule, memory_budget=budget,
                                      token_chunk=rd.token_chunk or None, ignore_index=IGNORE_INDEX,
                                      reduction="sum", block_size=rd.block_size)
    return ring_loss


def build_model(cfg, layout, device: torch.device, spec: ModelSpec, options: ParallelizeOptions) -> ModelParts:
    """Zoo model -> loss -> `parallelize` (MoP layout, checkpointing, FSDP2) -> init.

    Small models are materialised and initialised whole first (same RNG stream on every rank), so
    the shards are slices of the same weights whatever the layout; large ones stay on meta until
    FSDP has sharded them and are initialised shard by shard.
    """
    whole = spec.total_params <= HOST_INIT_MAX_PARAMS
    with torch.device("meta"):
        model = MoETransformer(spec.args)
    if whole:
        model.to_empty(device="cpu")
        model.init_weights(buffer_device="cpu")
        model.to(device)
    module = LanguageModelLoss(model, loss_fn=build_loss_fn(cfg, layout, spec.args.vocab_size))
    sco = build_sco(cfg.mop.sco, device)
    shards = parallelize(module, layout, options, sco=sco)
    if host_init_applies(cfg, initialised_whole=whole):
        init_pieces_to_host(module, model, device)
    elif not whole:
        module.to_empty(device=device)
        model.init_weights(buffer_device=device)
    return ModelParts(module, model, sco, shards.checkpointed, shards.expert_params, shards.vocab_params,
                      "whole" if whole else "per-shard", options.precision, shards.once_a_step_units)


@torch.no_grad()
def init_pieces_to_host(module, model: MoETransformer, device: torch.device) -> None:
    """Initialise a sharded model (on meta) piece by piece on `device` and keep each piece's parameter
    values in host memory, so the device holds one piece at a time (the largest: the embedding or a
    block) instead of every local parameter in fp32.

    The pieces and their initialisers are `model.init_pieces`, in `init_weights`' order, so the random
    draws and hence the values are the ones `module.to_empty(device)` + `init_weights` give (the
    bitwise test: tests/train/test_host_init.py). Each piece is materialised on the device
    (`to_empty`), initialised, and its parameters' local shards are copied to the host; FSDP2's
    sharded data is re-pointed at the host copy (`FSDPParam.reset_sharded_param`, which FSDP2's own
    `_apply` ran on the device copy), so no reference keeps the device copy alive. Buffers stay on the
    device. The DTensors keep their mesh's device: where their gradients form (as after
    `WorkingWeights` adopts the masters, ops/offload_adamw/working.py).
    """
    from torch.distributed.tensor import DTensor
    for piece, init in model.init_pieces(buffer_device=device):
        piece.to_empty(device=device)
        init()
        for name, param in piece.named_parameters():
            if not isinstance(param, DTensor):
                raise ValueError(f"mop.offload_adamw.host_init = true needs DTensor parameters (FSDP2 units or MoP "
                                 f"shards); {name} is a plain {type(param).__name__}; set host_init = false")
            param._local_tensor = param._local_tensor.to("cpu")
        for group in fsdp_param_groups([piece]):
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()
    left = [name for name, p in module.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"init_pieces_to_host: parameters no piece of model.init_pieces holds: {left}")
    for sub in module.modules():  # buffers outside the pieces: where to_empty(device) would put them
        for key, buf in sub._buffers.items():
            if buf is not None and buf.is_meta:
                sub._buffers[key] = torch.empty_like(buf, device=device)


def build_sco(sco_cfg, device: torch.device):
    """A SelectiveCheckpointOffload for a nonzero `[mop.sco] host_budget`, else None."""
    if sco_cfg.host_budget.strip() == "0":
        return None
    try:
        from mop_train.ops.sco import SelectiveCheckpointOffload, resolve_host_budget
    except ImportError as err:
        raise ValueError(f"mop.sco.host_budget = {sco_cfg.host_budget!r} but mop_train.ops.sco is not "
                         f"available ({err}); set it to \"0\"") from None
    budget = resolve_host_budget(sco_cfg.host_budget, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return SelectiveCheckpointOffload(budget, device=device)


def seed_everything(seed: int | None, device: torch.device) -> int:
    """Same seed on every rank (rank 0 draws one when none is given); returns it."""
    if seed is None:
        drawn = torch.randint(0, 2**31 - 1, (1,), device=device)
        dist.broadcast(drawn, src=0)
        seed = int(drawn.item())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    return seed


def document_eos_id(cfg, tokenizer) -> int | None:
    """The EOS id that splits packed documents when [mop.data] document_mask is on, else None."""
    if not cfg.mop.data.document_mask:
        return None
    if tokenizer.eos_id is None:
        raise ValueError(f"mop.data.document_mask = true but the tokenizer at model.hf_assets_path = "
                         f"{cfg.model.hf_assets_path!r} has no EOS token to split documents at; give it an "
                         f"eos_token (tokenizer_config.json) or set mop.data.document_mask = false")
    return tokenizer.eos_id


@dataclass
class Run:
    """Everything the steps of a run need, built by `build_run`."""

    layout: RankLayout
    spec: ModelSpec
    seed: int
    micro_batches: int                 # per optimizer step (gradient accumulation)
    dataloader: object
    eos_id: int | None                 # splits packed documents ([mop.data] document_mask), or None
    parts: ModelParts
    optimizers: object                 # torchtitan's OptimizersContainer
    lr_schedulers: object              # torchtitan's LRSchedulersContainer
    schedule_steps: int                # the LR schedule's length: past it, the final LR is held
    train_state: TrainState
    checkpointer: object               # mop_train.train.checkpoint.Checkpointer
    initial_weights: str | None = None  # where a fresh start's weights came from (checkpoint.initial_load_path)


def build_run(cfg, device: torch.device, *, model_args: MoEModelArgs | None = None) -> Run:
    """Build a run's parts in the launch order (module docstring), resume it from the dump folder's
    checkpoint when there is one, and print its description on rank 0 (in a fake world: its rank).
    `model_args` replaces model.flavor's args (a variant of that zoo model)."""
    check_checkpoint_model(cfg)   # another flavor's checkpoints: by name, before the model, not DCP's size mismatch
    lay = cfg.mop.layout
    layout = RankLayout.build(plan_layout(dist.get_world_size(), lay.seq_degree, lay.expert_degree,
                                          lay.vocab_degree), device_type=device.type)
    spec = ModelSpec.resolve(cfg.model.flavor, model_args)
    check_context_fits_model(cfg.training.seq_len, spec.args, spec.flavor)   # not at the first forward
    check_layout_fits(layout.plan, cfg.training, spec.args)
    if cfg.validation.enable:            # before the model: a bad validation batch fails at launch
        check_validation_fits(cfg.validation, spec.args)
    micro_batches = check_titan_parallelism(cfg.parallelism, cfg.training, data_size=layout.data_size)
    memory_warning = _check_device_plan(cfg, _paper_device_plan(cfg, layout, spec, device), device)
    parallel = ParallelizeOptions.from_config(cfg, spec.args)
    if cfg.debug.deterministic:
        # As torchtitan's set_determinism: torch's deterministic kernels (CUDA index_add_ among them,
        # which the top-k combine uses), cuDNN's deterministic algorithms without autotuning, and the
        # cuBLAS workspace setting without which deterministic mode refuses cuBLAS GEMMs (set before the
        # first GEMM makes a cuBLAS handle; a value the user set is kept).
        torch.use_deterministic_algorithms(True, warn_only=cfg.debug.deterministic_warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    seed = seed_everything(cfg.debug.seed, device)
    dataloader, eos_id, tokenizer_dir = _build_data(cfg, layout, spec)
    parts = build_model(cfg, layout, device, spec, parallel)
    _force_routing(cfg, layout, parts)
    plan_terms, host_terms = _check_plans(cfg, layout, parts, spec)
    free_bytes = free_device_bytes(plan_terms, device)
    device_share = _offload_device_share(cfg, parts, free_bytes)
    if device_share:  # the printed plan holds the optimizer state that stays on the device
        plan_terms, host_terms = plan_from_parts(cfg, layout.plan, parts, spec.args, spec.total_params,
                                                 device_fraction=device_share)
    optimizers = build_optimizers([parts.module], cfg.optimizer, cfg.mop.offload_adamw, device_fraction=device_share)
    if cfg.mop.offload_adamw.overlap:
        for opt in optimizers:
            if hasattr(opt, "wait_in_forward"):
                opt.wait_in_forward(forward_units(parts.module))
    for opt in optimizers:   # stage_in_backward: the first buckets' state in, a few after each unit's backward
        if getattr(opt, "stage_in_backward", False):
            # (the root and the embedding are given token ids: their inputs carry no gradient)
            opt.pace_staging([m for m, _ in forward_units(parts.module)
                              if m is not parts.module and m is not parts.model.tok_embeddings])
    oa = cfg.mop.offload_adamw
    if cfg.optimizer.name == OFFLOAD_ADAMW and (oa.weights != "device" or oa.gradients != "device"):
        attach_streaming(optimizers, parts, layout, oa)  # before the checkpointer caches the model's state
    schedule_steps = cfg.lr_scheduler.total_steps or cfg.training.steps
    lr_schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, min(cfg.training.steps, schedule_steps))
    train_state = TrainState(dist.get_rank())
    checkpointer = build_checkpointer(cfg.checkpoint, cfg.job.dump_folder, model=parts.model,
                                      optimizers=optimizers, lr_schedulers=lr_schedulers,
                                      dataloader=dataloader, train_state=train_state,
                                      reliability=cfg.mop.reliability, device=device)
    fresh = cfg.checkpoint.enable and not os.path.isdir(checkpointer.folder)   # torchtitan's initial-load branch
    loaded = checkpointer.load(step=cfg.checkpoint.load_step)
    if train_state.step > 0:   # a resume: the config's lr (and betas, eps, weight_decay), not the checkpoint's
        changed = apply_configured_hyperparameters(optimizers, lr_schedulers, cfg.optimizer)
        if changed:
            checkpointer.note = "\n".join(filter(None, [checkpointer.note, "resumed with " + "; ".join(changed)]))
    if train_state.step == 0:  # fresh start or a model-only load: offloaded masters follow the weights
        for opt in optimizers:
            if hasattr(opt, "reset_masters_from_params"):
                opt.reset_masters_from_params()
    for opt in optimizers:  # weights = "bf16" / "stream": the working weights follow the loaded masters
        if getattr(opt, "working", None) is not None:
            opt.refresh_working()
    run = Run(layout, spec, seed, micro_batches, dataloader, eos_id, parts, optimizers, lr_schedulers,
              schedule_steps, train_state, checkpointer,
              initial_weights=_initial_weights(cfg.checkpoint) if fresh and loaded else None)
    if dist.get_rank() == 0 and not in_fake_world():
        write_run_record(cfg.job.dump_folder, flavor=spec.flavor, args=spec.args, tokenizer_folder=tokenizer_dir,
                         checkpoint_folder=cfg.checkpoint.folder)
    if dist.get_rank() == 0 or in_fake_world():
        auto = parse_device_fraction(getattr(cfg.mop.offload_adamw, "device_fraction", 0.0)) == "auto"
        print(describe_run(cfg, run, device, host_terms, plan_terms,  # what "auto" saw, only when it chose
                           free_device_bytes=free_bytes if device.type == "cuda" and auto else None), flush=True)
        if memory_warning:
            print(memory_warning, flush=True)
    return run


def _paper_device_plan(cfg, layout, spec: ModelSpec, device) -> list | None:
    """The device plan `mop-train plan` prints for this job (a meta model, nothing allocated), so it can be
    held to the GPU before the model is built; the same terms as the built parts' plan (`plan_from_parts`,
    tests/plan/test_device_memory.py). None on a CPU device (nothing to hold it to)."""
    if device.type != "cuda":
        return None
    from mop_train.ops.sco.budget import available_host_bytes
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return plan_for_config(cfg, world=layout.plan.world_size, ranks_per_node=local_ranks,
                           host_bytes=available_host_bytes(), args=spec.args).device_terms


def _check_device_plan(cfg, plan_terms, device, capacity_bytes: int | None = None) -> str | None:
    """The device plan against the GPU's memory (plan.terms.check_device_memory): raises when it would
    run out of memory (unless mop.reliability.refuse_over_memory_plan is false), else the warning to
    print, if any. Nothing to check on a CPU device (or without a plan); `capacity_bytes` replaces the
    GPU's total."""
    if plan_terms is None:
        return None
    if capacity_bytes is None:
        if device.type != "cuda":
            return None
        capacity_bytes = torch.cuda.get_device_properties(device).total_memory
    return check_device_memory(plan_terms, capacity_bytes=capacity_bytes,
                               refuse=cfg.mop.reliability.refuse_over_memory_plan)


def _initial_weights(checkpoint) -> str:
    kind = "Hugging Face safetensors" if checkpoint.initial_load_in_hf else "DCP"
    return f"{checkpoint.initial_load_path} ({kind}{', model only' if checkpoint.initial_load_model_only else ''})"


def routing_profile_of(cfg) -> str:
    """The profile every MoE layer routes by ("" for the router's own choice): [mop.moe]
    routing_profile, "balanced" by default in a fake world."""
    return cfg.mop.moe.routing_profile or ("balanced" if in_fake_world() else "")


def _force_routing(cfg, layout, parts: ModelParts) -> None:
    """Route by the run's profile (`routing_profile_of`); a skewed one's hot experts sit on this
    rank's experts in a fake world (its receiver bound is the one exercised), on position 0's otherwise."""
    profile = routing_profile_of(cfg)
    if profile:
        apply_routing_profile(parts.model, profile, expert_position=layout.expert_rank if in_fake_world() else 0,
                              expert_degree=layout.expert_size)


def _build_data(cfg, layout, spec: ModelSpec):
    """(dataloader, eos_id, tokenizer folder): this rank's sequence group's slice of the data, the EOS id
    that splits packed documents (None without [mop.data] document_mask), where the tokenizer was read."""
    cache_dir = cfg.mop.data.cache_dir or default_cache_dir()
    folder = tokenizer_folder(cfg.model.hf_assets_path, cache_dir=cache_dir)
    tokenizer = build_tokenizer(folder, cache_dir=cache_dir)
    vocab = spec.args.vocab_size
    if tokenizer.get_vocab_size() > vocab:
        raise ValueError(f"the tokenizer at model.hf_assets_path = {cfg.model.hf_assets_path!r} has "
                         f"{tokenizer.get_vocab_size()} tokens but model {cfg.model.flavor!r} has vocab_size "
                         f"{vocab}; use a model with a larger vocabulary or a smaller tokenizer")
    dataloader = build_dataloader(cfg.training, tokenizer, layout.data_rank, layout.data_size,
                                  cache_dir=cache_dir, text_column=cfg.mop.data.text_column)
    return dataloader, document_eos_id(cfg, tokenizer), folder


def _check_plans(cfg, layout, parts: ModelParts, spec: ModelSpec):
    """The per-rank device and pinned host plans; stops the launch when the host's ranks do not fit."""
    from mop_train.ops.sco.budget import available_host_bytes

    plan_terms, host_terms = plan_from_parts(cfg, layout.plan, parts, spec.args, spec.total_params)
    check_host_memory(host_terms, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                      available_bytes=available_host_bytes())
    dist.barrier()  # every rank has read the free host memory before any rank pins its share
    return plan_terms, host_terms


def _offload_device_share(cfg, parts: ModelParts, free_bytes: int) -> float | None:
    """OffloadStreamAdamW's device_fraction, "auto" resolved from the device bytes the plan leaves
    free; None for another optimizer."""
    if cfg.optimizer.name != OFFLOAD_ADAMW:
        return None
    shards = [local(p) for p in parts.module.parameters() if p.requires_grad]
    fp32_aliased = cfg.mop.offload_adamw.weights == "device" and all(t.dtype == torch.float32 for t in shards)
    return resolve_device_fraction(cfg.mop.offload_adamw, local_numel=sum(t.numel() for t in shards),
                                   fp32_weights=fp32_aliased,
                                   free_device_bytes=free_bytes)


def describe_run(cfg, run: Run, device, host_terms, plan_terms, *, free_device_bytes: int | None) -> str:
    """What rank 0 prints at launch: the model, the layout, the batch and operators, both memory
    plans, OffloadStreamAdamW's share, and where the run resumes from."""
    spec, layout, parts, t = run.spec, run.layout, run.parts, cfg.training
    args, micro_batches = spec.args, run.micro_batches
    tiles = model_tiles(parts.model)
    lines = [
        *([fake_world_note()] if in_fake_world() else []),
        f"model {spec.flavor}{'' if spec.args == zoo.get_model_args(spec.flavor) else ' (variant)'}: "
        f"{spec.total_params:,} parameters ({spec.active_params:,} active per token), "
        f"{args.n_layers} blocks, H={args.dim}, V={args.vocab_size}",
        layout.plan.describe().splitlines()[0],
        f"device {device}, W={layout.plan.world_size}, B={t.local_batch_size}, S={t.seq_len}, "
        f"global batch {micro_batches * t.local_batch_size * layout.data_size} sequences "
        f"({micro_batches} micro-batch{'es' if micro_batches > 1 else ''} per step), "
        f"steps={t.steps}, seed={run.seed}, checkpointed blocks {parts.checkpointed}, init {parts.init_mode}, "
        f"dispatch {cfg.mop.moe.dispatch}, loss "
        f"{'ring_dtp' if uses_ring_dtp(cfg, layout) else 'chunked cross-entropy'}"
        + (", document mask on" if cfg.mop.data.document_mask else "")
        + (", attention kept across the recompute" if cfg.mop.attention.keep else "")
        + (f", {tiles.label()}" if tiles.ffn_tokens or tiles.block_tokens else "")
        + (f", routing profile {routing_profile_of(cfg)}" if routing_profile_of(cfg) else ""),
        format_plan(plan_terms),
        format_plan(host_terms, title="per-rank pinned host memory")]
    offload_line = describe_offload(run.optimizers, free_device_bytes=free_device_bytes)
    if offload_line:
        lines.append(offload_line)
    if run.checkpointer.note:
        lines.append(run.checkpointer.note)
    if run.initial_weights:
        lines.append(f"initial weights from {run.initial_weights}")
    step = run.train_state.step
    if step:
        lines.append(f"resumed from step {step} in {run.checkpointer.folder}")
    if step >= t.steps:
        lines.append(f"nothing to train: the checkpoint is at step {step} and training.steps = {t.steps}; "
                     f"raise --training.steps or use a new --job.dump_folder")
    return "\n".join(lines)
