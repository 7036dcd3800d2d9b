"""Job configuration: torchtitan 0.2.2's JobConfig plus our `[mop.*]` sections.

A job is one TOML file plus torchtitan-style CLI overrides (`--mop.layout.seq_degree 4`).
`load_job_config(argv)` registers this module as torchtitan's `custom_config_module`, checks the
TOML against the dataclasses below before torchtitan sees it (unknown keys and wrong types name
the key, the value, the file and what would be valid), parses, then validates values
(mop_train.config_checks: the checks of a parsed job, which need no TOML).

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

from mop_train.config_checks import MODEL_NAME, check_honoured, check_layout_divides, validate
from mop_train.ops.moe_dispatch.options import LLEPOptions, PipelinedLLEPOptions


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

    stage_in_backward: bool = False
    """Copy the first `slots` streamed buckets' masters and moments into their staging slots during the
    step's last backward, a few after each FSDP2 unit's backward (OffloadStreamAdamW.pace_staging), while
    gradients leave the other way (they do not depend on the gradients; the update still waits for the
    clipping norm): the step finds them staged. Exact (same copies, earlier), no memory beyond the slots;
    more slots stage more. Queued at once (before 2026-12-06) it was 5% slower at 2 x 4K on an H200; paced,
    still 4% slower there on an H100 (RESULTS.md 2026-12-06: the device->host direction binds the step)."""

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
    leave. Same bits as "device"; OffloadStreamAdamW only. Beside a CPU share (host_fraction > 0) the CPU
    updates its share from the gradients where they landed (no copy back up)."""

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

    refuse_over_memory_plan: bool = True
    """Stop before the first step when the per-rank device memory plan exceeds 1.10x the GPU's memory (measured peaks have been 0.93-1.03x the plan, so the run would run out of memory); false: print a warning and run anyway. A plan between 1.0x and 1.10x always warns."""


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
