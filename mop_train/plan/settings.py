"""One configuration of `mop-train plan --auto` (mop_train.plan.auto): the searched keys, the
TOML overrides that set them, the job with them applied, and its memory plan and predicted step.

    s = Settings(seq_len=131072, seq_degree=2, expert_degree=2, vocab_degree=1, dispatch="pipelined_llep",
                 token_budget=8192, ring_dtp=False, ac_mode="full", sco_budget="6GiB",
                 optimizer="OffloadStreamAdamW", device_fraction="0.5")
    s.flags(base)          # ["--training.seq_len", "131072", "--mop.layout.seq_degree", "2", ...]
    fast_plan(configure(base, s), world=2, ranks_per_node=2, host_bytes=256 * GIB)   # a JobPlan

`fast_plan` is `job.plan_for_config` with the meta model built once per flavor (building it is
most of a plan's cost: ~90 ms for mop-667b, against ~0.4 ms for the rest); tests/plan/test_auto_plan.py
checks the two agree term by term.

Legend: W ranks, D / E_p / P the degrees, S context.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import torch

from mop_train.layout import plan_layout
from mop_train.models import zoo
from mop_train.models.model import MoETransformer
from mop_train.ops.offload_adamw import OFFLOAD_ADAMW
from mop_train.ops.sco import resolve_host_budget
from mop_train.parallel.parallelize import check_layout_fits, check_titan_parallelism, checkpointed_layer_ids
from mop_train.parallel.precision import MixedPrecision
from mop_train.plan.cost_model import StepPrediction
from mop_train.plan.job import (JobPlan, fsdp_block_params, fsdp_head_params, fsdp_root_params, kept_out_of_fsdp,
                                local_head_params, local_param_count, memory_plans)

SEARCHED_KEYS = ("training.seq_len", "mop.layout.seq_degree", "mop.layout.expert_degree", "mop.layout.vocab_degree",
                 "mop.moe.dispatch", "mop.moe.token_budget", "mop.ring_dtp.enable", "mop.sco.host_budget",
                 "optimizer.name", "mop.offload_adamw.device_fraction", "mop.offload_adamw.weights",
                 "mop.offload_adamw.gradients", "mop.offload_adamw.host_fraction", "activation_checkpoint.mode",
                 "mop.tiling.ffn_tokens", "mop.tiling.block_tokens", "mop.attention.keep", "mop.ring_dtp.schedule",
                 "parallelism.fsdp_reshard_after_forward")


def fixed_keys(overrides: list[str]) -> set[str]:
    """The keys the command line sets that constrain the search (`--mop.layout.seq_degree 2`,
    `--mop.ring_dtp.no-enable`): the searched ones, and OffloadStreamAdamW's own options (given, they
    keep the optimizer offloaded, as a given CPU share does)."""
    given = set()
    for arg in overrides:
        if arg.startswith("--"):
            section, _, key = arg[2:].split("=", 1)[0].replace("-", "_").rpartition(".")
            given |= {f"{section}.{key}", f"{section}.{key.removeprefix('no_')}"}
    return given & (set(SEARCHED_KEYS) | set(OFFLOAD_ONLY_KEYS))


OFFLOAD_ONLY_KEYS = ("mop.offload_adamw.overlap", "mop.offload_adamw.host_init", "mop.offload_adamw.stage_in_backward")
"""OffloadStreamAdamW's own options that are not searched: given (and on), they keep the optimizer offloaded;
host_init also keeps the working weights off the device (bf16 or streamed), where it takes effect."""


def search_base_flags(fixed: set[str]) -> list[str]:
    """Flags to put before the user's overrides when loading the job a search starts from, so that the
    config's own values of keys the search will set cannot make the user's choices invalid together
    (a given expert_degree > 1 beside the config's dispatch = "local"; a given OffloadStreamAdamW option
    beside the config's AdamW). The search replaces every one of them."""
    flags = [] if "mop.moe.dispatch" in fixed else ["--mop.moe.dispatch", "ep"]
    offload_options = {*OFFLOAD_ONLY_KEYS, "mop.offload_adamw.device_fraction", "mop.offload_adamw.weights",
                       "mop.offload_adamw.gradients", "mop.offload_adamw.host_fraction"}
    if "optimizer.name" not in fixed and fixed & offload_options:
        flags += ["--optimizer.name", OFFLOAD_ADAMW]
    if "mop.offload_adamw.weights" not in fixed:
        # host_init refuses weights = "device"; a given reshard "never" refuses "stream"
        never = "parallelism.fsdp_reshard_after_forward" in fixed
        if "mop.offload_adamw.host_init" in fixed:
            flags += ["--mop.offload_adamw.weights", "bf16" if never else "stream"]
        elif never:
            flags += ["--mop.offload_adamw.weights", "device"]
    return flags


# ---------------------------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------------------------

class Level(NamedTuple):
    """One optimizer setting of the search: the optimizer and, for OffloadStreamAdamW, its device share,
    where its working weights and gradients live, and its CPU share ([mop.offload_adamw] host_fraction)."""
    optimizer: str
    device_fraction: str
    weights: str
    gradients: str
    host_fraction: float = 0.0


@dataclass(frozen=True)
class Settings:
    """The searched keys of one configuration (everything else is the job's own): its structure (the
    context, degrees, dispatch, c, Ring-DTP and its schedule, checkpointing, sequence tiling, kept attention,
    FSDP2's resharding) and its knobs (SCO budget, optimizer level: settings.Level)."""
    seq_len: int
    seq_degree: int
    expert_degree: int
    vocab_degree: int
    dispatch: str
    token_budget: int
    ring_dtp: bool
    ac_mode: str
    sco_budget: str = "0"
    optimizer: str = "AdamW"
    device_fraction: str = "0"
    weights: str = "device"             # [mop.offload_adamw] weights / gradients (OffloadStreamAdamW)
    gradients: str = "device"
    ffn_tokens: int | str = 0           # [mop.tiling] (0, a count or "auto") and [mop.attention] keep
    block_tokens: int | str = 0
    keep: bool = False
    ring_schedule: str = "recompute"    # [mop.ring_dtp] schedule, where Ring-DTP runs (ring_dtp or P > 1)
    reshard: str = "default"            # [parallelism] fsdp_reshard_after_forward
    host_fraction: float = 0.0          # [mop.offload_adamw] host_fraction: OffloadStreamAdamW's CPU share

    @property
    def runs_ring_dtp(self) -> bool:
        return self.ring_dtp or self.vocab_degree > 1

    @property
    def tiled(self) -> bool:
        return self.ffn_tokens != 0 or self.block_tokens != 0

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer == OFFLOAD_ADAMW

    @property
    def level(self) -> Level:
        return Level(self.optimizer, self.device_fraction, self.weights, self.gradients, self.host_fraction)

    @property
    def operators_on(self) -> int:
        """How many of the four operators (and expert parallelism), sequence tiling, kept attention,
        Ring-DTP's grad_in_forward schedule, a resharding policy other than the default and a CPU share
        this configuration runs (the tie-break prefers fewer)."""
        return sum((self.dispatch != "local", self.runs_ring_dtp, self.sco_budget != "0", self.offloads_optimizer,
                    self.tiled, self.keep, self.runs_ring_dtp and self.ring_schedule != "recompute",
                    self.reshard != "default", self.offloads_optimizer and self.host_fraction > 0))

    def label(self) -> str:
        ops = [self.dispatch + (f" c={self.token_budget}" if self.dispatch == "pipelined_llep" else "")]
        if self.runs_ring_dtp:
            ops += ["ring-dtp" + (f" {self.ring_schedule}" if self.ring_schedule != "recompute" else "")]
        ops += [f"sco {self.sco_budget}"] if self.sco_budget != "0" else []
        streaming = f" {self.weights}/{self.gradients}" if (self.weights, self.gradients) != ("device", "device") else ""
        ops += [f"offload f={self.device_fraction}{streaming}" if self.offloads_optimizer else self.optimizer]
        ops += [f"cpu share {self.host_fraction:g}"] if self.offloads_optimizer and self.host_fraction else []
        ops += [f"ac {self.ac_mode}"]
        if self.tiled:
            ops += ["tiled" + ("" if (self.ffn_tokens, self.block_tokens) == ("auto", "auto") else
                               f" ffn {self.ffn_tokens} block {self.block_tokens}")]
        ops += ["keep"] if self.keep else []
        ops += [f"reshard {self.reshard}"] if self.reshard != "default" else []
        return f"D{self.seq_degree} Ep{self.expert_degree} P{self.vocab_degree} " + ", ".join(ops)

    def overrides(self, base) -> list[tuple[str, object]]:
        """(dotted key, value) that turn the job `base` into this configuration."""
        out = [("training.seq_len", self.seq_len), ("mop.layout.seq_degree", self.seq_degree),
               ("mop.layout.expert_degree", self.expert_degree), ("mop.layout.vocab_degree", self.vocab_degree),
               ("mop.moe.dispatch", self.dispatch)]
        if self.dispatch == "pipelined_llep" or self.token_budget != base.mop.moe.token_budget:
            out.append(("mop.moe.token_budget", self.token_budget))
        out.append(("mop.ring_dtp.enable", self.ring_dtp))
        if self.runs_ring_dtp and self.ring_schedule != base.mop.ring_dtp.schedule:
            out.append(("mop.ring_dtp.schedule", self.ring_schedule))
        out += [("mop.sco.host_budget", self.sco_budget), ("optimizer.name", self.optimizer)]
        oa = base.mop.offload_adamw
        if self.offloads_optimizer or str(oa.device_fraction) != self.device_fraction:
            out.append(("mop.offload_adamw.device_fraction", self.device_fraction))
        for key, value, was in (("weights", self.weights, oa.weights), ("gradients", self.gradients, oa.gradients)):
            if value != "device" or was != value:
                out.append((f"mop.offload_adamw.{key}", value))
        if not self.offloads_optimizer:   # options that only apply to OffloadStreamAdamW go back to off
            out += [("mop.offload_adamw.host_fraction", 0.0)] if oa.host_fraction else []
            out += [("mop.offload_adamw.overlap", False)] if oa.overlap else []
            out += [("mop.offload_adamw.stage_in_backward", False)] if oa.stage_in_backward else []
        else:                             # and are part of the configuration where they are on
            if self.host_fraction or oa.host_fraction:
                out.append(("mop.offload_adamw.host_fraction", self.host_fraction))
            out += [("mop.offload_adamw.overlap", True)] if oa.overlap else []
            out += [("mop.offload_adamw.stage_in_backward", True)] if oa.stage_in_backward else []
            out += [("mop.offload_adamw.host_init", True)] if oa.host_init and self.weights != "device" else []
        out.append(("activation_checkpoint.mode", self.ac_mode))
        tiling = base.mop.tiling   # (only what differs from the job or is on: an untiled job's flags stay short)
        for key, value, was in (("ffn_tokens", self.ffn_tokens, tiling.ffn_tokens),
                                ("block_tokens", self.block_tokens, tiling.block_tokens)):
            if value != 0 or was != value:
                out.append((f"mop.tiling.{key}", value))
        if self.keep or base.mop.attention.keep:
            out.append(("mop.attention.keep", self.keep))
        if self.reshard != base.parallelism.fsdp_reshard_after_forward:
            out.append(("parallelism.fsdp_reshard_after_forward", self.reshard))
        return out

    def flags(self, base) -> list[str]:
        flags = []
        for dotted, value in self.overrides(base):
            if isinstance(value, bool):
                section, _, key = dotted.rpartition(".")
                flags.append(f"--{dotted}" if value else f"--{section}.no-{key}")
            else:
                flags += [f"--{dotted}", str(value)]
        return flags

    def toml(self, base) -> str:
        sections: dict[str, list[str]] = {}
        for dotted, value in self.overrides(base):
            section, _, key = dotted.rpartition(".")
            text = ("true" if value else "false") if isinstance(value, bool) else (
                f'"{value}"' if isinstance(value, str) else str(value))
            sections.setdefault(section, []).append(f"{key} = {text}")
        return "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items())


DEVICE_FRACTIONS = ("0.75", "0.5", "0.25", "0")
"""OffloadStreamAdamW's device shares tried, most on the device (fastest) first."""


HOST_FRACTIONS = (0.7, 0.5, 0.3)
"""OffloadStreamAdamW's CPU shares tried beside none: the three measured on one H100 (2026-12-06, the fit of
cost_model.HOST_ADAMW_S_PER_PARAM), none above the 0.7 measured fastest there."""


def optimizer_levels(base, fixed: set[str]) -> list[Level]:
    """The optimizer levels, fastest first; the last leaves the least on the device. After OffloadStreamAdamW's
    device shares come bf16 working weights (under bf16 compute: no traffic) and then weights and gradients
    both streamed beside each device share: the two compose (a share keeps its state resident while every
    block's weights and gradients stream), and the share that fits beside the streams is the fastest of them.
    Each OffloadStreamAdamW level comes with its CPU shares (HOST_FRACTIONS) just before it: a share updates
    the tail of the streamed rest on the CPU (beside streamed gradients it reads them where they landed) and
    plans a little more on the device (its cast temporaries), so the last level still leaves the least there.
    A given host_fraction is every level's instead. Other mixes are left to the user; `keeps_no_less` orders
    the levels for the search's pruning."""
    oa = base.mop.offload_adamw
    levels = _share_levels(base, fixed)
    if {"mop.offload_adamw.weights", "mop.offload_adamw.gradients"} & fixed:  # given: keep them, offloaded
        out = [Level(n, f, oa.weights, oa.gradients) for n, f in levels if n == OFFLOAD_ADAMW]
    else:
        shares = [f for n, f in levels if n == OFFLOAD_ADAMW]
        # host_init given: the working weights stay off the device (where host_init takes effect)
        out = [] if oa.host_init else [Level(n, f, "device", "device") for n, f in levels]
        if shares:
            if MixedPrecision.from_training(base.training).activation_bytes == 2:   # (free under bf16 compute)
                out.append(Level(OFFLOAD_ADAMW, shares[-1], "bf16", "device"))
            out += [Level(OFFLOAD_ADAMW, f, "stream", "stream") for f in shares]   # the least on the device last
    if "mop.offload_adamw.host_fraction" in fixed:
        return [lv._replace(host_fraction=oa.host_fraction) if lv.optimizer == OFFLOAD_ADAMW else lv for lv in out]
    with_shares = []
    for level in out:
        if level.optimizer == OFFLOAD_ADAMW:
            with_shares += [level._replace(host_fraction=h) for h in HOST_FRACTIONS]
        with_shares.append(level)
    return with_shares


_WEIGHT_RANK = {"device": 0, "bf16": 1, "stream": 2}
_WEIGHT_BYTES = {"device": 4, "bf16": 2, "stream": 0}     # per local element on the device (leading term)


def keeps_no_less(a: Level, b: Level) -> bool:
    """Whether optimizer level `a` keeps at least as much on the device as `b` and pins no more host
    memory (a partial order; False where it is not known). Both OffloadStreamAdamW: `a` keeps no smaller
    share (host: 12 B per element off the device) with weights and gradients no further off the device
    (host: + the working copies and gradient buffer), and its leading device bytes per element -- the
    weights' 4 / 2 / 0 B plus the share's 8 B (fp32 shards are their own masters) or 12 B -- are no
    fewer: fp32 shards at share 0.75 keep less than bf16 working weights at 0.75 (4 + 6 < 2 + 9). The
    streamed windows and gradient staging are taken as smaller than the 2 B per element they replace.
    A CPU share adds its cast temporaries on the device and, beside gradients on the device, its fp32
    gradient buffer on the host: `a` has a share where `b` has one, and with gradients on the device a
    CPU share no larger."""
    if a == b:
        return True
    if a.optimizer != OFFLOAD_ADAMW or b.optimizer != OFFLOAD_ADAMW or "auto" in (a.device_fraction, b.device_fraction):
        return False
    fa, fb = float(a.device_fraction), float(b.device_fraction)
    device = lambda w, f: _WEIGHT_BYTES[w] + (8 if w == "device" else 12) * f  # noqa: E731
    cpu_share = (a.host_fraction > 0 or b.host_fraction == 0) and (
        a.gradients == "stream" or a.host_fraction <= b.host_fraction)
    return (fa >= fb and _WEIGHT_RANK[a.weights] <= _WEIGHT_RANK[b.weights] and (a.gradients, b.gradients) !=
            ("stream", "device") and device(a.weights, fa) >= device(b.weights, fb) and cpu_share)


def _share_levels(base, fixed: set[str]) -> list[tuple[str, str]]:
    """(optimizer.name, device_fraction), fastest first; the last leaves the least on the device."""
    on_device = base.optimizer.name if base.optimizer.name != OFFLOAD_ADAMW else "AdamW"
    name_fixed, fraction = "optimizer.name" in fixed, str(base.mop.offload_adamw.device_fraction)
    oa = base.mop.offload_adamw           # options of OffloadStreamAdamW alone, given: it is the optimizer
    only_offload = ("mop.offload_adamw.host_fraction" in fixed and oa.host_fraction) or any(
        f"mop.offload_adamw.{key}" in fixed and getattr(oa, key) for key in ("overlap", "host_init", "stage_in_backward"))
    if name_fixed and base.optimizer.name != OFFLOAD_ADAMW:
        return [(on_device, "0")]
    if "mop.offload_adamw.device_fraction" in fixed:
        keep_adamw = not name_fixed and not only_offload and fraction.strip() in ("0", "0.0")
        return ([(on_device, "0")] if keep_adamw else []) + [(OFFLOAD_ADAMW, fraction)]
    levels = [(OFFLOAD_ADAMW, f) for f in DEVICE_FRACTIONS]
    return levels if name_fixed or only_offload else [(on_device, "0")] + levels


def configure(base, s: Settings):
    """A copy of the job `base` with the settings of `s` (the sections it touches are copied)."""
    cfg = copy.copy(base)
    mop = cfg.mop = copy.copy(base.mop)
    mop.layout = replace(base.mop.layout, seq_degree=s.seq_degree, expert_degree=s.expert_degree,
                         vocab_degree=s.vocab_degree)
    mop.moe = replace(base.mop.moe, dispatch=s.dispatch, token_budget=s.token_budget)
    mop.ring_dtp = replace(base.mop.ring_dtp, enable=s.ring_dtp,
                           schedule=s.ring_schedule if s.runs_ring_dtp else base.mop.ring_dtp.schedule)
    mop.sco = replace(base.mop.sco, host_budget=s.sco_budget)
    oa = base.mop.offload_adamw
    mop.offload_adamw = replace(oa, device_fraction=s.device_fraction, weights=s.weights, gradients=s.gradients,
                                host_fraction=s.host_fraction if s.offloads_optimizer else 0.0,
                                overlap=oa.overlap and s.offloads_optimizer,
                                stage_in_backward=oa.stage_in_backward and s.offloads_optimizer)
    cfg.optimizer = replace(base.optimizer, name=s.optimizer)
    cfg.training = replace(base.training, seq_len=s.seq_len)
    cfg.activation_checkpoint = replace(base.activation_checkpoint, mode=s.ac_mode)
    cfg.parallelism = replace(base.parallelism, fsdp_reshard_after_forward=s.reshard)
    mop.tiling = replace(base.mop.tiling, ffn_tokens=s.ffn_tokens, block_tokens=s.block_tokens)
    mop.attention = replace(base.mop.attention, keep=s.keep)
    return cfg


def settings_of(cfg, ring_schedule: str | None = None) -> Settings:
    """The searched keys of the job `cfg` as it stands (the inverse of `configure`). Its [mop.ring_dtp]
    schedule is taken as given unless `ring_schedule` names the one "auto" resolves to (plan.job.
    ring_dtp_plan_schedule); an unresolved "auto" is planned as "recompute", the schedule it falls back to."""
    lay, moe, rd, oa = cfg.mop.layout, cfg.mop.moe, cfg.mop.ring_dtp, cfg.mop.offload_adamw
    schedule = ring_schedule or (rd.schedule if rd.schedule != "auto" else "recompute")
    offload = cfg.optimizer.name == OFFLOAD_ADAMW
    return Settings(cfg.training.seq_len, lay.seq_degree, lay.expert_degree, lay.vocab_degree, moe.dispatch,
                    moe.token_budget, rd.enable, cfg.activation_checkpoint.mode, str(cfg.mop.sco.host_budget),
                    cfg.optimizer.name, str(oa.device_fraction), oa.weights, oa.gradients,
                    ffn_tokens=cfg.mop.tiling.ffn_tokens, block_tokens=cfg.mop.tiling.block_tokens,
                    keep=cfg.mop.attention.keep, ring_schedule=schedule,
                    reshard=cfg.parallelism.fsdp_reshard_after_forward,
                    host_fraction=oa.host_fraction if offload else 0.0)


# ---------------------------------------------------------------------------------------------
# The memory plan with the meta model kept per flavor
# ---------------------------------------------------------------------------------------------

class FlavorModel:
    """One flavor's meta model and the parameter counts `plan_for_config` reads off it, cached per layout."""

    def __init__(self, flavor: str):
        self.args = zoo.get_model_args(flavor)
        with torch.device("meta"):
            self.model = MoETransformer(self.args)
        self.total = sum(p.numel() for p in self.model.parameters())
        self.active = zoo.param_counts(self.args)["active"]
        self.embedding = self.model.tok_embeddings.weight.numel()
        self._cache: dict[tuple, object] = {}

    def _cached(self, key: tuple, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _kept_out(self, layout, dispatch: str) -> tuple[int, int]:
        """(routed-expert, projection) parameters a MoP group shards instead of FSDP2 (job.kept_out_of_fsdp's rule)."""
        return self._cached(("kept", dispatch == "local", layout.vocab_degree > 1), lambda: tuple(
            sum(p.numel() for p in ps) for ps in kept_out_of_fsdp(self.model, layout, dispatch=dispatch)))

    def local_params(self, layout, dispatch: str) -> int:
        key = ("local", layout.world_size, layout.expert_degree, layout.vocab_degree, dispatch == "local")
        return self._cached(key, lambda: local_param_count(self.model, layout, dispatch=dispatch))

    def shard_params(self, layout, dispatch: str) -> tuple[int, int]:
        """(routed-expert, projection) parameters of this rank that a MoP group shards (0: FSDP2's)."""
        routed, projection = self._kept_out(layout, dispatch)
        return -(-routed // layout.expert_degree), -(-projection // layout.vocab_degree)

    def fsdp_params(self, layout, dispatch: str) -> int:
        """Parameters FSDP2 holds (gathers and reduces): all but those a MoP group shards."""
        return self.total - sum(self._kept_out(layout, dispatch))

    def gathered_units(self, layout, dispatch: str) -> tuple[int, int, int, int]:
        """(largest block's, every block's together, root unit's, head unit's) parameters FSDP2 gathers."""
        def count():
            kept = {id(p) for ps in kept_out_of_fsdp(self.model, layout, dispatch=dispatch) for p in ps}
            blocks = [fsdp_block_params(b, kept) for b in self.model.layers.values()]
            return (max(blocks), sum(blocks), fsdp_root_params(self.model, kept), fsdp_head_params(self.model, kept))
        return self._cached(("gathered", dispatch == "local", layout.vocab_degree > 1), count)

    def regathered_params(self, layout, dispatch: str) -> int:
        """Parameters FSDP2 gathers a second time for backward under the default policy: every block's
        but the last's, which it keeps unsharded from its forward (parallelize.block_reshard_after_forward)."""
        def count():
            kept = {id(p) for ps in kept_out_of_fsdp(self.model, layout, dispatch=dispatch) for p in ps}
            *first, _ = self.model.layers.values()
            return sum(fsdp_block_params(b, kept) for b in first)
        return self._cached(("regathered", dispatch == "local", layout.vocab_degree > 1), count)

    def local_head(self, layout) -> int:
        """This rank's share of the head unit (job.local_head_params)."""
        return self._cached(("first", layout.world_size, layout.vocab_degree),
                            lambda: local_head_params(self.model, layout))


@lru_cache(maxsize=8)
def flavor_model(flavor: str) -> FlavorModel:
    return FlavorModel(flavor)


def fast_plan(cfg, *, world: int, ranks_per_node: int, host_bytes: int | None) -> JobPlan:
    """`plan_for_config` with the meta model built once per flavor: the same steps in the same order
    (tests/plan/test_auto_plan.py checks that the two agree term by term)."""
    lay, t, m = cfg.mop.layout, cfg.training, flavor_model(cfg.model.flavor)
    layout = plan_layout(world, lay.seq_degree, lay.expert_degree, lay.vocab_degree)
    check_layout_fits(layout, t, m.args)
    micro = check_titan_parallelism(cfg.parallelism, t, data_size=world // lay.seq_degree)
    precision = MixedPrecision.from_training(t)
    sco_budget = 0 if cfg.mop.sco.host_budget.strip() == "0" else resolve_host_budget(
        cfg.mop.sco.host_budget, ranks_per_node, available_bytes=host_bytes)
    dispatch = cfg.mop.moe.dispatch
    mine = m.local_params(layout, dispatch)
    block, blocks, root, head = m.gathered_units(layout, dispatch)
    device_terms, host_terms = memory_plans(
        cfg, m.args, layout_plan=layout, total_params=m.total, largest_block_params=block, blocks_params=blocks,
        root_params=root,
        first_grad_params=m.local_head(layout), head_params=head, embedding_params=m.embedding,
        checkpointed_layers=len(checkpointed_layer_ids(cfg.activation_checkpoint, m.args.n_layers)),
        local_params=mine, sco_host_budget=sco_budget, precision=precision)
    return JobPlan(layout, m.total, mine, micro, str(precision.param_dtype).removeprefix("torch."),
                   ranks_per_node, device_terms, host_terms)


@dataclass
class Evaluation:
    """One configuration: its plan (None when the job refuses it: `error`) and predicted step."""
    settings: Settings
    prediction: StepPrediction
    plan: JobPlan | None = None
    error: str | None = None
    device_limit: int = 0
    """Device bytes a configuration may plan: the GPU's memory less the headroom."""
    host_limit: int = 0
    verified: bool = False
    """Planned by `plan_for_config` itself (not only by `fast_plan`)."""

    @property
    def device(self) -> int:
        return self.plan.device_bytes if self.plan else 0

    @property
    def host(self) -> int:
        return self.plan.host_bytes_per_node if self.plan else 0

    @property
    def fits_device(self) -> bool:
        return self.plan is not None and self.device <= self.device_limit

    @property
    def fits(self) -> bool:
        return self.fits_device and self.host <= self.host_limit

    @property
    def overshoot(self) -> float:
        """How far over the tightest memory it is (1.0 = exactly full; inf when refused)."""
        if self.plan is None:
            return math.inf
        return max(self.device / self.device_limit, self.host / self.host_limit)

    @property
    def tokens_per_s(self) -> float:
        return self.prediction.tokens_per_s
