"""What a `mop-train plan --auto` search returns (Result) and its printout (format_result): the chosen
overrides (flags and TOML), the predicted peak and step, the chosen plan term by term, the runners-up and
what would have been better but does not fit. The searches are mop_train.plan.auto's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mop_train.plan.cost_model import format_prediction
from mop_train.plan.report import plan_job
from mop_train.plan.search_space import SearchSpace
from mop_train.plan.settings import Evaluation, configure
from mop_train.plan.terms import GIB


@dataclass
class Result:
    objective: str
    seq_len: int
    chosen: Evaluation
    runners_up: list[Evaluation]
    """Fit, predicted slower than the chosen one, best first."""
    misses: list[Evaluation]
    """Better on the objective (faster, or a longer context) and planned not to fit, best first."""
    stopped_by: str = ""
    """Context objective: "memory" (S_max + one granule fits nothing) or "max_seq_len" (the model's)."""
    next_seq_len: int | None = None
    """Context objective: the smallest context tried that nothing fits."""
    searched: int = 0
    planned: int = 0
    seconds: float = 0.0
    disagreements: list[str] = field(default_factory=list)


def _table(rows: list[Evaluation], *, with_context: bool = False) -> list[str]:
    lines = [f"  {'tokens/s':>10}  {'step s':>8}  {'peak GiB':>8}  {'host GiB/node':>13}  "
             + ("context    " if with_context else "") + "configuration"]
    for e in rows:
        lines.append(f"  {e.tokens_per_s:>10,.0f}  {e.prediction.seconds:>8.3f}  {e.device / GIB:>8.1f}  "
                     f"{e.host / GIB:>13.1f}  " + (f"{e.settings.seq_len:<10,} " if with_context else "")
                     + e.settings.label())
    return lines


def format_result(planner: SearchSpace, r: Result) -> str:
    """The chosen overrides (flags and TOML), the predicted peak and step, the chosen plan term by
    term, the runners-up and what would have been better but does not fit."""
    p, e, base = planner, r.chosen, planner.base
    lines = [f"mop-train plan --auto: objective {r.objective} on W={p.world} ranks ({p.ranks_per_node} per node), "
             f"{p.gpu_bytes / GIB:.1f} GiB per GPU ({p.headroom / GIB:.1f} GiB of it kept free), "
             f"{p.host_bytes / GIB:.1f} GiB host per node",
             f"searched {r.searched:,} configurations, planned {r.planned:,}, in {r.seconds:.2f} s"
             + (f"; kept as given: {', '.join(sorted(p.fixed))}" if p.fixed else "")]
    if r.objective == "context":
        lines.append(f"longest context that fits: {r.seq_len:,} tokens (" + (
            f"{r.next_seq_len:,} fits no configuration)" if r.stopped_by == "memory"
            else "the model's max_seq_len; memory was not the limit)"))
    else:
        lines.append(f"fastest configuration that fits at training.seq_len = {r.seq_len:,}")
    lines += ["", "chosen overrides:", "  " + " ".join(e.settings.flags(base)), "", "as TOML:"]
    lines += ["  " + line for line in e.settings.toml(base).splitlines()]
    lines += ["", f"predicted peak per rank {e.device / GIB:.1f} GiB of {p.gpu_bytes / GIB:.1f} GiB; pinned host "
              f"{e.host / GIB:.1f} GiB of {p.host_bytes / GIB:.1f} GiB per node",
              format_prediction(e.prediction), "",
              plan_job(configure(base, e.settings), world=p.world, ranks_per_node=p.ranks_per_node,
                       gpu_bytes=p.gpu_bytes, host_bytes=p.host_bytes)[0]]
    if r.runners_up:
        lines += ["", "runners-up (fit; predicted slower; the best of each other layout, dispatch, Ring-DTP and its "
                  "schedule, checkpointing, tiling, keep and FSDP2 resharding):"]
        lines += _table(r.runners_up)
    if r.misses:
        lines += ["", "better on the objective but planned not to fit:"]
        lines += _table(r.misses, with_context=r.objective == "context")
    if r.disagreements:
        lines += ["", "note: the cached planner differed from plan_for_config (these were re-planned with it):"]
        lines += ["  " + d for d in r.disagreements]
    return "\n".join(lines)
