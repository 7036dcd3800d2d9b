"""End-to-end comparison with torchtitan 0.2.2's own Trainer on its DeepSeek-V3 model (issue 18).

    python benchmarks/e2e_vs_torchtitan.py --nproc 2 --budget-s 520 --point-timeout-s 150 --out $OUT/e2e

Three series (four with --auto) on the same W GPUs, the same embedded corpus and 2048-token tokenizer,
every point a real run (torchrun) of a few steps:
  torchtitan  its Trainer on DeepSeek-V3 registered at `small`'s shape (benchmarks/titan_launch.py;
              both parameter counts printed, equal within 1% or nothing runs), best of its settings
  ours-all    mop_train with every operator on (benchmarks/e2e_settings.all_operators)
  ours-best   mop_train with the best of several layouts and operator sets
  ours-auto   mop_train as `mop-train plan --auto` configures it for each point (the most tokens/s its
              cost model predicts among what its memory plan fits on --gpu-memory / --host-memory);
              a point it fits nothing at is recorded as skipped with the planner's reason; not in the
              batch search (it would re-plan each batch)
Figures: tokens/s over all ranks at 32K context (median over the steps after the first); the
longest context at local batch 1 that completes 2 steps (double from 32K, then bisect to 1/8 of
the last bracket, up to --max-seq; the bound that stopped it: oom / timeout / failed / limit /
budget); tokens/s at torchtitan's longest context; the largest global batch at 8K context.
A point's setting is tried in the order of benchmarks/e2e_settings.candidates; what the global
budget (--budget-s) cannot fit is recorded as skipped. The phases run in the order of --phases, the
headline figures first. Every point is recorded (ok / oom / failed / timeout / skipped) in
<out>/e2e.json and e2e.csv after each run; e2e.png and a table at the end. Runs' own output: <out>/runs/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.e2e_settings import (AutoSettings, candidates, our_command, read_titan_metrics,  # noqa: E402
                                     titan_command)
from mop_train.sweep import (Clock, Search, describe, format_table, launch, point_from_launch,  # noqa: E402
                             read_train_metrics, write_results)

TITAN, OURS_ALL, OURS_BEST, OURS_AUTO = "torchtitan", "ours-all", "ours-best", "ours-auto"
SERIES = (TITAN, OURS_ALL, OURS_BEST)
PHASES = ("tps32k", "reach-titan-double", "reach-ours-past-titan", "reach-titan-bisect",
          "tps-at-titan-max", "reach-ours", "batch8k", "tps32k-more")
SEQ_MULTIPLE = 1024


class Bench:
    """Runs points within the budget and keeps every one of them."""

    def __init__(self, args, cands: dict, *, assets: str, titan_error: str | None, meta: dict,
                 auto: AutoSettings | None = None):
        self.args, self.cands, self.assets, self.titan_error, self.meta = args, cands, assets, titan_error, meta
        self.auto = auto
        self.series = SERIES + ((OURS_AUTO,) if auto is not None else ())
        self.clock = Clock(args.budget_s, reserve_s=args.reserve_s)
        self.points: list[dict] = []
        self.broken: set[tuple[str, str]] = set()  # (series, setting) that failed with a real error
        self.reach = {s: Search(args.start_seq, args.max_seq, multiple=SEQ_MULTIPLE) for s in (TITAN, OURS_ALL)}
        self.batch: dict[str, tuple[object, Search]] = {}

    # -- one point --------------------------------------------------------------------------------

    def run(self, series: str, setting, *, seq_len: int, local_batch: int, steps: int, purpose: str) -> dict:
        for p in self.points:  # the same run already made, with at least as many steps
            if (p["series"], p["setting"], p["seq_len"], p["local_batch"]) == (series, setting.name, seq_len, local_batch) \
                    and p["status"] != "skipped" and p["steps_asked"] >= steps:
                return p
        point = {"series": series, "setting": setting.name, "purpose": purpose, "seq_len": seq_len,
                 "local_batch": local_batch, "global_batch": setting.global_batch(self.args.nproc, local_batch),
                 "steps_asked": steps, "started_s": round(self.clock.elapsed(), 1)}
        if series == OURS_AUTO:  # what the planner expected, beside what the run measures
            point.update(predicted_tokens_per_s=setting.predicted_tokens_per_s,
                         planned_peak_gib=setting.planned_peak_gib, flags=" ".join(setting.flags()))
        limit = self.clock.time_for_point(self.args.point_timeout_s, self.args.min_point_s)
        if series == TITAN and self.titan_error:
            point.update(status="failed", error=self.titan_error)
        elif limit is None:
            point.update(status="skipped", error="global budget spent")
        else:
            print(f"{self.clock.stamp()} run {series} {setting.name} S={seq_len} B={local_batch} "
                  f"({purpose}, limit {limit:.0f} s)", flush=True)
            point.update(self._launch(series, setting, seq_len, local_batch, steps, limit), time_limit_s=round(limit))
            if point["status"] == "failed":
                self.broken.add((series, setting.name))
            if point["status"] == "timeout" and limit < self.args.point_timeout_s:
                point["budget_cut"] = True  # the budget's limit, not the point's: says nothing of the setting
        self.points.append(point)
        print(f"{self.clock.stamp()} {series} {setting.name} S={seq_len} B={local_batch}: {describe(point, None)}",
              flush=True)
        self.save()
        return point

    def _launch(self, series, setting, seq_len, local_batch, steps, limit) -> dict:
        folder = os.path.join(os.path.abspath(self.args.out), "runs",
                              f"{series}-{setting.name}-S{seq_len}-B{local_batch}")
        if series == TITAN:
            cmd = titan_command(self.args.nproc, folder, setting, flavor=self.args.model, seq_len=seq_len,
                                local_batch=local_batch, steps=steps, timeout_s=limit, hf_assets_path=self.assets)
            summarize = lambda: read_titan_metrics(folder)  # noqa: E731
        else:
            cmd = our_command(self.args.config, self.args.nproc, folder, setting, seq_len=seq_len,
                              local_batch=local_batch, steps=steps)
            summarize = lambda: read_train_metrics(folder)  # noqa: E731
        return point_from_launch(launch(cmd, os.path.join(folder, "output.log"), timeout_s=limit, cwd=REPO), summarize)

    def best_of(self, series: str, kind: str, *, seq_len: int, local_batch: int, steps: int, purpose: str,
                completed: int = 1, give_up: int | None = None) -> dict | None:
        """Try the series' settings for `kind` in order until `completed` of them completed or
        `give_up` of them ran out of memory or time; a setting that fails with an error is dropped
        for good and the next one tried. Returns the fastest ok point, else the first point that
        ran, else None (the budget ran out first)."""
        oks, first, misses = [], None, 0
        for setting in self.settings_for(series, kind, seq_len=seq_len, local_batch=local_batch, purpose=purpose):
            if (series, setting.name) in self.broken:
                continue
            p = self.run(series, setting, seq_len=seq_len, local_batch=local_batch, steps=steps, purpose=purpose)
            if p["status"] == "skipped":
                break
            first = first or p
            if p["status"] == "ok":
                oks.append(p)
                if len(oks) >= completed:
                    break
            elif p["status"] != "failed":
                misses += 1
                if give_up is not None and misses >= give_up:
                    break
        return max(oks, key=lambda q: q["tokens_per_s"]) if oks else first

    def settings_for(self, series: str, kind: str, *, seq_len: int, local_batch: int, purpose: str) -> list:
        """The series' settings for a point: its candidate list, or for ours-auto the planner's choice at
        this point (none, and a skipped point saying why, when the planner fits nothing)."""
        if series != OURS_AUTO:
            return self.cands[series][kind]
        chosen = self.auto.at(seq_len, local_batch)
        if chosen is None:
            self.points.append({"series": series, "setting": "auto", "purpose": purpose, "seq_len": seq_len,
                                "local_batch": local_batch, "status": "skipped", "started_s": round(self.clock.elapsed(), 1),
                                "error": "mop-train plan --auto fits no configuration at this point (on paper)"})
            return []
        return [chosen]

    # -- searches ---------------------------------------------------------------------------------

    def reach_search(self, series: str, *, doubling_only: bool = False, up_to: int | None = None) -> None:
        search = self.reach[series]
        while (value := search.next_value()) is not None:
            if (doubling_only and search.fail is not None) or (up_to is not None and value > up_to):
                return
            status = self.probe(series, value)
            if status is None:
                search.stopped_by = "budget"
                return
            search.record(value, status)

    def probe(self, series: str, seq_len: int) -> str | None:
        """Does any setting of the series complete 2 steps at seq_len, batch 1? ok / oom / timeout /
        failed, or None when the budget ran out first. An ok point already made is reused."""
        if any(p["series"] == series and p["seq_len"] == seq_len and p["local_batch"] == 1 and p["status"] == "ok"
               for p in self.points):
            return "ok"
        p = self.best_of(series, "reach", seq_len=seq_len, local_batch=1, steps=self.args.reach_steps,
                         purpose="reach", give_up=self.args.reach_tries)
        return None if p is None or p.get("budget_cut") else p["status"]

    def batch_search(self, series: str) -> None:
        """Double the local batch at --batch-seq from 1 with the series' first working batch setting."""
        for setting in self.cands[series]["batch"]:
            if (series, setting.name) in self.broken:
                continue
            search = Search(1, self.args.max_batch)
            self.batch[series] = (setting, search)
            while (b := search.next_value()) is not None:
                p = self.run(series, setting, seq_len=self.args.batch_seq, local_batch=b,
                             steps=self.args.reach_steps, purpose="batch")
                if p["status"] == "skipped" or p.get("budget_cut"):
                    search.stopped_by = "budget"
                    return
                search.record(b, p["status"])
            if (series, setting.name) not in self.broken:
                return

    # -- phases -----------------------------------------------------------------------------------

    def phase(self, name: str) -> None:
        a = self.args
        if name in ("tps32k", "tps32k-more"):
            for series in self.series:
                completed = 1 if name == "tps32k" or series == OURS_AUTO else len(self.cands[series]["tps"])
                self.best_of(series, "tps", seq_len=a.start_seq, local_batch=1, steps=a.tps_steps,
                             purpose="tps", completed=completed)
        elif name == "reach-titan-double":
            self.reach_search(TITAN, doubling_only=True)
        elif name == "reach-ours-past-titan":
            titan = self.reach[TITAN]
            self.reach_search(OURS_ALL, doubling_only=True, up_to=titan.fail or titan.ok)
        elif name == "reach-titan-bisect":
            self.reach_search(TITAN)
        elif name == "tps-at-titan-max":
            longest = self.reach[TITAN].ok
            if longest is None:
                print(f"{self.clock.stamp()} tps-at-titan-max: torchtitan has no completed length yet", flush=True)
                return
            for series in (OURS_ALL, OURS_BEST) + self.series[len(SERIES):]:
                self.best_of(series, "tps", seq_len=longest, local_batch=1, steps=a.tps_steps,
                             purpose="tps-at-titan-max")
        elif name == "reach-ours":
            self.reach_search(OURS_ALL)
        elif name == "batch8k":
            for series in SERIES:
                self.batch_search(series)
        else:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASES}")

    # -- results ----------------------------------------------------------------------------------

    def headline(self) -> dict:
        a, ok = self.args, [p for p in self.points if p["status"] == "ok"]

        def fastest(series, seq_len):
            pts = [p for p in ok if p["series"] == series and p["seq_len"] == seq_len and p["local_batch"] == 1]
            best = max(pts, key=lambda p: p["tokens_per_s"], default=None)
            return None if best is None else {k: best[k] for k in ("tokens_per_s", "peak_mem_gib", "setting", "steps",
                                                                     "global_batch")}

        longest = self.reach[TITAN].ok
        reach = {s: self.reach[s].summary() for s in (TITAN, OURS_ALL)}
        reach[OURS_BEST] = {**reach[OURS_ALL], "note": "every operator on is ours' most frugal set; same search"}
        batch = {}
        for series, (setting, search) in self.batch.items():
            batch[series] = {**search.summary(), "setting": setting.name,
                             "largest_global_batch": search.ok and setting.global_batch(a.nproc, search.ok)}
        return {"tps_at_start_seq": {s: fastest(s, a.start_seq) for s in self.series},
                "reach": reach, "titan_longest_seq": longest,
                "tps_at_titan_longest": {s: fastest(s, longest) for s in self.series} if longest else None,
                "batch_at_batch_seq": batch}

    def save(self, plot: bool = False) -> dict:
        meta = {**self.meta, "elapsed_s": round(self.clock.elapsed(), 1), "headline": self.headline()}
        return write_results(os.path.join(self.args.out, "e2e.json"), meta, self.points,
                             plot=plot_e2e if plot else None)


def plot_e2e(points: list[dict], png_path: str) -> None:
    """Tokens/s against context per series and setting; failed points marked by status."""
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    series_settings = dict.fromkeys((p["series"], p["setting"]) for p in points if p["local_batch"] == 1)
    for series, setting in series_settings:
        pts = sorted((p for p in points if (p["series"], p["setting"]) == (series, setting) and p["local_batch"] == 1),
                     key=lambda p: p["seq_len"])
        good = [p for p in pts if p["status"] == "ok"]
        line, = ax_t.plot([p["seq_len"] for p in good], [p["tokens_per_s"] for p in good], "o-",
                          label=f"{series}: {setting}")
        ax_m.plot([p["seq_len"] for p in good], [p["peak_mem_gib"] for p in good], "o-", color=line.get_color())
        for p in pts:
            if p["status"] not in ("ok", "skipped"):
                ax_t.plot(p["seq_len"], 0, "x", color=line.get_color())
                ax_t.annotate(p["status"], (p["seq_len"], 0), rotation=90, fontsize=7, color=line.get_color())
    for ax, label in ((ax_t, "tokens/s, all ranks (x: did not complete)"), (ax_m, "peak GiB, rank 0")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens), local batch 1")
        ax.set_ylabel(label)
    ax_t.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def format_headline(h: dict) -> str:
    lines = ["headline:"]
    for s, v in h["tps_at_start_seq"].items():
        lines.append(f"  tokens/s at start context  {s:>10}: " + (f"{v['tokens_per_s']:,.0f} ({v['setting']}, "
                     f"global batch {v['global_batch']}, peak {v['peak_mem_gib']:.1f} GiB)" if v else "none completed"))
    for s, v in h["reach"].items():
        lines.append(f"  longest context, batch 1   {s:>10}: {v['largest_ok']} (stopped by {v['stopped_by']}"
                     + (f"; {v['not_ok_status']} at {v['smallest_not_ok']})" if v["smallest_not_ok"] else ")"))
    for s, v in (h["tps_at_titan_longest"] or {}).items():
        lines.append(f"  tokens/s at titan's longest {s:>9}: " + (f"{v['tokens_per_s']:,.0f} ({v['setting']})" if v else "none completed"))
    for s, v in h["batch_at_batch_seq"].items():
        lines.append(f"  largest global batch       {s:>10}: {v['largest_global_batch']} ({v['setting']}; "
                     f"stopped by {v['stopped_by']})")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="GPUs (ranks) per run")
    p.add_argument("--model", default="small", help="zoo model (an MLA config) for both sides")
    p.add_argument("--config", default="configs/small_1gpu.toml", help="our job config (layout flags are added)")
    p.add_argument("--vocab-degree", type=int, default=1, help="P of ours with every operator on")
    p.add_argument("--budget-s", type=float, default=520, help="wall-clock budget of the whole comparison")
    p.add_argument("--reserve-s", type=float, default=10, help="budget kept for writing the results")
    p.add_argument("--point-timeout-s", type=float, default=150, help="time limit of one point (a run)")
    p.add_argument("--min-point-s", type=float, default=40, help="skip a point the budget gives less than this")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="what to run, in order")
    p.add_argument("--start-seq", type=int, default=32768, help="throughput context; reach searches start here")
    p.add_argument("--max-seq", type=int, default=1 << 22, help="reach searches stop here (4M)")
    p.add_argument("--batch-seq", type=int, default=8192, help="context of the batch search")
    p.add_argument("--max-batch", type=int, default=1024, help="largest local batch the batch search tries")
    p.add_argument("--tps-steps", type=int, default=4, help="steps of a throughput point")
    p.add_argument("--reach-steps", type=int, default=2, help="steps of a reach or batch probe")
    p.add_argument("--reach-tries", type=int, default=1,
                   help="settings tried at a reach probe that runs out of memory or time before it counts as not ok")
    p.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                   help="run the ours-auto series (mop-train plan --auto per point)")
    p.add_argument("--gpu-memory", default=None, help="ours-auto: bytes per GPU (default: the device's total)")
    p.add_argument("--host-memory", default=None, help="ours-auto: host bytes per node (default: available now)")
    p.add_argument("--out", default=os.environ.get("OUT", "outputs") + "/e2e", help="output folder")
    return p.parse_args(argv)


def prepare(args) -> tuple[str, str | None, dict]:
    """Build the embedded assets once, compare parameter counts; (assets folder, torchtitan error, meta)."""
    from mop_train.train.data import EMBEDDED, default_cache_dir, embedded_assets, load_documents

    start = time.perf_counter()
    assets = embedded_assets(default_cache_dir())
    load_documents(EMBEDDED, None, cache_dir=default_cache_dir())  # warm the datasets cache before the ranks race
    print(f"embedded corpus and tokenizer: {assets} ({time.perf_counter() - start:.1f} s)", flush=True)
    titan_error, counts = None, None
    try:
        from benchmarks import titan_launch
    except Exception as err:  # torchtitan 0.2.2 against another torch can fail at import in many ways
        titan_error = f"torchtitan does not import here: {type(err).__name__}: {err}"
        print(titan_error + " (its points are recorded as failed)", flush=True)
    else:
        counts = titan_launch.check_param_counts(args.model)  # raises when they differ by more than 1%
        print(f"parameters of {args.model!r}: torchtitan DeepSeek-V3 {counts['torchtitan']:,}, "
              f"ours {counts['mop_train']:,}", flush=True)
    return assets, titan_error, {"model": args.model, "nproc": args.nproc, "param_counts": counts,
                                 "args": vars(args), "titan_error": titan_error}


def auto_settings(args) -> AutoSettings | None:
    """ours-auto's planner for this machine: --gpu-memory / --host-memory, else what the device and host have."""
    if not args.auto:
        return None
    import torch

    from mop_train.ops.sco.budget import available_host_bytes
    from mop_train.units import parse_bytes

    if args.gpu_memory:
        gpu = parse_bytes(args.gpu_memory, key="--gpu-memory")
    elif torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).total_memory
    else:
        raise ValueError("--auto needs --gpu-memory on a machine without a GPU (or --no-auto)")
    host = parse_bytes(args.host_memory, key="--host-memory") if args.host_memory else available_host_bytes()
    return AutoSettings(args.config, world=args.nproc, gpu_bytes=gpu, host_bytes=host)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    assets, titan_error, meta = prepare(args)
    auto = auto_settings(args)
    bench = Bench(args, candidates(args.nproc, args.vocab_degree), assets=assets, titan_error=titan_error, meta=meta,
                  auto=auto)
    for name in args.phases:
        print(f"{bench.clock.stamp()} phase {name}", flush=True)
        bench.phase(name)
    print(format_table("seq_len", bench.points, label="series"))
    print(format_headline(bench.headline()))
    paths = bench.save(plot=True)
    print("results: " + ", ".join(p for p in paths.values() if p))


if __name__ == "__main__":
    main()
