"""Job configuration: torchtitan 0.2.2's JobConfig plus our `[mop.*]` sections.

A job is one TOML file plus torchtitan-style CLI overrides (`--mop.layout.seq_degree 4`).
`load_job_config(argv)` registers this module as torchtitan's `custom_config_module`, checks the
TOML against the dataclasses below before torchtitan sees it (unknown keys and wrong types name
the key, the value, the file and what would be valid), parses, then validates values.

Each dataclass is one TOML section; each field's docstring becomes its CLI help.
"""


import contextlib
import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TitanJobConfig

from mop_train.ops.moe_dispatch.options import LLEPOptions, PipelinedLLEPOptions, dispatch_options
from mop_train.ops.offload_adamw.memory import GRADIENTS as STREAM_GRADIENTS, WEIGHTS as STREAM_WEIGHTS
from mop_train.parallel.compile import COMPONENTS as COMPILE_COMPONENTS
from mop_train.units import parse_bytes, parse_device_fraction


@dataclass
class Layout:
    seq_degree: int = 1
    """D: ranks that share one sequence (Ulysses all-to-all over heads). Must divide the world size."""

    expert_degree: int = 1
    """E_p: ranks holding disjoint expert shards. Must divide the world size and the expert count."""

    vocab_degree: int = 1
    """P: ranks holding disjoint vocabulary intervals of the output projection. Must divide the world size."""


@dataclass
class MoE:
    """The expert dispatch: the schedule's settings have their defaults and checks in
    mop_train.ops.moe_dispatch.options (one frozen dataclass per schedule)."""

    dispatch: Literal["local", "ep", "llep", "pipelined_llep"] = "local"
    """Expert dispatch schedule. "local" needs expert_degree = 1."""

    token_budget: int = PipelinedLLEPOptions.token_budget
    """PipelinedLLEP c: per-source token budget per chunk (K = min(ceil(N / c), max_chunks))."""

    max_chunks: int = PipelinedLLEPOptions.max_chunks
    """PipelinedLLEP K_max: ceiling on the chunk count."""

    membership: Literal["strided", "contiguous"] = PipelinedLLEPOptions.membership
    """PipelinedLLEP chunk membership: strided (positions i, i+K, ...) or contiguous blocks."""

    alpha: float = LLEPOptions.alpha
    """LLEP capacity factor: each rank's capacity is floor(alpha * total_routes / E_p)."""

    min_tokens_per_gemm: int = LLEPOptions.min_tokens_per_gemm
    """LLEP m: smallest chunk handed to a helper rank (except a final remainder)."""

    imbalance_threshold: float = LLEPOptions.imbalance_threshold
    """LLEP lambda: relocate only when max-over-mean rank load reaches this."""

    bias_update_rate: float = 1e-3
    """Auxiliary-loss-free balancing: step size of the per-expert routing bias update (0 disables)."""

    routing_profile: str = ""
    """Force every MoE layer's routes to a profile of mop_train.ops.routing_profiles ("balanced", or
    "r/h": r% of tokens on h hot experts, e.g. "80/16"); the router still computes its weights. "" lets
    the router choose; with comm.mode = "fake_backend", "" means "balanced". A skewed profile's hot
    experts are those of expert-group position 0 onward (in a fake world: the emulated rank's)."""


@dataclass
class RingDTP:
    enable: bool = False
    """Use Ring-DTP for the output projection + cross-entropy even at vocab_degree = 1."""

    mode: Literal["auto", "move_activations", "move_weights"] = "auto"
    """Which tensor travels the ring; auto moves weights exactly when N > V/P."""

    block_size: int = 8192
    """Vocabulary rows per fused projection + online log-sum-exp block."""

    schedule: Literal["auto", "recompute", "grad_in_forward"] = "auto"
    """recompute: backward recomputes the logits (4 GEMM passes, least memory); grad_in_forward: dX and
    dW are formed in the forward (3 passes, an fp32 dW shard accumulator); auto: grad_in_forward when
    its bound fits memory_budget."""

    memory_budget: str = "0"
    """Bytes above the inputs Ring-DTP may use ("6GiB"); "0": none given, so auto takes recompute."""

    token_chunk: int = 0
    """grad_in_forward's tokens per ring chunk (0: the operator's default)."""


@dataclass
class SCO:
    host_budget: str = "0"
    """Pinned host bytes per rank for checkpoint boundaries: "0" (off), "24GiB", "512MiB", "auto"."""


@dataclass
class OffloadAdamW:
    bucket_params: int = 25_000_000
    """Parameters per streamed bucket (buckets may split tensors; 25M x 3 slots measured fastest, RESULTS.md)."""

    slots: int = 3
    """Device staging slots (2+ overlaps transfers with the update)."""

    host_fraction: float = 0.0
    """Share of the streamed parameters (those not kept on the device) the CPU updates in place while the
    rest streams (0 = stream all; keep 0 when several ranks share a host: see benchmarks/RESULTS.md)."""

    device_fraction: str = "0"
    """Share of the optimizer state kept and updated on the device (the forward's first weights): a
    number in [0, 1], or "auto" (what fits the device memory the plan leaves, minus 2 GiB)."""

    overlap: bool = False
    """Overlap the streamed step with the next forward: each FSDP2 unit waits only for its own buckets
    (same values: bitwise on one H200 with weights and gradients streamed, 2026-12-01)."""

    host_init: bool = False
    """With weights = "bf16" or "stream": a model initialised shard by shard (over 2B parameters) is
    initialised one piece (embedding, block, norm, projection) at a time on the device and its values
    kept on the host, where the masters take them: the start-up holds one piece, not every local
    parameter in fp32 (the memory plan's "start-up" line). Same values bit for bit. Tested on CPU; not
    yet run on a GPU, hence off by default."""

    weights: Literal["device", "bf16", "stream"] = "device"
    """Device copy of the weights: "device" keeps each parameter's fp32 tensor (FSDP2 shard, expert and
    vocab shards); "bf16" keeps only bf16 working weights (2 B/param; needs bf16 compute), the step
    writing bf16(master) into them; "stream" keeps none: each block's working weights are copied
    host -> device one block ahead into weight_window slots (needs activation_checkpoint.mode = "full"
    with sharded experts). Same losses and parameters bit for bit; OffloadStreamAdamW only."""

    gradients: Literal["device", "stream"] = "device"
    """"stream": each block's fp32 gradient is copied to the host as it becomes final (after FSDP2's
    reduce-scatter or the replica sum) and its device memory released; the norm is formed as they
    leave. Same bits as "device"; OffloadStreamAdamW with host_fraction = 0 only."""

    weight_window: int = 2
    """weights = "stream": block-sized device slots per window (2 copies one block ahead)."""


@dataclass
class Attention:
    keep: bool = False
    """Keep each checkpointed block's attention output and log-sum-exp (B*S/D*heads*(d_v*act + 4) bytes
    per layer per rank) so the recompute skips the attention kernel; exact."""


@dataclass
class Tiling:
    """Sequence tiling of a block's per-token stages (mop_train.ops.tiling): at long context their
    intermediates are one tile's, not S/D tokens'. Exact (bitwise forward and input gradients on CPU,
    weight gradients summed in fp32); each tiled stage runs its forward once more in backward."""

    ffn_tokens: int | Literal["auto"] = 0
    """Tokens per tile of the dense FFN and the shared expert: 0 (untiled), a count, or "auto" (the
    largest multiple of 1024 whose tile working set fits mop_train.ops.tiling.memory.AUTO_TILE_BYTES;
    untiled when a rank's tokens fit in one tile)."""

    block_tokens: int | Literal["auto"] = 0
    """Tokens per tile of attention's norm, projections and RoPE (before the core) and its output
    projection (after): 0 (untiled), a count, or "auto" (as ffn_tokens). The core's q, k, v, output
    and log-sum-exp stay whole."""


@dataclass
class Data:
    text_column: str = "text"
    """Column holding each document's text (jsonl / parquet / hub sources)."""

    cache_dir: str = ""
    """Where the embedded corpus and tokenizer are built; "" = $MOP_TRAIN_CACHE or ~/.cache/mop_train."""

    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the plain (vocab_degree = 1, Ring-DTP off) cross-entropy: live logits are chunk x V fp32."""

    document_mask: bool = False
    """Keep attention inside each packed document (split at the tokenizer's EOS); off = documents attend across EOS."""


@dataclass
class Reliability:
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A step whose loss or gradient norm is NaN/inf on any rank: "skip" updates nothing (parameters, optimizer state, LR schedule position, router biases; the batch is consumed), counted in metrics.jsonl; "stop" exits 3 naming the step, the ranks and the first non-finite gradient."""

    max_consecutive_skips: int = 10
    """With on_nonfinite = "skip": stop (exit 3) once this many steps in a row were non-finite."""

    resume_from_verified: bool = False
    """When the newest checkpoint fails its checksum manifest, resume from the newest one that passes instead of stopping (exit 4)."""

    save_on_sigterm: bool = True
    """On SIGTERM every rank finishes its step, saves a resumable checkpoint (with checkpoint.enable) and exits 5."""

    check_a2a_splits: bool = False
    """Debug: before every expert all-to-all, check that each rank's receive splits are the transpose of the send splits (one extra all-gather per all-to-all)."""

    lock_dump_folder: bool = True
    """Refuse to start on a dump folder another live job holds (lock file naming its host and pid)."""


@dataclass
class Metrics:
    peak_tflops: float = 0.0
    """MFU's denominator, bf16 dense TFLOP/s per GPU: 0 takes the device's datasheet value
    (mop_train.train.metrics.PEAK_BF16_TFLOPS: H100/H200 989, A100 312; none on CPU). Set it to what
    your GPUs really sustain (a power-capped or NVL part runs lower: our lent H200 does ~790)."""


@dataclass
class Mop:
    layout: Layout = field(default_factory=Layout)
    reliability: Reliability = field(default_factory=Reliability)
    data: Data = field(default_factory=Data)
    moe: MoE = field(default_factory=MoE)
    ring_dtp: RingDTP = field(default_factory=RingDTP)
    sco: SCO = field(default_factory=SCO)
    offload_adamw: OffloadAdamW = field(default_factory=OffloadAdamW)
    attention: Attention = field(default_factory=Attention)
    tiling: Tiling = field(default_factory=Tiling)
    metrics: Metrics = field(default_factory=Metrics)


@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig through `job.custom_config_module = "mop_train.config"`."""

    mop: Mop = field(default_factory=Mop)


CUSTOM_CONFIG_MODULE = __name__


# ---------------------------------------------------------------------------------------------
# Loading and checking
# ---------------------------------------------------------------------------------------------

def merged_config_class() -> type:
    """torchtitan's JobConfig with our `mop` section merged in (what `parse_args` returns)."""
    return ConfigManager._merge_configs(TitanJobConfig, JobConfig)


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _describe_type(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def check_toml_against(cls: type, data: dict, *, path: str, prefix: str = "") -> None:
    """Raise ValueError for the first unknown key or wrongly typed value in `data` (a TOML table)."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in by_name:
            close = difflib.get_close_matches(key, list(by_name), n=3)
            hint = f" Did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ValueError(f"{path}: unknown key '{dotted}'.{hint} Valid keys in "
                             f"[{prefix.rstrip('.') or 'top level'}]: {', '.join(sorted(by_name))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ValueError(f"{path}: '{dotted}' must be a table [{dotted}], got {value!r}")
            check_toml_against(tp, value, path=path, prefix=f"{dotted}.")
        elif not _type_ok(value, tp):
            raise ValueError(f"{path}: '{dotted}' = {value!r} has the wrong type; expected {_describe_type(tp)}")


def _find_config_file(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for key in ("--job.config_file", "--job.config-file"):
            if arg == key and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1]
    return None


def load_toml(path: str) -> dict:
    """Read a TOML job file; a missing or malformed file is a ValueError naming the path."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path!r}; pass an existing TOML file with "
                         f"--job.config_file (see configs/ for examples)") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {path!r} is not valid TOML: {err}") from None


def _given_on_command_line(argv: list[str], dotted: str) -> bool:
    flags = {f"--{dotted}", f"--{dotted.replace('_', '-')}"}
    flags |= {f"--{'.'.join(dotted.split('.')[:-1])}.no-{dotted.split('.')[-1]}"} if "." in dotted else set()
    return any(a.split("=")[0] in flags for a in argv)


def _in_toml(data: dict, dotted: str) -> bool:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@contextlib.contextmanager
def _quiet_embedded_assets():
    """Drop torchtitan's "HF assets path embedded does not exist!" while it parses: "embedded" is our
    tokenizer's name, not a folder (mop_train.train.data), and the warning misleads every tool that
    loads a config. Any other path's warning stays."""
    from torchtitan.tools.logging import logger

    from mop_train.train.data import EMBEDDED

    def keep(record) -> bool:
        return f"HF assets path {EMBEDDED} does not exist" not in record.getMessage()
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def load_job_config(argv: list[str] | None = None, *, model_flavors: list[str] | None = None,
                    world_size: int | None = None):
    """Parse TOML + CLI overrides into the merged JobConfig, checked and validated.

    Args:
        model_flavors: the names `model.flavor` may take (the training loop passes the zoo's);
            None leaves the flavor unchecked here.
        world_size: W, when the launch knows it (the loop, `mop-train train`): each
            `[mop.layout]` degree must divide it; None leaves that to the layout.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    path = _find_config_file(argv)
    data = {}
    if path is not None:
        data = load_toml(path)
        check_toml_against(merged_config_class(), data, path=path)
    custom_flags = [a for a in argv if a.split("=")[0] in ("--job.custom_config_module",
                                                              "--job.custom-config-module")]
    custom = data.get("job", {}).get("custom_config_module", "")
    if custom not in ("", CUSTOM_CONFIG_MODULE) or custom_flags:
        where = "command line" if custom_flags else path
        raise ValueError(f"{where}: job.custom_config_module is not accepted (mop_train registers "
                         f"{CUSTOM_CONFIG_MODULE!r} itself and imports no other module named by a config); "
                         f"remove the key")
    argv += ["--job.custom_config_module", CUSTOM_CONFIG_MODULE]
    if not _in_toml(data, "model.name") and not _given_on_command_line(argv, "model.name"):
        argv += ["--model.name", MODEL_NAME]   # torchtitan's default ("llama3") is not ours
    try:
        with _quiet_embedded_assets():
            cfg = ConfigManager().parse_args(argv)
    except AssertionError as err:  # torchtitan's own __post_init__ checks (validation.steps, ...)
        raise ValueError(f"{path or 'command line'}: {err}") from None

    def origin(dotted: str) -> str:
        if _given_on_command_line(argv, dotted):
            return f"{path + ' with ' if path else ''}command line (--{dotted})"
        return path if path is not None and _in_toml(data, dotted) else "default"

    check_honoured(cfg, origin)
    if model_flavors is not None and cfg.model.flavor not in model_flavors:
        raise ValueError(f"{origin('model.flavor')}: model.flavor = {cfg.model.flavor!r} is not a mop_train "
                         f"model; valid: {', '.join(model_flavors)} (`mop-train zoo` lists their sizes)")
    validate(cfg, source=path or "command line")
    if world_size is not None:
        check_layout_divides(cfg.mop.layout, world_size, origin)
    return cfg


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
                    "context_parallel_degree", "expert_parallel_degree"),
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
    _require(oa.gradients != "stream" or oa.host_fraction == 0.0,
             f"{source}: mop.offload_adamw.gradients = 'stream' with host_fraction = {oa.host_fraction} is not "
             f"supported yet (the CPU share reads device gradients); set host_fraction = 0 or gradients = 'device'")
    _require(not oa.host_init or oa.weights != "device",
             f"{source}: mop.offload_adamw.host_init = true keeps the parameters' values on the host, but "
             f"weights = 'device' computes with them on the device; set weights = 'bf16' or 'stream', or "
             f"host_init = false")
    _require(not isinstance(oa.weight_window, bool) and oa.weight_window >= 1,
             f"{source}: mop.offload_adamw.weight_window = {oa.weight_window!r} must be >= 1 (2 copies one block ahead)")
    _require(oa.weights != "stream" or cfg.mop.moe.dispatch == "local" or cfg.activation_checkpoint.mode == "full",
             f"{source}: mop.offload_adamw.weights = 'stream' reuses an expert block's window slot once its "
             f"forward is done, which needs every block checkpointed, but activation_checkpoint.mode = "
             f"{cfg.activation_checkpoint.mode!r} with mop.moe.dispatch = {cfg.mop.moe.dispatch!r}; set "
             f"activation_checkpoint.mode = \"full\" or weights = 'bf16'")


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
        parse_bytes(mop.sco.host_budget, key=f"{source}: mop.sco.host_budget")
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
    _require(not mop.offload_adamw.overlap or cfg.optimizer.name == "OffloadStreamAdamW",
             f"{source}: mop.offload_adamw.overlap = true only applies to optimizer.name = 'OffloadStreamAdamW', "
             f"but optimizer.name = {cfg.optimizer.name!r}")
    if mop.ring_dtp.memory_budget.strip() != "0":
        parse_bytes(mop.ring_dtp.memory_budget, key=f"{source}: mop.ring_dtp.memory_budget")
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
    validate_run_tools(cfg, source=source)


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
