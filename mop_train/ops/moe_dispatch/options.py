"""The settings of each expert-parallel dispatch schedule: one frozen dataclass per schedule.

    options = PipelinedLLEPOptions(token_budget=2048)          # checked here, once
    y = moe_experts_forward(x, indices, weights, w1, w2, w3, options, group=expert_group)

The type of the options object picks the schedule ("local" takes none: pass None); each field's
default is the one default of that setting (the `[mop.moe]` config section takes its defaults from
here), and `__post_init__` rejects a bad value with the value and the fix, so the schedules trust
what they are given. `dispatch_options(name, settings)` builds the options of a schedule named in
a config from the attributes of the same names.

Legend: N tokens, E_p expert-group size, K chunks, c token budget per source and chunk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

MEMBERSHIPS = ("strided", "contiguous")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class EPOptions:
    """dispatch = "ep": every route travels to the rank that owns its expert. No settings."""

    name: ClassVar[str] = "ep"


@dataclass(frozen=True)
class LLEPOptions:
    """dispatch = "llep": least-loaded expert parallelism (llep_plan.py has the plan's rules)."""

    name: ClassVar[str] = "llep"

    alpha: float = 1.0
    """Capacity factor: each rank's capacity is floor(alpha * total routes / E_p)."""

    min_tokens_per_gemm: int = 1024
    """m: the smallest share of an expert's routes handed to a helper rank (a final remainder excepted)."""

    imbalance_threshold: float = 1.3
    """lambda: relocate only when the max-over-mean rank load reaches this."""

    def __post_init__(self):
        if not (_is_number(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha = {self.alpha!r} must be a number > 0: each rank's capacity is "
                             f"floor(alpha * total routes / E_p); 1.0 (the paper's) gives each rank the mean load")
        if not (_is_int(self.min_tokens_per_gemm) and self.min_tokens_per_gemm >= 1):
            raise ValueError(f"min_tokens_per_gemm = {self.min_tokens_per_gemm!r} must be an integer >= 1: "
                             f"the smallest share of an expert's routes given to a helper rank")
        if not (_is_number(self.imbalance_threshold) and self.imbalance_threshold >= 1.0):
            raise ValueError(f"imbalance_threshold = {self.imbalance_threshold!r} must be >= 1.0: relocation "
                             f"starts when the max-over-mean rank load reaches it, and that ratio is never "
                             f"below 1 (1.0 always relocates)")


@dataclass(frozen=True)
class PipelinedLLEPOptions(LLEPOptions):
    """dispatch = "pipelined_llep": LLEP's plan, delivered in K = min(ceil(N / c), K_max) chunks."""

    name: ClassVar[str] = "pipelined_llep"

    token_budget: int = 4096
    """c: tokens each source sends per chunk; a destination receives at most E_p * k * c routes per chunk."""

    max_chunks: int = 10
    """K_max: the ceiling on the chunk count (1 turns chunking off)."""

    membership: str = "strided"
    """Which tokens share a chunk: "strided" (positions i, i+K, ...) or "contiguous" blocks."""

    def __post_init__(self):
        super().__post_init__()
        if not (_is_int(self.token_budget) and self.token_budget >= 1):
            raise ValueError(f"token_budget = {self.token_budget!r} must be an integer >= 1: the tokens each "
                             f"source sends per chunk (K = ceil(N / token_budget) chunks)")
        if not (_is_int(self.max_chunks) and self.max_chunks >= 1):
            raise ValueError(f"max_chunks = {self.max_chunks!r} must be an integer >= 1: the ceiling on the "
                             f"chunk count K (1 turns chunking off)")
        if self.membership not in MEMBERSHIPS:
            raise ValueError(f"membership = {self.membership!r} is not a chunk membership; use one of "
                             f"{MEMBERSHIPS}")


DispatchOptions = EPOptions | LLEPOptions | PipelinedLLEPOptions
"""The options of an expert-parallel schedule; None stands for "local" (every expert here)."""

SCHEDULE_OPTIONS: dict[str, type] = {cls.name: cls for cls in (EPOptions, LLEPOptions, PipelinedLLEPOptions)}
DISPATCH_MODES = ("local", *SCHEDULE_OPTIONS)


def dispatch_options(dispatch: str, settings) -> DispatchOptions | None:
    """The options of schedule `dispatch` (None for "local"), each field read from the attribute of
    the same name on `settings` (e.g. the `[mop.moe]` section; other attributes are not read)."""
    if dispatch == "local":
        return None
    cls = SCHEDULE_OPTIONS.get(dispatch)
    if cls is None:
        raise ValueError(f"unknown dispatch {dispatch!r}; expected one of {DISPATCH_MODES}")
    return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})
