"""The figures of benchmarks/e2e_vs_torchtitan.py, computed from its points alone (issue 37).

    h = headline(points, model="small", peak_tflops=790)     # points: the runs of one or more commands
    print(format_points(points, model="small", peak_tflops=790)); print(format_headline(h))

Every figure is a function of the list of points, so phases run in separate commands (each writes
its own <out>/phase-<name>.json) merge by concatenating their points: the reach and batch searches
are replayed from their points (`replay`: the search asks for a value, the points answer; a value
no point answers ends the replay as "unfinished", or "budget" when the budget cut it), the
throughput figure is the fastest completed setting per series and point with every other tried
setting beside it, and the loss curves are compared step by step.
FLOPs: one count for both sides, mop_train.train.metrics.flops_per_token of the shared model shape
(FLOP_NOTE); model TFLOP/s per GPU = tokens/s / W x F(S) / 1e12, MFU against --peak-tflops.
Taken as a model: torchtitan's MetricsProcessor (tokens/s, TFLOP/s, MFU per step), not its FLOP count.

Legend: S context, B local batch, W ranks, F(S) model FLOPs per token.
"""

from __future__ import annotations

import functools
import json
import statistics

from benchmarks.e2e_settings import OURS_ALL, SERIES, TITAN
from mop_train.sweep import Search

REAL = ("oom", "timeout", "failed")  # a run that ended without completing
FLOP_NOTE = ("model FLOPs/token F(S) = 6 x (active params - input embedding) + 3 x L x h x (d_qk + d_v) x S "
             "(attention at the causal half; recompute not counted); the same F(S) for both sides")


@functools.lru_cache(maxsize=None)
def model_flops(model: str, seq_len: int) -> float:
    """F(S) of zoo model `model` (torchtitan's DeepSeek-V3 is built at the same shape)."""
    from mop_train.models import zoo
    from mop_train.train.metrics import flops_per_token

    return flops_per_token(zoo.get_model_args(model), seq_len, active_params=zoo.param_counts(model)["active"])


H200_DATASHEET_TFLOPS = 989.0
"""The H100/H200 SXM datasheet's dense bf16 peak (torchtitan's and our trainer's default MFU peak)."""
LENT_H200_TFLOPS = 790.0
"""What the lent H200 sustains on bf16 matrix work (the device README; issue 37's MFU peak)."""


def mfu_peak_note(peak_tflops: float) -> str:
    """Which peak the MFU column divides by, and how to read it against the datasheet's."""
    if peak_tflops == H200_DATASHEET_TFLOPS:
        return "the H200 datasheet's dense bf16 peak"
    source = "the lent H200's bf16 matrix rate (library/device/README.md), " if peak_tflops == LENT_H200_TFLOPS else ""
    return (f"{source}not the H200 datasheet's {H200_DATASHEET_TFLOPS:g}: x{peak_tflops / H200_DATASHEET_TFLOPS:.2f} "
            f"gives MFU of the datasheet peak")


def with_flops(point: dict, model: str, peak_tflops: float) -> dict:
    """The point with model_tflops (per GPU, common count) and mfu_pct when it completed."""
    if point.get("status") != "ok" or point.get("tokens_per_s") is None:
        return point
    tflops = point["tokens_per_s"] / point.get("world", 1) * model_flops(model, point["seq_len"]) / 1e12
    return {**point, "model_tflops": round(tflops, 1), "mfu_pct": round(100 * tflops / peak_tflops, 1)}


# -- searches, replayed from points -------------------------------------------------------------

def search_of(params: dict) -> Search:
    return Search(params["start"], params["limit"], multiple=params.get("multiple", 1),
                  bracket=params.get("bracket", False))


def combine(statuses: list[str]) -> str:
    """One probe's verdict over the settings it tried (none completed): a real oom / timeout first,
    then a pruned (implied oom) setting, else failed (every setting was broken)."""
    for s in ("oom", "timeout"):
        if s in statuses:
            return s
    return "oom" if "pruned" in statuses else "failed"


def probe_status(points: list[dict], series: str, *, seq_len: int, local_batch: int, params: dict,
                 any_ok: bool = True) -> tuple[str | None, bool]:
    """(status, cut by the budget) of one search probe, from the points. The probe tries
    params["settings"] in order (a setting that failed anywhere is skipped for good) until one
    completes or params["tries"] of them ran out of memory or time. "ok" when a setting completed
    there (with `any_ok`, any setting of the series at any purpose: reach is "something completes");
    else the verdict over the settings tried (`combine`) once the probe is over; None while settings
    are left (cut: the budget stopped this probe, params["kind"] its purpose)."""
    here = [p for p in points if p["series"] == series and (p["seq_len"], p["local_batch"]) == (seq_len, local_batch)]
    mine = [p for p in here if p["setting"] in params["settings"]]
    if any(p["status"] == "ok" for p in (here if any_ok else mine)):
        return "ok", False
    broken = {p["setting"] for p in points if p["series"] == series and p["status"] == "failed"}
    tried = [p for p in mine if p["status"] in REAL + ("pruned",) and not p.get("budget_cut")]
    misses = sum(1 for p in tried if p["status"] in ("oom", "timeout"))
    if misses >= params["tries"] or set(params["settings"]) <= broken | {p["setting"] for p in tried}:
        return combine([p["status"] for p in tried]), False
    return None, any((p["status"] == "skipped" or p.get("budget_cut")) and p.get("purpose") == params["kind"]
                     for p in mine)


def replay(search: Search, status_of) -> Search:
    """Drive `search` with `status_of(value) -> (status | None, budget_cut)` until it ends or a
    value has no answer; returns the search (its summary says how it ended)."""
    while (value := search.next_value()) is not None:
        status, cut = status_of(value)
        if status is None:
            if cut:
                search.stopped_by = "budget"
            break
        search.record(value, status)
    return search


def reach_summary(points: list[dict], series: str) -> dict | None:
    params = next((p["search"] for p in reversed(points) if p["series"] == series
                   and p.get("purpose") == "reach" and "search" in p), None)
    if params is None:
        return None
    s = replay(search_of(params), lambda v: probe_status(points, series, seq_len=v, local_batch=1, params=params))
    settings = sorted({p["setting"] for p in points if p["series"] == series and p.get("purpose") == "reach"
                       and p["status"] == "ok"})
    return {**s.summary(), "search": params, "settings_that_completed": settings}


def batch_summary(points: list[dict], series: str) -> dict | None:
    """The batch search of the series: per setting it used, replayed; the one reaching furthest."""
    mine = [p for p in points if p["series"] == series and p.get("purpose") == "batch" and "search" in p]
    best = None
    for setting in dict.fromkeys(p["setting"] for p in mine):
        last = [p for p in mine if p["setting"] == setting][-1]
        s = replay(search_of(last["search"]), lambda b: probe_status(
            points, series, seq_len=last["seq_len"], local_batch=b, params=last["search"], any_ok=False))
        got = {**s.summary(), "setting": setting, "seq_len": last["seq_len"],
               "largest_global_batch": s.ok and last["global_batch"] // last["local_batch"] * s.ok}
        if best is None or (got["largest_ok"] or 0) > (best["largest_ok"] or 0):
            best = got
    return best


# -- throughput and loss ------------------------------------------------------------------------

FIGURES = ("tokens_per_s", "peak_mem_gib", "model_tflops", "mfu_pct", "global_batch")


def tps_summary(points: list[dict], *, seq_len: int, local_batch: int, purposes: tuple = ("tps",)) -> dict:
    """{series: {"fastest": figures of its fastest completed setting, "tried": every setting's outcome}}
    over the points of `purposes` at (seq_len, local_batch)."""
    out = {}
    for series in dict.fromkeys(p["series"] for p in points):
        here = [p for p in points if p["series"] == series and (p["seq_len"], p["local_batch"]) == (seq_len, local_batch)
                and p.get("purpose") in purposes]
        if not here:
            continue
        ok = [p for p in here if p["status"] == "ok"]
        best = max(ok, key=lambda p: p["tokens_per_s"], default=None)
        out[series] = {"fastest": best and {"setting": best["setting"], **{k: best.get(k) for k in FIGURES}},
                       "tried": [{"setting": p["setting"], "status": p["status"], "tokens_per_s": p.get("tokens_per_s"),
                                  "peak_mem_gib": p.get("peak_mem_gib"), "error": p.get("error")} for p in here]}
    return out


def loss_summary(points: list[dict], *, window: int = 20) -> dict | None:
    """The loss-curve runs: per series its last `window` steps' mean loss, and between the first two
    series the largest gap of their `window`-step running means (same data order, different
    initialisations: the curves can show the same descent, not equal values)."""
    runs = {p["series"]: p for p in points if p.get("purpose") == "loss" and p["status"] == "ok" and p.get("losses")}
    if not runs:
        return None
    out = {s: {"setting": p["setting"], "steps": len(p["losses"]), "first_loss": p["losses"][0],
               f"mean_last_{window}": statistics.fmean(p["losses"][-window:]), "tokens_per_s": p["tokens_per_s"]}
           for s, p in runs.items()}
    if TITAN in runs and len(runs) > 1:
        other = next(s for s in runs if s != TITAN)
        a, b = running_mean(runs[TITAN]["losses"], window), running_mean(runs[other]["losses"], window)
        gaps = [abs(x - y) for x, y in zip(a, b)]
        out["comparison"] = {"series": [TITAN, other], "window": window, "max_running_mean_gap": max(gaps),
                             "final_running_mean_gap": gaps[-1]}
    return out


def running_mean(values: list[float], window: int) -> list[float]:
    """Means of every `window` consecutive values (one per full window)."""
    if len(values) < window:
        return [statistics.fmean(values)]
    return [statistics.fmean(values[i:i + window]) for i in range(len(values) - window + 1)]


def headline(points: list[dict], *, model: str, peak_tflops: float) -> dict:
    points = [with_flops(p, model, peak_tflops) for p in points]
    tps_points = sorted({(p["seq_len"], p["local_batch"]) for p in points if p.get("purpose") == "tps"})
    titan_reach = reach_summary(points, TITAN)
    longest = titan_reach and titan_reach["largest_ok"]
    at_longest = longest and tps_summary(points, seq_len=longest, local_batch=1,
                                         purposes=("tps", "reach", "tps-at-titan-max"))
    return {"flop_count": {"note": FLOP_NOTE, "peak_tflops": peak_tflops,
                           "per_token": {str(s): model_flops(model, s) for s, _ in tps_points}},
            "tps": {f"{s}x{b}": tps_summary(points, seq_len=s, local_batch=b) for s, b in tps_points},
            "reach": {s: reach_summary(points, s) for s in (TITAN, OURS_ALL)},
            "titan_longest_seq": longest, "tps_at_titan_longest": at_longest,
            "batch": {s: batch_summary(points, s) for s in SERIES if batch_summary(points, s)},
            "loss_curves": loss_summary(points)}


# -- text, plot, files --------------------------------------------------------------------------

def format_points(points: list[dict], *, model: str, peak_tflops: float) -> str:
    points = [with_flops(p, model, peak_tflops) for p in points]
    cols = ("series", "setting", "purpose", "S", "B", "status", "tokens/s", "model TFLOP/s/GPU", "MFU %", "peak GiB", "s")
    rows = [(p["series"], p["setting"], p.get("purpose", ""), str(p["seq_len"]), str(p["local_batch"]), p["status"],
             f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") else "-", str(p.get("model_tflops", "-")),
             str(p.get("mfu_pct", "-")), f"{p['peak_mem_gib']:.1f}" if p.get("peak_mem_gib") else "-",
             str(p.get("seconds", "-"))) for p in points]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [f"{FLOP_NOTE}; MFU against {peak_tflops:g} TFLOP/s (bf16 dense) per GPU"
             f" ({mfu_peak_note(peak_tflops)})",
             "  ".join(c.rjust(w) for c, w in zip(cols, widths)), "-" * (sum(widths) + 2 * len(cols))]
    return "\n".join(lines + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows])


def _figure(v: dict | None) -> str:
    if not v:
        return "none completed"
    return (f"{v['tokens_per_s']:,.0f} tokens/s ({v['setting']}, {v['model_tflops']} TFLOP/s/GPU, "
            f"MFU {v['mfu_pct']}%, peak {v['peak_mem_gib']:.1f} GiB)")


def format_headline(h: dict) -> str:
    lines = ["headline (" + h["flop_count"]["note"] + f"; MFU vs {h['flop_count']['peak_tflops']:g} TFLOP/s):"]
    for point, by_series in h["tps"].items():
        for s, v in by_series.items():
            ran = sum(1 for t in v["tried"] if t["status"] != "skipped")
            lines.append(f"  tokens/s at {point:>9} {s:>10}: {_figure(v['fastest'])}; {ran} of {len(v['tried'])} settings ran")
    for s, v in h["reach"].items():
        if v:
            lines.append(f"  longest context, batch 1 {s:>10}: {v['largest_ok']} (stopped by {v['stopped_by']}"
                         + (f"; {v['not_ok_status']} at {v['smallest_not_ok']})" if v["smallest_not_ok"] else ")"))
    for s, v in (h["tps_at_titan_longest"] or {}).items():
        lines.append(f"  at titan's longest {h['titan_longest_seq']} {s:>10}: {_figure(v['fastest'])}")
    for s, v in h["batch"].items():
        lines.append(f"  largest global batch at {v['seq_len']} {s:>10}: {v['largest_global_batch']} ({v['setting']}; "
                     f"stopped by {v['stopped_by']})")
    for s, v in (h["loss_curves"] or {}).items():
        lines.append(f"  loss curve {s:>10}: " + (json.dumps(v) if s == "comparison" else
                     f"{v['steps']} steps, first {v['first_loss']:.3f}, last-20 mean {v['mean_last_20']:.3f} ({v['setting']})"))
    return "\n".join(lines)


def load_points(paths: list[str]) -> list[dict]:
    """The points of earlier e2e.json / phase-*.json files, each once (by its content), marked `from`."""
    seen, points = set(), []
    for path in paths:
        with open(path) as f:
            for p in json.load(f)["points"]:
                key = json.dumps({k: v for k, v in p.items() if k != "from"}, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    points.append({**p, "from": p.get("from", path)})
    return points


def plot_e2e(points: list[dict], png_path: str) -> None:
    """Tokens/s and peak memory against context (batch 1) per series and setting; x: did not complete."""
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for series, setting in dict.fromkeys((p["series"], p["setting"]) for p in points if p["local_batch"] == 1):
        pts = sorted((p for p in points if (p["series"], p["setting"]) == (series, setting) and p["local_batch"] == 1),
                     key=lambda p: p["seq_len"])
        good = [p for p in pts if p["status"] == "ok"]
        line, = ax_t.plot([p["seq_len"] for p in good], [p["tokens_per_s"] for p in good], "o-", label=f"{series}: {setting}")
        ax_m.plot([p["seq_len"] for p in good], [p["peak_mem_gib"] for p in good], "o-", color=line.get_color())
        for p in pts:
            if p["status"] in REAL:
                ax_t.plot(p["seq_len"], 0, "x", color=line.get_color())
    for ax, label in ((ax_t, "tokens/s, all ranks (x: did not complete)"), (ax_m, "peak GiB, rank 0")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens), local batch 1")
        ax.set_ylabel(label)
    ax_t.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
