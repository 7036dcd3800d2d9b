"""The checks of a parsed job (torchtitan's JobConfig with our `[mop.*]` sections) before launch.

`mop_train.config.load_job_config` parses a job and calls these; `validate(cfg)` can be called again on a job
the planner changed (mop_train.plan.settings.configure). Each check raises ValueError with where the value
came from, the key, the value and what would fix it, so a job that cannot run fails before launch:
- `check_honoured`: every torchtitan key the loop does not implement keeps torchtitan's default (HONOURED);
- `check_layout_divides`: each `[mop.layout]` degree divides the world size;
- `validate`: the values of our sections and of torchtitan's `[validation]`, `[profiling]`, `[compile]`,
  `[checkpoint]` initial load and `comm.mode` (`validate_run_tools`, `validate_comm_mode`).
"""

import dataclasses

from torchtitan.config import JobConfig as TitanJobConfig

from mop_train.ops.moe_dispatch.options import dispatch_options
from mop_train.ops.offload_adamw.memory import GRADIENTS as STREAM_GRADIENTS, WEIGHTS as STREAM_WEIGHTS
from mop_train.parallel.compile import COMPONENTS as COMPILE_COMPONENTS
from mop_train.units import names_a_unit, parse_bytes, parse_device_fraction


def check_layout_divides(layout, world_size: int, origin) -> None:
    """Each `[mop.layout]` degree must divide W; the error names where it was set, the key, the
    value and the valid degrees."""
    for name in ("seq_degree", "expert_degree", "vocab_degree"):
        v, key = getattr(layout, name), f"mop.layout.{name}"
        if v >= 1 and world_size % v:
            valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"{origin(key)}: {key} = {v} must divide the world size ({world_size} ranks); valid: "
                             f"{valid}; set [mop.layout] {name} or --{key} to one of them (or change the ranks)")


MODEL_NAME = "mop"
"""The one `model.name` mop_train trains (its model family; `model.flavor` picks the size)."""

HONOURED = {
    "job": ("config_file", "dump_folder", "description", "custom_config_module"),
    "metrics": ("log_freq", "enable_tensorboard", "save_tb_folder", "save_for_all_ranks", "enable_wandb"),
    "model": ("name", "flavor", "hf_assets_path"),
    "optimizer": ("name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation",
                  "early_step_in_backward"),
    "lr_scheduler": ("warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"),
    "training": ("dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm",
                 "steps", "dtype", "mixed_precision_param", "mixed_precision_reduce", "dataloader"),
    "parallelism": ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                    "context_parallel_degree", "expert_parallel_degree", "fsdp_reshard_after_forward"),
    "checkpoint": ("enable", "folder", "interval", "initial_load_path", "initial_load_model_only",
                   "initial_load_in_hf", "last_save_model_only", "last_save_in_hf", "export_dtype",
                   "keep_latest_k", "load_step",
                   "exclude_from_loading", "enable_first_step_checkpoint", "enable_ft_dataloader_checkpoints"),
    "activation_checkpoint": ("mode", "selective_ac_option", "preserve_rng_state"),
    "comm": ("init_timeout_seconds", "train_timeout_seconds", "mode"),
    "debug": ("seed", "deterministic", "deterministic_warn_only"),
    "validation": ("enable", "dataset", "dataset_path", "local_batch_size", "seq_len", "freq", "steps",
                   "dataloader"),
    "profiling": ("enable_profiling", "save_traces_folder", "profile_freq", "profiler_active", "profiler_warmup",
                  "enable_memory_snapshot", "save_memory_snapshot_folder"),
    "compile": ("enable", "components", "backend"),
}
"""torchtitan keys the loop reads, per section (the degrees under `parallelism` only as 1, checked
at launch). Any other torchtitan key, and every key of a section not listed (quantize (float8, mx),
fault_tolerance, memory_estimation, experimental), must keep torchtitan's default: `check_honoured`
refuses it rather than ignore it. [validation], [profiling] and [compile] are checked by
`validate_run_tools`."""


def check_honoured(cfg, origin) -> None:
    """Refuse any torchtitan key set away from its default that the loop does not implement.

    Args:
        origin: dotted key -> where its value came from ("configs/x.toml", "command line (--k)").
    """
    defaults = TitanJobConfig()
    if cfg.model.name != MODEL_NAME:
        raise ValueError(f"{origin('model.name')}: model.name = {cfg.model.name!r}; mop_train trains its own "
                         f"model family only: set model.name = {MODEL_NAME!r} and pick a size with model.flavor")
    for section in dataclasses.fields(defaults):
        default_section, ours = getattr(defaults, section.name), getattr(cfg, section.name)
        honoured = HONOURED.get(section.name, ())
        for f in dataclasses.fields(default_section):
            value, default = getattr(ours, f.name), getattr(default_section, f.name)
            if f.name in honoured or value == default:
                continue
            dotted = f"{section.name}.{f.name}"
            what = (f"honoured keys in [{section.name}]: {', '.join(honoured)}" if honoured else
                    f"no key of [{section.name}] is implemented")
            raise ValueError(f"{origin(dotted)}: {dotted} = {value!r} is not implemented by mop_train's loop "
                             f"(it would be ignored); remove it or set it back to {default!r}. {what}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _validate_streaming(cfg, source: str) -> None:
    """[mop.offload_adamw] weights / gradients / weight_window against the optimizer and the run."""
    oa = cfg.mop.offload_adamw
    for key, value, valid in (("weights", oa.weights, STREAM_WEIGHTS), ("gradients", oa.gradients, STREAM_GRADIENTS)):
        _require(value in valid, f"{source}: mop.offload_adamw.{key} = {value!r} must be one of {valid}")
        _require(value == "device" or cfg.optimizer.name == "OffloadStreamAdamW",
                 f"{source}: mop.offload_adamw.{key} = {value!r} needs the fp32 masters on the host: set "
                 f"optimizer.name = 'OffloadStreamAdamW' (now {cfg.optimizer.name!r}) or {key} = 'device'")
    _require(oa.weights != "bf16" or cfg.training.mixed_precision_param == "bfloat16",
             f"{source}: mop.offload_adamw.weights = 'bf16' keeps bf16 working weights, but "
             f"training.mixed_precision_param = {cfg.training.mixed_precision_param!r} computes in fp32; set "
             f"mixed_precision_param = \"bfloat16\", or weights = 'stream' (streams fp32 working weights)")
    _require(not oa.host_init or oa.weights != "device",
             f"{source}: mop.offload_adamw.host_init = true keeps the parameters' values on the host, but "
             f"weights = 'device' computes with them on the device; set weights = 'bf16' or 'stream', or "
             f"host_init = false")
    _require(oa.weights != "stream" or cfg.parallelism.fsdp_reshard_after_forward != "never",
             f"{source}: parallelism.fsdp_reshard_after_forward = 'never' keeps every block's working weights "
             f"on the device from its forward to its backward, but mop.offload_adamw.weights = 'stream' holds "
             f"only a window of {oa.weight_window} blocks there; set fsdp_reshard_after_forward = 'default' or "
             f"weights = 'bf16' / 'device'")
    _require(not isinstance(oa.weight_window, bool) and oa.weight_window >= 1,
             f"{source}: mop.offload_adamw.weight_window = {oa.weight_window!r} must be >= 1 (2 copies one block ahead)")
    _require(oa.weights != "stream" or cfg.mop.moe.dispatch == "local" or cfg.activation_checkpoint.mode == "full",
             f"{source}: mop.offload_adamw.weights = 'stream' reuses an expert block's window slot once its "
             f"forward is done, which needs every block checkpointed, but activation_checkpoint.mode = "
             f"{cfg.activation_checkpoint.mode!r} with mop.moe.dispatch = {cfg.mop.moe.dispatch!r}; set "
             f"activation_checkpoint.mode = \"full\" or weights = 'bf16'")


UNITLESS_FLOOR = 1 << 20
"""A byte size written without a unit below this (1 MiB) is refused: "24" is 24 bytes, surely "24GiB" meant.
Larger bare counts stay valid (the planner writes exact byte counts that are not whole MiB)."""


def _check_byte_text(text: str, key: str) -> int:
    """A byte size of a config key; a small one without a unit was taken as that many bytes (an SCO
    budget of "24" offloaded nothing, silently)."""
    size = parse_bytes(text, key=key)
    if 0 < size < UNITLESS_FLOOR and not names_a_unit(text):
        raise ValueError(f"{key} = {text!r} has no unit, so it is {size} bytes; write the unit, e.g. \"{text}GiB\" "
                         f"or \"{text}MiB\"")
    return size


def validate(cfg, *, source: str = "config") -> None:
    """Value checks that need no world size (the layout checks degrees against W)."""
    lay, moe, mop = cfg.mop.layout, cfg.mop.moe, cfg.mop
    for name in ("seq_degree", "expert_degree", "vocab_degree"):
        v = getattr(lay, name)
        _require(v >= 1, f"{source}: mop.layout.{name} = {v} must be >= 1 (1 turns that split off)")
    peak = mop.metrics.peak_tflops
    _require(not isinstance(peak, bool) and peak >= 0,
             f"{source}: mop.metrics.peak_tflops = {peak!r} must be >= 0 (bf16 dense TFLOP/s per GPU; "
             f"0 = the device's datasheet value)")
    try:  # PipelinedLLEP's options hold every dispatch setting: each is checked whichever schedule runs
        dispatch_options("pipelined_llep", moe)
    except ValueError as err:
        raise ValueError(f"{source}: mop.moe.{err}") from None
    _require(moe.bias_update_rate >= 0, f"{source}: mop.moe.bias_update_rate = {moe.bias_update_rate} must be >= 0")
    _require(mop.data.loss_chunk_tokens >= 1,
             f"{source}: mop.data.loss_chunk_tokens = {mop.data.loss_chunk_tokens} must be >= 1")
    _require(mop.ring_dtp.block_size >= 1, f"{source}: mop.ring_dtp.block_size = {mop.ring_dtp.block_size} must be >= 1")
    if mop.sco.host_budget.strip().lower() != "auto":
        _check_byte_text(mop.sco.host_budget, f"{source}: mop.sco.host_budget")
    _require(mop.offload_adamw.bucket_params >= 1,
             f"{source}: mop.offload_adamw.bucket_params = {mop.offload_adamw.bucket_params} must be >= 1")
    _require(mop.offload_adamw.slots >= 1, f"{source}: mop.offload_adamw.slots = {mop.offload_adamw.slots} must be >= 1")
    _require(0.0 <= mop.offload_adamw.host_fraction <= 1.0,
             f"{source}: mop.offload_adamw.host_fraction = {mop.offload_adamw.host_fraction} must be in [0, 1] "
             "(the share of parameters updated on the CPU; 0 streams everything through the device)")
    _require(mop.offload_adamw.host_fraction == 0.0 or cfg.optimizer.name == "OffloadStreamAdamW",
             f"{source}: mop.offload_adamw.host_fraction = {mop.offload_adamw.host_fraction} only applies to "
             f"optimizer.name = 'OffloadStreamAdamW', but optimizer.name = {cfg.optimizer.name!r}; set one or "
             "drop the other")
    try:
        device_share = parse_device_fraction(mop.offload_adamw.device_fraction)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    _require(device_share == 0.0 or cfg.optimizer.name == "OffloadStreamAdamW",
             f"{source}: mop.offload_adamw.device_fraction = {mop.offload_adamw.device_fraction!r} only applies to "
             f"optimizer.name = 'OffloadStreamAdamW', but optimizer.name = {cfg.optimizer.name!r}; set one or "
             "drop the other")
    _validate_streaming(cfg, source)
    for key in ("overlap", "stage_in_backward"):
        _require(not getattr(mop.offload_adamw, key) or cfg.optimizer.name == "OffloadStreamAdamW",
                 f"{source}: mop.offload_adamw.{key} = true only applies to optimizer.name = 'OffloadStreamAdamW', "
                 f"but optimizer.name = {cfg.optimizer.name!r}")
    if mop.ring_dtp.memory_budget.strip() != "0":
        _check_byte_text(mop.ring_dtp.memory_budget, f"{source}: mop.ring_dtp.memory_budget")
    _require(mop.ring_dtp.token_chunk >= 0,
             f"{source}: mop.ring_dtp.token_chunk = {mop.ring_dtp.token_chunk} must be >= 0 (0: the default)")
    _require(lay.expert_degree == 1 or moe.dispatch != "local",
             f"{source}: mop.moe.dispatch = 'local' keeps all experts on every rank, but "
             f"mop.layout.expert_degree = {lay.expert_degree}; set dispatch to 'ep', 'llep' or 'pipelined_llep'")
    if cfg.metrics.enable_wandb:
        import importlib.util
        _require(importlib.util.find_spec("wandb") is not None,
                 f"{source}: metrics.enable_wandb = true but wandb is not installed; "
                 "pip install 'mop-train[wandb]' (or wandb), or set metrics.enable_wandb = false")
    for key in ("ffn_tokens", "block_tokens"):
        tile = getattr(mop.tiling, key)
        _require(tile == "auto" or (isinstance(tile, int) and tile >= 0),
                 f"{source}: mop.tiling.{key} = {tile!r} must be 0 (untiled), a token count >= 1 or \"auto\"")
    _validate_routing_profile(moe.routing_profile, source)
    validate_comm_mode(cfg, source)
    rel = mop.reliability
    _require(rel.max_consecutive_skips >= 1,
             f"{source}: mop.reliability.max_consecutive_skips = {rel.max_consecutive_skips} must be >= 1")
    _check_initial_load(cfg.checkpoint, source)
    t = cfg.training
    _require(t.seq_len >= 1, f"{source}: training.seq_len = {t.seq_len} must be >= 1")
    _require(t.local_batch_size >= 1, f"{source}: training.local_batch_size = {t.local_batch_size} must be >= 1")
    # steps <= 0 used to launch every rank, build the model and end with "nothing to train", exit 0.
    _require(t.steps >= 1, f"{source}: training.steps = {t.steps} must be >= 1 (the step the run trains up to; "
                           f"a resumed run continues from its checkpoint's step)")
    _validate_optimizer(cfg, source)
    # Both were met as `step % 0` in the ranks: a ZeroDivisionError traceback after the first step.
    _require(cfg.metrics.log_freq >= 1,
             f"{source}: metrics.log_freq = {cfg.metrics.log_freq} must be >= 1 (steps between logged steps; "
             f"the first and the last step are always logged)")
    ck = cfg.checkpoint
    _require(not ck.enable or ck.interval >= 1,
             f"{source}: checkpoint.interval = {ck.interval} must be >= 1 (steps between checkpoints; the last "
             f"step is always saved); or set checkpoint.enable = false")
    # torchtitan refused 1 in the ranks in words naming no key; a negative value kept every checkpoint, silently
    _require(not ck.enable or ck.keep_latest_k == 0 or ck.keep_latest_k >= 2,
             f"{source}: checkpoint.keep_latest_k = {ck.keep_latest_k} must be 0 (keep every checkpoint) or >= 2 "
             f"(the newest may still be being written when an older one is purged)")
    # Every DataLoader worker would iterate the whole packed stream (its Dataset is not split over
    # workers), so each batch would come once per worker: seen as tokens 0, 0, 81, 81, ... at 2 workers.
    _require(t.dataloader.num_workers == 0,
             f"{source}: training.dataloader.num_workers = {t.dataloader.num_workers}: each DataLoader worker "
             f"would read the whole packed stream, so every batch would come {t.dataloader.num_workers} times; "
             f"set training.dataloader.num_workers = 0 (packing runs in the training process, a small share of a step)")
    validate_run_tools(cfg, source=source)


OPTIMIZERS = ("AdamW", "Adam", "OffloadStreamAdamW")
"""optimizer.name values mop_train.train.optim.build_optimizers builds, in the order the message lists them
(a literal: mop_train.train imports this module; tests/test_config_values.py holds it to the builder's tables)."""


def _validate_optimizer(cfg, source: str) -> None:
    """[optimizer] and [lr_scheduler] values. Before this check they were met only in the ranks, after
    the launch: an unknown name by build_optimizers, and a negative lr, beta or eps by
    torch's own "Invalid learning rate: -1.0", which names no key."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    _require(o.name in OPTIMIZERS, f"{source}: optimizer.name = {o.name!r} is not supported; use one of "
                                   f"{', '.join(OPTIMIZERS)}")
    # (OffloadStreamAdamW's build never read it: silently ignored there before this check)
    _require(not o.early_step_in_backward,
             f"{source}: optimizer.early_step_in_backward = true is not supported (it skips gradient clipping "
             f"and the router-bias update order); set it to false")
    for key, ok, rule in (("lr", o.lr >= 0, ">= 0"), ("beta1", 0 <= o.beta1 < 1, "in [0, 1)"),
                          ("beta2", 0 <= o.beta2 < 1, "in [0, 1)"), ("eps", o.eps >= 0, ">= 0"),
                          ("weight_decay", o.weight_decay >= 0, ">= 0")):
        _require(ok, f"{source}: optimizer.{key} = {getattr(o, key)!r} must be {rule}")
    _require(s.warmup_steps >= 0, f"{source}: lr_scheduler.warmup_steps = {s.warmup_steps} must be >= 0")
    _require(0 <= s.min_lr_factor <= 1,
             f"{source}: lr_scheduler.min_lr_factor = {s.min_lr_factor} must be in [0, 1] (the final LR over lr)")
    _require(s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
             f"{source}: lr_scheduler.decay_ratio = {s.decay_ratio} must be in [0, 1] (the share of the schedule "
             f"spent decaying) or unset")


def _check_data_source(section: str, dataset: str, source: str) -> None:
    from mop_train.train.data import SOURCES  # (here: the data module imports torchtitan's datasets)
    _require(dataset in SOURCES, f"{source}: {section}.dataset = {dataset!r} is not a source mop_train reads; "
                                 f"use one of {', '.join(SOURCES)} (\"embedded\": the built-in corpus, no "
                                 f"{section}.dataset_path; the others read {section}.dataset_path)")


def _check_initial_load(ck, source: str) -> None:
    """torchtitan ignores initial_load_path without checkpoint.enable, and asserts on the HF
    combinations it cannot load: say so before launch instead."""
    _require(not ck.initial_load_path or ck.enable,
             f"{source}: checkpoint.initial_load_path = {ck.initial_load_path!r} is read only with "
             f"checkpoint.enable = true (torchtitan would ignore it); set checkpoint.enable = true")
    if not ck.initial_load_in_hf:
        return
    _require(bool(ck.initial_load_path),
             f"{source}: checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path = the Hugging Face "
             f"folder (config.json + model*.safetensors, e.g. what `mop-train export` wrote)")
    _require(ck.initial_load_model_only,
             f"{source}: checkpoint.initial_load_in_hf = true loads weights only; set "
             f"checkpoint.initial_load_model_only = true (safetensors hold no optimizer or data state)")


def _validate_routing_profile(profile: str, source: str) -> None:
    from mop_train.ops.routing_profiles import PROFILES

    if profile in ("", "balanced"):
        return
    parts = profile.split("/")
    ok = len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[0]) <= 100 and int(parts[1]) >= 1
    _require(ok, f"{source}: mop.moe.routing_profile = {profile!r} is not a routing profile; use \"\" (the "
                 f"router decides), \"balanced\", or \"r/h\" (r% of tokens on h hot experts), e.g. one of {PROFILES}")


FAKE_BACKEND_REFUSED = (
    ("checkpoint.enable", lambda cfg: cfg.checkpoint.enable,
     "DCP saves gather every rank's plan and shards", "--checkpoint.no-enable"),
    ("checkpoint.initial_load_path", lambda cfg: bool(cfg.checkpoint.initial_load_path),
     "a load reads every rank's shards", "remove it"),
    ("mop.reliability.check_a2a_splits", lambda cfg: cfg.mop.reliability.check_a2a_splits,
     "it compares the splits of ranks that do not exist", "--mop.reliability.no-check_a2a_splits"),
    ("metrics.save_for_all_ranks", lambda cfg: cfg.metrics.save_for_all_ranks,
     "one process is one rank", "remove it"),
)
"""What `comm.mode = "fake_backend"` cannot stand in for: (key, is set, why, the fix)."""


def validate_comm_mode(cfg, source: str = "config") -> None:
    """comm.mode: "default", or "fake_backend" (one rank of a W-rank job in one process, collectives
    standing in for identical ranks: mop_train.parallel.fake_world) without the settings it cannot
    stand in for. torchtitan's "local_tensor" is not implemented."""
    mode = cfg.comm.mode
    _require(mode in ("default", "fake_backend"),
             f"{source}: comm.mode = {mode!r} is not implemented by mop_train (it would run every rank in one "
             f"process); use \"default\" or \"fake_backend\" (one rank of the job: WORLD_SIZE=W RANK=r)")
    if mode != "fake_backend":
        return
    for key, is_set, why, fix in FAKE_BACKEND_REFUSED:
        _require(not is_set(cfg), f"{source}: {key} cannot run under comm.mode = \"fake_backend\" ({why}); "
                                  f"{fix}")


def validate_run_tools(cfg, *, source: str = "config") -> None:
    """[validation], [profiling] and [compile] (torchtitan's keys) against what the loop can do
    (the device-dependent checks run at build time: a memory snapshot or inductor on CPU)."""
    v, p, c = cfg.validation, cfg.profiling, cfg.compile
    if v.enable:
        _require(v.dataset not in ("c4_validation", "c4"),
                 f"{source}: validation.dataset = {v.dataset!r} (torchtitan's default, a hub download) is not "
                 f"read by mop_train; set validation.dataset = \"embedded\" (the embedded corpus's held-out "
                 f"split) or \"jsonl\" / \"parquet\" / \"text\" / \"hub\" with validation.dataset_path")
        for key in ("freq", "local_batch_size", "seq_len"):
            _require(getattr(v, key) >= 1, f"{source}: validation.{key} = {getattr(v, key)} must be >= 1")
        _require(v.steps >= 1 or v.steps == -1, f"{source}: validation.steps = {v.steps} must be >= 1 (batches "
                 f"per validation) or -1 (one pass over the whole validation set)")
        _check_data_source("validation", v.dataset, source)
        D = cfg.mop.layout.seq_degree
        _require(D < 1 or v.seq_len % D == 0,
                 f"{source}: validation.seq_len = {v.seq_len} must be divisible by mop.layout.seq_degree = {D} "
                 f"(each rank of a sequence group holds seq_len / D positions); e.g. "
                 f"validation.seq_len = {max(D, v.seq_len // D * D)}")
        _require(v.freq <= cfg.training.steps,
                 f"{source}: validation.freq = {v.freq} exceeds training.steps = {cfg.training.steps}, so no "
                 f"validation would run (it runs at multiples of freq); lower validation.freq or set "
                 f"validation.enable = false")
    if p.enable_profiling:
        _require(p.profiler_active >= 1 and p.profiler_warmup >= 0,
                 f"{source}: profiling.profiler_active = {p.profiler_active} must be >= 1 and "
                 f"profiling.profiler_warmup = {p.profiler_warmup} >= 0")
        _require(p.profile_freq >= p.profiler_active + p.profiler_warmup,
                 f"{source}: profiling.profile_freq = {p.profile_freq} must be >= profiler_warmup + profiler_active "
                 f"= {p.profiler_warmup + p.profiler_active} (each cycle of profile_freq steps warms up, then "
                 f"records its last steps); raise profile_freq")
    if p.enable_profiling or p.enable_memory_snapshot:
        _require(p.profile_freq >= 1, f"{source}: profiling.profile_freq = {p.profile_freq} must be >= 1")
    if c.enable:
        bad = [x for x in c.components if x not in COMPILE_COMPONENTS]
        _require(not bad and c.components, f"{source}: compile.components = {c.components!r}: each must be one "
                 f"of {', '.join(COMPILE_COMPONENTS)} (and at least one, with compile.enable = true)")
        import torch._dynamo
        backends = torch._dynamo.list_backends(exclude_tags=())
        _require(c.backend in backends, f"{source}: compile.backend = {c.backend!r} is not a torch.compile backend "
                 f"here; valid: {', '.join(backends)}")
        ring_dtp = cfg.mop.layout.vocab_degree > 1 or cfg.mop.ring_dtp.enable
        _require(not ("loss" in c.components and ring_dtp),
                 f"{source}: compile.components = {c.components!r} compiles the loss, but the loss is Ring-DTP "
                 f"(mop.layout.vocab_degree = {cfg.mop.layout.vocab_degree}, mop.ring_dtp.enable = "
                 f"{str(cfg.mop.ring_dtp.enable).lower()}): its fused kernels and ring collectives cannot be "
                 f"compiled; set compile.components = [\"model\"]")


def check_launch(cfg, world_size: int, model_args, *, source: str = "config") -> None:
    """What the ranks check first, made by `mop-train train` before it starts them (W known): the layout
    against the model and the sequence (seq_len and the heads over D, the experts over E_p), torchtitan's
    parallelism degrees, training.dtype and global_batch_size against W/D, the data source and its
    files, the tokenizer folder, and that the dump folder's checkpoints are of this model, written by
    as many sequence groups, with this optimizer's kind of state. Each was met
    only after the launch before (a rank's error, after torchrun's start-up and rendezvous on every node)."""
    from mop_train.layout import plan_layout
    from mop_train.parallel.parallelize import check_layout_fits, check_titan_parallelism

    lay = cfg.mop.layout
    check_context_fits_model(cfg.training.seq_len, model_args, cfg.model.flavor)
    if cfg.validation.enable:
        from mop_train.train.validate import check_validation_fits
        check_validation_fits(cfg.validation, model_args)
    check_layout_fits(plan_layout(world_size, lay.seq_degree, lay.expert_degree, lay.vocab_degree),
                      cfg.training, model_args)
    check_titan_parallelism(cfg.parallelism, cfg.training, data_size=world_size // lay.seq_degree)
    check_data_paths(cfg, source)
    check_checkpoint_model(cfg)
    check_resume_layout(cfg, world_size)


def check_data_paths(cfg, source: str = "config") -> None:
    """training.dataset is a source mop_train reads and its local files exist; model.hf_assets_path
    (other than the embedded tokenizer) is a folder with tokenizer.json."""
    import os

    from mop_train.train.data import EMBEDDED, LOCAL_FORMATS, _local_files

    t = cfg.training
    _check_data_source("training", t.dataset, source)
    if t.dataset != EMBEDDED and not t.dataset_path:
        raise ValueError(f"training.dataset = {t.dataset!r} needs training.dataset_path (a file, folder or glob"
                         f"{'; or a hub id' if t.dataset == 'hub' else ''})")
    if t.dataset in LOCAL_FORMATS:
        _local_files(t.dataset_path, t.dataset, "training")
    assets = cfg.model.hf_assets_path
    if assets != EMBEDDED and not os.path.isfile(os.path.join(assets, "tokenizer.json")):
        raise ValueError(f"model.hf_assets_path = {assets!r} "
                         f"{'holds no tokenizer.json' if os.path.isdir(assets) else 'is not a folder'}; point it "
                         f"at a folder holding tokenizer.json, or set it to \"{EMBEDDED}\" for the built-in tokenizer")


def check_checkpoint_model(cfg) -> None:
    """A resume from the dump folder's checkpoints must be of the same model.flavor as the run that
    wrote them (`{dump_folder}/mop_model.json`, written at each launch). Without this check another
    flavor's checkpoint failed inside DCP's load on every rank (a size mismatch, or a "Missing key"
    for a key the other model lacks), after the model and optimizer were built."""
    import os

    from mop_train.hf.run_record import RECORD, read_run_record

    ck = cfg.checkpoint
    record_path = os.path.join(cfg.job.dump_folder, RECORD)
    folder = os.path.join(cfg.job.dump_folder, ck.folder)
    if not ck.enable or not os.path.isfile(record_path) or not os.path.isdir(folder):
        return
    if not any(n.startswith("step-") for n in os.listdir(folder)):
        return
    try:
        record = read_run_record(record_path)
    except ValueError:
        return   # an unreadable record proves nothing: the load's own checks judge the checkpoint
    if record.flavor != cfg.model.flavor:
        raise ValueError(f"job.dump_folder = {cfg.job.dump_folder!r} holds checkpoints of model.flavor = "
                         f"{record.flavor!r} ({record_path}), and this run is model.flavor = {cfg.model.flavor!r}: "
                         f"a resume would load the other model's weights; use another --job.dump_folder, or "
                         f"--model.flavor {record.flavor} to resume that run")


def check_resume_layout(cfg, world_size: int) -> None:
    """The checkpoint a resume would take (checkpoint.load_step, else the newest complete one: with its
    manifest) against this launch, from its `.metadata` alone: the number of sequence groups (W/D) that
    wrote its data position, and whether its optimizer state is OffloadStreamAdamW's. The ranks refuse
    both too (train/checkpoint.py: `Checkpointer._match_saved_world`), but only after every rank built the
    model and the optimizer; here `mop-train train` refuses before the launch. Anything unreadable is
    left to the ranks' own checks (verification, the fallback to an older checkpoint)."""
    import os
    import re

    from mop_train.train.integrity import complete, step_folders, weights_alone

    ck = cfg.checkpoint
    folder = os.path.join(cfg.job.dump_folder, ck.folder)
    if not ck.enable or not os.path.isdir(folder):
        return
    steps = [s for s in step_folders(folder) if complete(folder, s)]
    # the ranks resume from the newest checkpoint that holds more than the model (integrity.choose_step):
    # a run's model-only last save is passed over, so the check reads the one they will load
    resumable = [s for s in steps if not weights_alone(folder, s)]
    step = ck.load_step if ck.load_step in steps else (resumable[-1] if resumable and ck.load_step == -1 else None)
    if step is None:
        return
    path = os.path.join(folder, f"step-{step}")
    try:
        import torch.distributed.checkpoint as dcp
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:   # (DCP raises several types for a damaged .metadata: the ranks' checks report it)
        return
    readers = sum(1 for k in keys if re.match(r"dataloader\.dp_rank_\d+$", k))
    groups = world_size // cfg.mop.layout.seq_degree
    if readers and readers != groups:
        raise ValueError(f"checkpoint {path} was written by {readers} sequence groups (W/D) and this launch has "
                         f"{groups} (W = {world_size}, mop.layout.seq_degree = {cfg.mop.layout.seq_degree}); the "
                         f"data position cannot be split differently: resume with W / mop.layout.seq_degree = "
                         f"{readers}, or start afresh in another --job.dump_folder")
    state = [k for k in keys if k.startswith("optimizer.state.")]
    saved_offload, offload = any(k.endswith(".master") for k in state), cfg.optimizer.name == "OffloadStreamAdamW"
    if state and saved_offload != offload:
        saved = "OffloadStreamAdamW" if saved_offload else "AdamW or Adam"
        raise ValueError(f"checkpoint {path} holds the optimizer state of optimizer.name = {saved} and this run "
                         f"uses {cfg.optimizer.name}: that state cannot be loaded into this optimizer; resume with "
                         f"--optimizer.name {'OffloadStreamAdamW' if saved_offload else 'AdamW (or Adam)'}, or start "
                         f"a run in another --job.dump_folder from its weights alone with "
                         f"--checkpoint.initial_load_path {path} --checkpoint.initial_load_model_only")


def check_context_fits_model(seq_len: int, model_args, flavor: str, *, key: str = "training.seq_len") -> None:
    """A sequence longer than the model's max_seq_len (its RoPE table) was refused only by the model's
    forward, in the first step of every rank, "raise max_seq_len in the model args", a field no config
    key sets; `mop-train plan` printed a plan for it and said it fits."""
    _require(seq_len <= model_args.max_seq_len,
             f"{key} = {seq_len:,} exceeds model {flavor}'s max_seq_len = {model_args.max_seq_len:,} (its "
             f"positions); set {key} to at most {model_args.max_seq_len}, or use a model with a longer max_seq_len "
             f"(`mop-train zoo`)")
