"""The settings the end-to-end comparison tries, as frozen objects that know their flags.

TitanSetting is one way to run torchtitan 0.2.2's Trainer on W GPUs: FSDP2 over every rank always
(its default data_parallel_shard_degree = -1 takes what context parallel leaves), expert parallel
degree, context parallel degree (its ring attention; the sequence is sharded through the whole
model, loss included), full or per-op selective activation checkpointing, torch.compile off / on
the loss only / on model and loss, FSDP2 CPU offload (parameters, gradients and optimizer state in
host memory, the optimizer step on the CPU) or not. OurSetting is one layout and operator set of
ours. The candidate lists are ordered by what we expect to be best for each kind of point (the
benchmark runs the first ones its budget allows); the reasons are written beside them. AutoSetting is
ours as `mop-train plan --auto` chooses it for one point (the most tokens/s its cost model predicts
among what its memory plan fits): "ours, best per point", asked anew at each context and batch; its
throughput points run that choice eager and compiled (`AutoSetting.compiled`), since torchtitan's
grid has compile in it.

Legend: W ranks, D seq_degree, E_p expert_degree, P vocab_degree, S context, B local batch, V vocab.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace

from mop_train.sweep import median_after_first, train_command

TITAN_LAUNCHER = "benchmarks.titan_launch"
TITAN, OURS_ALL, OURS_BEST, OURS_AUTO = "torchtitan", "ours-all", "ours-best", "ours-auto"
SERIES = (TITAN, OURS_AUTO, OURS_BEST, OURS_ALL)
COMPILE_COMPONENTS = {"off": [], "loss": ["loss"], "model+loss": ["model", "loss"]}
AC_MEMORY = {"full": 0, "selective": 1, "none": 2}
"""Activation memory order of torchtitan's checkpointing modes (full recomputes every block)."""
COMPILE_MEMORY = {"model+loss": 0, "loss": 1, "off": 2}
"""Memory order of its compile settings (a compiled loss fuses log-softmax: ~4 B per logit, not ~16)."""


@dataclass(frozen=True)
class TitanSetting:
    cp: int = 1
    ep: int = 1
    ac: str = "full"  # "full" | "selective" (torchtitan's per-op SAC) | "none"
    compile: str = "off"  # a key of COMPILE_COMPONENTS
    offload: bool = False

    def __post_init__(self):
        if self.ac not in AC_MEMORY:
            raise ValueError(f"TitanSetting.ac = {self.ac!r}; use one of {list(AC_MEMORY)}")
        if self.compile not in COMPILE_COMPONENTS:
            raise ValueError(f"TitanSetting.compile = {self.compile!r}; use one of {list(COMPILE_COMPONENTS)}")

    @property
    def name(self) -> str:
        return (f"fsdp2-cp{self.cp}-ep{self.ep}-{self.ac}ac-compile_{self.compile.replace('+', '_')}"
                + ("-offload" if self.offload else ""))

    def flags(self) -> list[str]:
        flags = ["--parallelism.context_parallel_degree", str(self.cp),
                 "--parallelism.expert_parallel_degree", str(self.ep),
                 "--activation_checkpoint.mode", self.ac]
        if self.ac == "selective":
            flags += ["--activation_checkpoint.selective_ac_option", "op"]
        if self.compile == "off":
            flags += ["--compile.no-enable"]
        else:
            flags += ["--compile.enable", "--compile.components", ",".join(COMPILE_COMPONENTS[self.compile])]
        flags += ["--training.enable_cpu_offload" if self.offload else "--training.no-enable_cpu_offload"]
        return flags

    def global_batch(self, world: int, local_batch: int) -> int:
        return local_batch * world // self.cp

    def check(self, world: int) -> None:
        """ValueError for a setting torchtitan 0.2.2 cannot run on `world` ranks: degrees that do not
        divide it, or CPU offload at one rank. There parallelize_deepseekv3 applies no FSDP (its
        `fsdp_enabled or ep_enabled` is false, infra/parallelize.py:162), so no CPUOffloadPolicy moves
        the parameters, while the Trainer still builds them on the CPU (train.py:184-186, 256): the
        first forward fails in the embedding's index_select (benchmarks/titan_offload_repro.py)."""
        if world % self.cp or world % self.ep:
            raise ValueError(f"torchtitan setting {self.name}: cp ({self.cp}) and ep ({self.ep}) must divide "
                             f"the {world} ranks; pick degrees among the divisors of {world}")
        if self.offload and world == 1:
            raise ValueError(f"torchtitan setting {self.name}: training.enable_cpu_offload at one rank leaves "
                             f"the parameters on the CPU (no FSDP at one rank); drop offload or use 2+ ranks")

    def holds_at_least(self, other: "TitanSetting") -> bool:
        """Same layout and offload, and at least as much activation memory in both orders (AC_MEMORY,
        COMPILE_MEMORY): if `other` ran out of memory at a point, this one is assumed to as well."""
        return (self != other and (self.cp, self.ep, self.offload) == (other.cp, other.ep, other.offload)
                and AC_MEMORY[self.ac] >= AC_MEMORY[other.ac]
                and COMPILE_MEMORY[self.compile] >= COMPILE_MEMORY[other.compile])


def titan_layouts(world: int) -> list[tuple[int, int]]:
    """(cp, ep) pairs torchtitan runs on `world` ranks, the likely fastest first (CP shards the
    sequence; EP adds all-to-alls but frees expert memory)."""
    if world == 1:
        return [(1, 1)]
    return [(world, 1), (1, 1), (1, world), (world, world)]


TPS_ORDER = [("selective", "model+loss"), ("none", "model+loss"), ("full", "model+loss"),
             ("selective", "loss"), ("none", "loss"), ("full", "loss"),
             ("selective", "off"), ("none", "off"), ("full", "off")]
"""torchtitan's AC x compile grid, the likely fastest first (one H200, 32K: selective + compiled
model and loss 28.1K tokens/s, full + compile 25.9K, selective uncompiled 24.8K; issue 37)."""


def titan_grid(world: int) -> list[TitanSetting]:
    """Every AC x compile setting at every layout of `world` ranks, without CPU offload."""
    return [TitanSetting(cp=cp, ep=ep, ac=ac, compile=c) for ac, c in TPS_ORDER for cp, ep in titan_layouts(world)]


@dataclass(frozen=True)
class OurSetting:
    seq_degree: int = 1
    expert_degree: int = 1
    vocab_degree: int = 1
    dispatch: str = "local"
    ring_dtp: bool = False
    sco: str = "0"  # [mop.sco] host_budget
    optimizer: str = "AdamW"

    @property
    def name(self) -> str:
        ops = [self.dispatch] + (["ringdtp"] if self.ring_dtp else []) + \
              ([f"sco_{self.sco}"] if self.sco != "0" else []) + [self.optimizer]
        return f"D{self.seq_degree}-Ep{self.expert_degree}-P{self.vocab_degree}-" + "-".join(ops)

    def flags(self) -> list[str]:
        return ["--mop.layout.seq_degree", str(self.seq_degree),
                "--mop.layout.expert_degree", str(self.expert_degree),
                "--mop.layout.vocab_degree", str(self.vocab_degree),
                "--mop.moe.dispatch", self.dispatch,
                "--mop.ring_dtp.enable" if self.ring_dtp else "--mop.ring_dtp.no-enable",
                "--mop.sco.host_budget", self.sco, "--optimizer.name", self.optimizer]

    def global_batch(self, world: int, local_batch: int) -> int:
        return local_batch * world // self.seq_degree


@dataclass(frozen=True)
class AutoSetting:
    """Ours with the overrides `mop-train plan --auto --objective throughput` chose for one point."""
    overrides: tuple[str, ...]
    """--section.key value flags, the context and batch left to the point."""
    label: str
    seq_degree: int
    predicted_tokens_per_s: float
    planned_peak_gib: float

    @property
    def name(self) -> str:
        return "auto-" + self.label.replace(", ", "-").replace(" ", "").replace("=", "")

    def flags(self) -> list[str]:
        return list(self.overrides)

    def global_batch(self, world: int, local_batch: int) -> int:
        return local_batch * world // self.seq_degree

    def compiled(self) -> "AutoSetting":
        """The same configuration under torch.compile, as torchtitan's best runs: the blocks, and the
        chunked loss unless Ring-DTP is the loss (P > 1 or enabled), which the config refuses to
        compile. The planner does not model compile, so the prediction and plan stay the eager ones."""
        ring = "--mop.ring_dtp.enable" in self.overrides or _flag_value(self.overrides, "--mop.layout.vocab_degree", "1") != "1"
        return replace(self, overrides=self.overrides + ("--compile.enable", "--compile.components",
                                                         "model" if ring else "model,loss"),
                       label=self.label + ", compiled")


def _flag_value(flags: tuple[str, ...], key: str, default: str) -> str:
    """The value after the last `key` in flags, else default."""
    at = [i for i, f in enumerate(flags[:-1]) if f == key]
    return flags[at[-1] + 1] if at else default


class AutoSettings:
    """`plan --auto` per point of the comparison: `at(seq_len, local_batch)` is the fastest configuration
    the planner fits on `world` GPUs of `gpu_bytes` (less `headroom`) with `host_bytes` per node, or None
    when nothing fits on paper. Answers are cached per point."""

    def __init__(self, config: str, *, world: int, gpu_bytes: int, host_bytes: int, ranks_per_node: int | None = None,
                 headroom: int = 2 << 30, overrides: tuple[str, ...] = ()):
        self.config, self.world, self.gpu_bytes, self.host_bytes = config, world, gpu_bytes, host_bytes
        self.ranks_per_node, self.headroom, self.overrides = ranks_per_node or world, headroom, tuple(overrides)
        self._points: dict[tuple[int, int], AutoSetting | None] = {}

    def at(self, seq_len: int, local_batch: int) -> AutoSetting | None:
        if (seq_len, local_batch) not in self._points:
            self._points[(seq_len, local_batch)] = self._plan(seq_len, local_batch)
        return self._points[(seq_len, local_batch)]

    def _plan(self, seq_len: int, local_batch: int) -> AutoSetting | None:
        from mop_train.config import load_job_config
        from mop_train.models import zoo
        from mop_train.plan.auto import AutoPlanner, NothingFits
        from mop_train.plan.settings import fixed_keys, search_base_flags

        fixed = fixed_keys(list(self.overrides))
        point = ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(local_batch)]
        cfg = load_job_config(["--job.config_file", self.config, *search_base_flags(fixed), *self.overrides, *point],
                              model_flavors=zoo.names())
        planner = AutoPlanner(cfg, fixed=fixed, world=self.world,
                              ranks_per_node=self.ranks_per_node, gpu_bytes=self.gpu_bytes,
                              host_bytes=self.host_bytes, headroom=self.headroom)
        try:
            chosen = planner.fastest_at(seq_len, explain=False).chosen
        except NothingFits:
            return None
        flags = chosen.settings.flags(cfg)
        i = flags.index("--training.seq_len")
        return AutoSetting(tuple(self.overrides) + tuple(flags[:i] + flags[i + 2:]), chosen.settings.label(),
                           chosen.settings.seq_degree, round(chosen.tokens_per_s), round(chosen.device / 2**30, 1))


def all_operators(vocab_degree: int = 1, world: int = 2) -> OurSetting:
    """Every operator on: Ulysses over all ranks, PipelinedLLEP over all ranks, Ring-DTP, SCO, OffloadStreamAdamW."""
    return OurSetting(seq_degree=world, expert_degree=world, vocab_degree=vocab_degree,
                      dispatch="pipelined_llep", ring_dtp=True, sco="auto", optimizer="OffloadStreamAdamW")


def candidates(world: int, vocab_degree: int) -> dict[str, dict[str, list]]:
    """{series: {kind: settings in order of expected merit}} for kinds "tps", "reach", "batch".

    torchtitan: every AC x compile x layout setting for throughput (titan_grid: the benchmark runs
    all that its budget fits and reports the fastest). For reach and batch the most frugal first:
    full AC and a compiled loss (torchtitan materialises [S, V] logits; its eager loss holds ~4 more
    fp32/bf16 copies of them, the compiled one ~4 B per logit), with CPU offload (frees the 16 B/param
    of FSDP-sharded state) only at 2+ ranks: at one rank torchtitan applies no FSDP, so offload cannot
    run there (TitanSetting.check). Ours: the plain layout for throughput (the optimizer state fits at
    this size), every operator for reach, SCO + the streamed optimizer for batch.
    """
    t = TitanSetting
    ours_all = all_operators(vocab_degree, world)
    frugal = [t(cp=world, ep=1, ac="full", compile="loss"), t(cp=world, ep=1, ac="full", compile="model+loss"),
              t(cp=world, ep=1, ac="full"), t(cp=world, ep=1, ac="selective", compile="model+loss")]
    batch = [t(ac="full", compile="loss"), t(ac="full", compile="model+loss"), t(ac="full")]
    if world > 1:
        frugal = [t(cp=world, ep=1, ac="full", compile="loss", offload=True), t(cp=world, ep=1, ac="full", offload=True),
                  t(cp=world, ep=world, ac="full", compile="loss", offload=True)] + frugal
        batch = [t(ac="full", compile="loss", offload=True)] + batch
    ours_tps = [OurSetting()]
    if world > 1:
        ours_tps += [OurSetting(seq_degree=world, expert_degree=world, dispatch="ep"),
                     OurSetting(expert_degree=world, dispatch="ep")]
    return {
        "torchtitan": {"tps": titan_grid(world), "reach": frugal, "batch": batch},
        "ours-all": {"tps": [ours_all], "reach": [ours_all], "batch": [ours_all]},
        "ours-best": {"tps": ours_tps, "reach": [ours_all],
                      "batch": [OurSetting(sco="auto", optimizer="OffloadStreamAdamW"), ours_all]},
    }


LOSS_SCHEDULE = {"lr": 3e-4, "warmup_steps": 1, "decay_type": "cosine", "min_lr_factor": 0.1}
"""What both sides' runs share (configs/small_1gpu.toml's optimizer and schedule); the loss-curve
phase raises warmup_steps for both."""


def schedule_flags(warmup_steps: int) -> list[str]:
    return ["--optimizer.lr", str(LOSS_SCHEDULE["lr"]), "--lr_scheduler.warmup_steps", str(warmup_steps),
            "--lr_scheduler.decay_type", LOSS_SCHEDULE["decay_type"],
            "--lr_scheduler.min_lr_factor", str(LOSS_SCHEDULE["min_lr_factor"])]


def titan_command(nproc: int, folder: str, setting: TitanSetting, **kwargs) -> list[str]:
    """torchrun over our launcher: torchtitan's Trainer, DeepSeek-V3 at `flavor`, our data.
    ValueError for a setting torchtitan cannot run on `nproc` ranks (TitanSetting.check)."""
    setting.check(nproc)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", TITAN_LAUNCHER, *titan_flags(folder, setting, **kwargs)]


def titan_flags(folder: str, setting: TitanSetting, *, flavor: str, seq_len: int, local_batch: int,
                steps: int, timeout_s: float, hf_assets_path: str = "embedded", warmup_steps: int = 1) -> list[str]:
    """torchtitan's flags for one run; optimizer, schedule and precision as configs/small_1gpu.toml
    has them. `hf_assets_path`: the embedded tokenizer's folder (or "embedded", which our launcher resolves)."""
    return ["--job.dump_folder", folder, "--model.name", "deepseek_v3_mop", "--model.flavor", flavor,
            "--model.hf_assets_path", hf_assets_path, "--training.dataset", "embedded",
            "--training.seq_len", str(seq_len), "--training.local_batch_size", str(local_batch),
            "--training.steps", str(steps), "--training.max_norm", "1.0",
            "--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32",
            "--optimizer.name", "AdamW", "--optimizer.weight_decay", "0.1", *schedule_flags(warmup_steps),
            "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--checkpoint.no-enable", "--debug.seed", "0",
            # torchtitan drops its collective timeout to 100 s after step 1; a long step must not trip it.
            "--comm.train_timeout_seconds", str(int(timeout_s) + 60), *setting.flags()]


def our_command(config: str, nproc: int, folder: str, setting: OurSetting, *, seq_len: int,
                local_batch: int, steps: int, warmup_steps: int | None = None) -> list[str]:
    """torchrun of our trainer; `warmup_steps` (with the shared schedule) or the config's schedule."""
    schedule = schedule_flags(warmup_steps) if warmup_steps is not None else []
    return train_command(config, nproc, folder,
                         ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(local_batch),
                          "--metrics.no-enable-tensorboard", *schedule, *setting.flags()], steps=steps)


def read_titan_metrics(folder: str) -> dict:
    """Figures of a finished torchtitan run from the metrics.jsonl our launcher writes (rank 0):
    tokens/s over all ranks = median over steps after the first of tps x world size; peak memory =
    the largest per-step `max_active` (the allocator's in-use peak, as our max_allocated), reserved beside it."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise ValueError(f"{folder}/metrics.jsonl is empty")
    world = records[0]["world_size"]
    return {"steps": len(records),
            "tokens_per_s": median_after_first([r["throughput(tps)"] * world for r in records]),
            "tflops": median_after_first([r["tflops"] for r in records]),
            "peak_mem_gib": max(r["memory/max_active(GiB)"] for r in records),
            "peak_reserved_gib": max(r["memory/max_reserved(GiB)"] for r in records),
            "peak_mem_kind": "cuda_max_active", "final_loss": records[-1]["loss_metrics/global_avg_loss"]}


def read_losses(folder: str, key: str) -> list[float]:
    """Every logged step's loss of a finished run (its metrics.jsonl, rank 0): `key` is
    "loss_metrics/global_avg_loss" for torchtitan, "loss" for ours."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def runs_on(setting, world: int) -> bool:
    """Whether torchtitan can run `setting` on `world` ranks (TitanSetting.check)."""
    try:
        setting.check(world)
    except ValueError:
        return False
    return True


def pair(text: str, sep: str, *, ordered: bool = True) -> tuple[int, int]:
    """"LO<sep>HI" -> (LO, HI), both >= 1 (and LO < HI when `ordered`)."""
    lo, hi = (int(v) for v in text.split(sep))
    if min(lo, hi) < 1 or (ordered and lo >= hi):
        raise ValueError(f"{text!r}: need 1 <= LO" + (" < HI" if ordered else " and 1 <= HI"))
    return lo, hi


def brackets(items: list[str], key: str) -> dict[str, tuple[int, int]]:
    """["torchtitan=65536:131072", ...] -> {series: (lo, hi)}."""
    out = {}
    for item in items or []:
        series, _, span = item.partition("=")
        if series not in SERIES:
            raise ValueError(f"{key} {item!r}: series must be one of {SERIES}, e.g. {key} torchtitan=65536:131072")
        try:
            out[series] = pair(span, ":")
        except ValueError as err:
            raise ValueError(f"{key} {item!r}: {err}; write SERIES=LO:HI, e.g. torchtitan=65536:131072") from None
    return out
