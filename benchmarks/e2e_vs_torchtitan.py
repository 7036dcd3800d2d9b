"""End-to-end comparison with torchtitan 0.2.2's own Trainer on its DeepSeek-V3 model (issues 18, 37).

    python benchmarks/e2e_vs_torchtitan.py --nproc 1 --budget-s 545 --phases tps --out $OUT/e2e
    python benchmarks/e2e_vs_torchtitan.py --merge-only --resume a/e2e.json b/e2e.json --out merged

Series on the same W GPUs, the same embedded corpus and 2048-token tokenizer, every point a real
run (torchrun) of a few steps:
  torchtitan  its Trainer on DeepSeek-V3 registered at `small`'s shape (benchmarks/titan_launch.py;
              both parameter counts printed, equal within 1% or nothing runs)
  ours-auto   mop_train as `mop-train plan --auto` configures it for each point, eager and compiled at
              the throughput points (skipped, with the reason, where the planner fits nothing)
  ours-best   mop_train with the plain layout (and, at 2+ ranks, the expert-parallel ones)
  ours-all    mop_train with every operator on (benchmarks/e2e_settings.all_operators)
Phases (--phases, in that order; each independent of the others' outcome):
  tps            at each --tps-points SxB, every setting of every --series (torchtitan: every AC x
                 compile x layout, e2e_settings.titan_grid), in rounds (each series' first setting,
                 then its second, ...) so a short budget still runs each series' likeliest best;
                 a torchtitan setting that holds at least the memory of one that ran out of memory
                 there is recorded as "pruned", not run; a failed one is dropped and the next tried
  reach-titan, reach-ours
                 the longest context at batch 1 that completes --reach-steps steps: double from
                 --start-seq (or --reach-bracket SERIES=LO:HI: LO, HI, then bisect) to 1/8 of the
                 last bracket; a probe tries the series' reach settings until one completes or
                 --reach-tries ran out of memory or time
  tps-at-titan-max  ours at torchtitan's longest completed context (from the points so far)
  batch8k        the largest local batch at --batch-seq with each series' first working batch
                 setting (--batch-bracket SERIES=LO:HI as for reach)
  loss8k         --loss-steps steps at --batch-seq of torchtitan (its fastest setting so far) and ours
                 (ours-auto, else ours-best), one shared LR schedule, same data order at one rank
Every point (ok / oom / failed / timeout / pruned / skipped) goes to <out>/e2e.json and .csv after
each run, each phase's own points to <out>/phase-<name>.json; --resume FILES loads earlier points
(a run already made is not made again; searches continue from them); the figures (benchmarks/
e2e_report.py) are functions of the points, so commands merge. FLOPs: one count for both sides
(e2e_report.FLOP_NOTE), MFU against --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks import e2e_report as report  # noqa: E402
from benchmarks.e2e_report import probe_status, search_of  # noqa: E402
from benchmarks.e2e_settings import (OURS_ALL, OURS_AUTO, OURS_BEST, SERIES, TITAN, AutoSettings, brackets,  # noqa: E402
                                     candidates, our_command, pair, read_losses, read_titan_metrics, runs_on,
                                     titan_command)
from mop_train.sweep import Clock, describe, launch, point_from_launch, read_train_metrics, write_results  # noqa: E402

PHASES = ("tps", "reach-titan", "reach-ours", "tps-at-titan-max", "batch8k", "loss8k")
SEQ_MULTIPLE = 1024


class Bench:
    """Runs points within the budget and keeps every one of them (with those it resumed from)."""

    def __init__(self, args, cands: dict, *, assets: str, titan_error: str | None, meta: dict,
                 auto: AutoSettings | None = None, points: list[dict] = ()):
        self.args, self.cands, self.assets, self.titan_error, self.meta = args, cands, assets, titan_error, meta
        self.auto = auto
        self.series = tuple(s for s in SERIES if (s != OURS_AUTO or auto is not None) and s in args.series)
        self.clock = Clock(args.budget_s, reserve_s=args.reserve_s)
        self.points: list[dict] = list(points)
        self.titan_by_name = {s.name: s for kinds in cands[TITAN].values() for s in kinds}

    def broken(self, series: str, setting) -> bool:
        """The setting failed with a real error at some point: it is not tried again."""
        return any(p["series"] == series and p["setting"] == setting.name and p["status"] == "failed"
                   for p in self.points)

    # -- one point --------------------------------------------------------------------------------

    def run(self, series: str, setting, *, seq_len: int, local_batch: int, steps: int, purpose: str,
            search: dict | None = None, warmup_steps: int | None = None) -> dict:
        for p in self.points:  # the same run already made, with at least as many steps
            if (p["series"], p["setting"], p["seq_len"], p["local_batch"]) == (series, setting.name, seq_len, local_batch) \
                    and p["status"] != "skipped" and p["steps_asked"] >= steps and (purpose != "loss" or "losses" in p):
                return p
        point = {"series": series, "setting": setting.name, "purpose": purpose, "seq_len": seq_len,
                 "local_batch": local_batch, "global_batch": setting.global_batch(self.args.nproc, local_batch),
                 "world": self.args.nproc, "steps_asked": steps, "started_s": round(self.clock.elapsed(), 1)}
        if search is not None:
            point["search"] = search
        if series == OURS_AUTO:  # what the planner expected, beside what the run measures
            point.update(predicted_tokens_per_s=setting.predicted_tokens_per_s,
                         planned_peak_gib=setting.planned_peak_gib, flags=" ".join(setting.flags()))
        limit = self.clock.time_for_point(self.args.point_timeout_s, self.args.min_point_s)
        pruned_by = self.pruned_by(series, setting, seq_len, local_batch)
        failed = next((p for p in self.points if (p["series"], p["setting"], p["status"]) == (series, setting.name, "failed")),
                      None)
        if series == TITAN and self.titan_error:
            point.update(status="failed", error=self.titan_error)
        elif failed:
            point.update(status="failed", not_run=True, error=f"not run again: it failed at S={failed['seq_len']} "
                                                              f"B={failed['local_batch']}: {failed.get('error')}")
        elif pruned_by:
            point.update(status="pruned", error=f"{pruned_by} ran out of memory here and this setting holds at least "
                                                f"as much (assumed: AC full < selective < none, compile model+loss < loss < off)")
        elif limit is None:
            point.update(status="skipped", error="global budget spent")
        else:
            print(f"{self.clock.stamp()} run {series} {setting.name} S={seq_len} B={local_batch} "
                  f"({purpose}, limit {limit:.0f} s)", flush=True)
            point.update(self._launch(series, setting, seq_len, local_batch, steps, limit, warmup_steps,
                                      losses=purpose == "loss"), time_limit_s=round(limit))
            if point["status"] == "timeout" and limit < self.args.point_timeout_s:
                point["budget_cut"] = True  # the budget's limit, not the point's: says nothing of the setting
        self.points.append(point)
        print(f"{self.clock.stamp()} {series} {setting.name} S={seq_len} B={local_batch}: {describe(point, None)}",
              flush=True)
        self.save()
        return point

    def pruned_by(self, series: str, setting, seq_len: int, local_batch: int) -> str | None:
        """The name of a torchtitan setting that ran out of memory at this point and holds no more
        memory than `setting`, if any."""
        if series != TITAN:
            return None
        for p in self.points:
            other = self.titan_by_name.get(p["setting"])
            if p["series"] == TITAN and p["status"] == "oom" and (p["seq_len"], p["local_batch"]) == (seq_len, local_batch) \
                    and other is not None and setting.holds_at_least(other):
                return other.name
        return None

    def _launch(self, series, setting, seq_len, local_batch, steps, limit, warmup_steps, *, losses: bool) -> dict:
        folder = os.path.join(os.path.abspath(self.args.out), "runs",
                              f"{series}-{setting.name}-S{seq_len}-B{local_batch}-n{steps}")
        if series == TITAN:
            try:
                cmd = titan_command(self.args.nproc, folder, setting, flavor=self.args.model, seq_len=seq_len,
                                    local_batch=local_batch, steps=steps, timeout_s=limit, hf_assets_path=self.assets,
                                    warmup_steps=warmup_steps or 1)
            except ValueError as err:  # a setting torchtitan cannot run here: reported, the next one tried
                return {"status": "failed", "seconds": 0.0, "error": str(err)}
            summarize = lambda: read_titan_metrics(folder)  # noqa: E731
        else:
            cmd = our_command(self.args.config, self.args.nproc, folder, setting, seq_len=seq_len,
                              local_batch=local_batch, steps=steps, warmup_steps=warmup_steps)
            summarize = lambda: read_train_metrics(folder)  # noqa: E731
        point = point_from_launch(launch(cmd, os.path.join(folder, "output.log"), timeout_s=limit, cwd=REPO), summarize)
        if losses and point["status"] == "ok":
            point["losses"] = read_losses(folder, "loss_metrics/global_avg_loss" if series == TITAN else "loss")
        return point

    def settings_for(self, series: str, kind: str, *, seq_len: int, local_batch: int, purpose: str) -> list:
        """The series' settings for a point: its candidate list (torchtitan's: those it can run on
        --nproc ranks), or for ours-auto the planner's choice at this point, eager then compiled for
        throughput (none, and a skipped point saying why, when the planner fits nothing)."""
        if series == TITAN:
            return [s for s in self.cands[TITAN][kind] if runs_on(s, self.args.nproc)]
        if series != OURS_AUTO:
            return self.cands[series][kind]
        chosen = self.auto.at(seq_len, local_batch)
        if chosen is None:
            if not any(p["series"] == series and (p["seq_len"], p["local_batch"]) == (seq_len, local_batch)
                       and p["setting"] == "auto" for p in self.points):
                self.points.append({"series": series, "setting": "auto", "purpose": purpose, "seq_len": seq_len,
                                    "local_batch": local_batch, "status": "skipped", "steps_asked": 0,
                                    "started_s": round(self.clock.elapsed(), 1),
                                    "error": "mop-train plan --auto fits no configuration at this point (on paper)"})
            return []
        return [chosen, chosen.compiled()] if kind == "tps" else [chosen]

    # -- phases -----------------------------------------------------------------------------------

    def tps(self) -> None:
        a = self.args
        queues = {(s, b, series): self.settings_for(series, "tps", seq_len=s, local_batch=b, purpose="tps")
                  for s, b in a.tps_points for series in self.series}
        for r in range(max(map(len, queues.values()), default=0)):
            for (s, b, series), settings in queues.items():
                if r < len(settings):  # a broken setting is recorded as failed here, not run again
                    self.run(series, settings[r], seq_len=s, local_batch=b, steps=a.tps_steps, purpose="tps")

    def search(self, series: str, kind: str, settings: list, *, seq_len: int | None = None) -> None:
        """Reach (seq_len None: the context at batch 1) or batch (the local batch at seq_len) search
        over `settings`, probes answered from the points where they can be (e2e_report.probe_status)."""
        a = self.args
        lo, hi = getattr(a, f"{kind}_bracket").get(series, (None, None))
        if kind == "reach":
            params = {"start": lo or a.start_seq, "limit": hi or a.max_seq, "multiple": SEQ_MULTIPLE}
            tries = a.reach_tries
        else:
            params, tries = {"start": lo or 1, "limit": hi or a.max_batch, "multiple": 1}, 1
        params.update(bracket=lo is not None, settings=[s.name for s in settings], tries=tries, kind=kind)
        search = search_of(params)
        while (value := search.next_value()) is not None:
            at = dict(seq_len=value, local_batch=1) if kind == "reach" else dict(seq_len=seq_len, local_batch=value)
            status, cut = probe_status(self.points, series, **at, params=params, any_ok=kind == "reach")
            if status is None and not cut:
                self.probe(series, settings, at, kind, params)
                status, cut = probe_status(self.points, series, **at, params=params, any_ok=kind == "reach")
            if status is None:
                return
            search.record(value, status)

    def probe(self, series: str, settings: list, at: dict, kind: str, params: dict) -> None:
        misses = 0
        for setting in settings:
            if self.broken(series, setting):
                continue
            p = self.run(series, setting, **at, steps=self.args.reach_steps, purpose=kind, search=params)
            if p["status"] in ("ok", "skipped") or p.get("budget_cut"):
                return
            misses += p["status"] in ("oom", "timeout")
            if misses >= params["tries"]:
                return

    def batch(self, series: str) -> None:
        """The series' first batch setting that does not fail decides its batch figure."""
        a = self.args
        for setting in self.settings_for(series, "batch", seq_len=a.batch_seq, local_batch=1, purpose="batch"):
            if not self.broken(series, setting):
                self.search(series, "batch", [setting], seq_len=a.batch_seq)
            if not self.broken(series, setting):
                return

    def fastest_first(self, series: str, settings: list) -> list:
        """`settings` with the series' fastest completed throughput setting so far moved to the front."""
        ok = [p for p in self.points if p["series"] == series and p["status"] == "ok" and p.get("purpose") == "tps"]
        best = max(ok, key=lambda p: p["tokens_per_s"])["setting"] if ok else None
        return sorted(settings, key=lambda s: s.name != best)

    def first_ok(self, series: str, settings: list, **point) -> dict | None:
        """Run `settings` in order until one completes (returned) or the budget is spent (None)."""
        for setting in settings:
            if not self.broken(series, setting):
                p = self.run(series, setting, **point)
                if p["status"] == "ok":
                    return p
                if p["status"] == "skipped":
                    return None
        return None

    def phase(self, name: str) -> None:
        a = self.args
        first = len(self.points)
        if name == "tps":
            self.tps()
        elif name in ("reach-titan", "reach-ours"):
            series = TITAN if name == "reach-titan" else OURS_ALL
            self.search(series, "reach", self.settings_for(series, "reach", seq_len=0, local_batch=1, purpose="reach"))
        elif name == "tps-at-titan-max":
            titan = report.reach_summary(self.points, TITAN)
            if not titan or titan["largest_ok"] is None:
                print(f"{self.clock.stamp()} tps-at-titan-max: torchtitan has no completed length yet", flush=True)
            else:
                for series in (s for s in self.series if s != TITAN):
                    self.first_ok(series, self.settings_for(series, "tps", seq_len=titan["largest_ok"], local_batch=1,
                                                            purpose="tps-at-titan-max"),
                                  seq_len=titan["largest_ok"], local_batch=1, steps=a.tps_steps, purpose="tps-at-titan-max")
        elif name == "batch8k":
            for series in (TITAN, OURS_BEST):
                self.batch(series)
        elif name == "loss8k":
            at = dict(seq_len=a.batch_seq, local_batch=a.loss_batch, steps=a.loss_steps, purpose="loss",
                      warmup_steps=a.loss_warmup)
            self.first_ok(TITAN, self.fastest_first(TITAN, self.settings_for(TITAN, "tps", seq_len=0, local_batch=1,
                                                                              purpose="loss")), **at)
            auto = self.settings_for(OURS_AUTO, "tps", seq_len=a.batch_seq, local_batch=a.loss_batch,
                                     purpose="loss") if self.auto else []
            for series, settings in ((OURS_AUTO, auto), (OURS_BEST, self.cands[OURS_BEST]["tps"][:1])):
                if settings and self.first_ok(series, settings, **at):
                    break
        else:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASES}")
        self.save_phase(name, self.points[first:])

    # -- results ----------------------------------------------------------------------------------

    def headline(self) -> dict:
        return report.headline(self.points, model=self.args.model, peak_tflops=self.args.peak_tflops)

    def save(self, plot: bool = False) -> dict:
        meta = {**self.meta, "elapsed_s": round(self.clock.elapsed(), 1), "headline": self.headline()}
        return write_results(os.path.join(self.args.out, "e2e.json"), meta, self.points,
                             plot=report.plot_e2e if plot else None)

    def save_phase(self, name: str, points: list[dict]) -> None:
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, f"phase-{name}.json"), "w") as f:
            json.dump({**self.meta, "phase": name, "elapsed_s": round(self.clock.elapsed(), 1), "points": points}, f,
                      indent=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) per run")
    p.add_argument("--model", default="small", help="zoo model (an MLA config) for both sides")
    p.add_argument("--config", default="configs/small_1gpu.toml", help="our job config (layout flags are added)")
    p.add_argument("--vocab-degree", type=int, default=1, help="P of ours with every operator on")
    p.add_argument("--budget-s", type=float, default=545, help="wall-clock budget of this command")
    p.add_argument("--reserve-s", type=float, default=10, help="budget kept for writing the results")
    p.add_argument("--point-timeout-s", type=float, default=200, help="time limit of one point (a run)")
    p.add_argument("--min-point-s", type=float, default=40, help="skip a point the budget gives less than this")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="what to run, in order")
    p.add_argument("--tps-points", nargs="+", default=["32768x1", "4096x8"], help="throughput points SxB")
    p.add_argument("--series", nargs="+", default=list(SERIES), choices=SERIES,
                   help="the series of the tps and tps-at-titan-max phases")
    p.add_argument("--start-seq", type=int, default=32768, help="reach searches start here (without a bracket)")
    p.add_argument("--max-seq", type=int, default=1 << 22, help="reach searches stop here (4M)")
    p.add_argument("--reach-bracket", nargs="+", default=[], metavar="SERIES=LO:HI",
                   help="start a reach search at LO, then HI, then bisect (e.g. torchtitan=65536:131072)")
    p.add_argument("--batch-bracket", nargs="+", default=[], metavar="SERIES=LO:HI", help="the same for the batch search")
    p.add_argument("--batch-seq", type=int, default=8192, help="context of the batch search and the loss curves")
    p.add_argument("--max-batch", type=int, default=1024, help="largest local batch the batch search tries")
    p.add_argument("--tps-steps", type=int, default=4, help="steps of a throughput point")
    p.add_argument("--reach-steps", type=int, default=2, help="steps of a reach or batch probe")
    p.add_argument("--reach-tries", type=int, default=1,
                   help="settings at a reach probe that may run out of memory or time before it counts as not ok")
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the loss curves")
    p.add_argument("--loss-batch", type=int, default=1, help="local batch of the loss curves")
    p.add_argument("--loss-warmup", type=int, default=20, help="LR warmup steps of the loss curves (both sides)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="MFU's peak, bf16 dense TFLOP/s per GPU: 790 is what the lent H200 sustains (the issue's "
                        "figure); its datasheet says 989 (torchtitan's and the trainer's default)")
    p.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                   help="run the ours-auto series (mop-train plan --auto per point)")
    p.add_argument("--gpu-memory", default=None, help="ours-auto: bytes per GPU (default: the device's total)")
    p.add_argument("--host-memory", default=None, help="ours-auto: host bytes per node (default: available now)")
    p.add_argument("--resume", nargs="+", default=[], metavar="JSON", help="earlier e2e.json / phase-*.json to continue")
    p.add_argument("--merge-only", action="store_true", help="run nothing: merge --resume files and report")
    p.add_argument("--out", default=os.environ.get("OUT", "outputs") + "/e2e", help="output folder")
    args = p.parse_args(argv)
    try:
        if not all("x" in t for t in args.tps_points):
            raise ValueError(f"{args.tps_points}: write each point as SxB")
        args.tps_points = [pair(t, "x", ordered=False) for t in args.tps_points]
    except ValueError as err:
        p.error(f"--tps-points: {err} (e.g. 32768x1 4096x8)")
    try:
        args.reach_bracket = brackets(args.reach_bracket, "--reach-bracket")
        args.batch_bracket = brackets(args.batch_bracket, "--batch-bracket")
    except ValueError as err:
        p.error(str(err))
    return args


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
                                 "args": {k: v for k, v in vars(args).items()}, "titan_error": titan_error,
                                 "flop_note": report.FLOP_NOTE, "peak_tflops": args.peak_tflops}


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
    points = report.load_points(args.resume)
    if args.merge_only:
        meta = {"model": args.model, "merged_from": args.resume, "flop_note": report.FLOP_NOTE,
                "peak_tflops": args.peak_tflops}
        bench = Bench(args, candidates(args.nproc, args.vocab_degree), assets="", titan_error=None, meta=meta,
                      points=points)
    else:
        assets, titan_error, meta = prepare(args)
        bench = Bench(args, candidates(args.nproc, args.vocab_degree), assets=assets, titan_error=titan_error,
                      meta=meta, auto=auto_settings(args), points=points)
        for name in args.phases:
            print(f"{bench.clock.stamp()} phase {name}", flush=True)
            bench.phase(name)
    print(report.format_points(bench.points, model=args.model, peak_tflops=args.peak_tflops))
    print(report.format_headline(bench.headline()))
    paths = bench.save(plot=True)
    print("results: " + ", ".join(p for p in paths.values() if p))


if __name__ == "__main__":
    main()
