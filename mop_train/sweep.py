"""Sweep context length or batch size with real training runs and record what each one did.

    python scripts/sweep_context.py --config configs/small_1gpu.toml --nproc 2 --reach 32768
    python scripts/sweep_context.py --config configs/small_1gpu.toml --nproc 2 --bisect 65536 131072
    python scripts/sweep_batch.py --config configs/small_1gpu.toml --nproc 1 --seq-len 8192 --batches 1 2 4 8

Each point is one `torchrun -m mop_train.train` for a few steps in its own dump folder, its output
in <folder>/output.log; the point's figures come from that run's metrics.jsonl (median over the
steps after the first: tokens/s over all ranks, TFLOP/s; the largest peak memory). A point ends as
  ok       it completed every step
  oom      its output says a device ran out of memory (or a rank was SIGKILLed: host memory)
  failed   any other error (the last error line is kept)
  timeout  it ran past its time limit (the whole process group is killed)
  skipped  the global budget had no time left for it
and the sweep goes on. A point's time limit counts from its start: at the limit its process group
gets SIGTERM, then SIGKILL 10 s later if anything is left; the record says when it was stopped and
when it was gone (`seconds`, the wall time, includes that teardown). On CPU the peak memory is
rank 0's host max RSS (the column and the plot say so), on GPU the allocator's peak.
Values come from a list or a search (`Search`): double from a start until a
point does not complete (or a limit), then bisect the last bracket to 1/8 of its width; `--bisect
LO HI` runs LO, then HI, then bisects. `--max-points N` stops after N points; `--resume` continues
the sweep its --out JSON records (its points kept, the search replayed), so a search can run one point
per command (a device command's time limit). Results: progress lines with elapsed time, a table, and
<out>.json + <out>.csv + <out>.png (the PNG needs matplotlib: `pip install -e '.[sweep]'`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

OOM_MARKERS = ("out of memory", "OutOfMemoryError", "can't allocate memory")
"""CUDA's words, and torch's CPU allocator's ("DefaultCPUAllocator: can't allocate memory": a CPU sweep's OOM)."""
LAUNCHER_NOISE = ("ChildFailedError", "Traceback", "errors.html", "error_file")
"""Lines of torchrun's failure summary that hold "error" but not the rank's error (e.g. "traceback : To enable
traceback see: https://pytorch.org/docs/stable/elastic/errors.html", "error_file: <N/A>")."""
EXCEPTION_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")
SIGKILL_MARKERS = ("Signal 9 (SIGKILL)", "exitcode  : -9")  # torchrun's words for a rank the kernel killed
STATUSES = ("ok", "oom", "failed", "timeout", "skipped")


# ------------------------------------------------------------------------------------------------
# One launch
# ------------------------------------------------------------------------------------------------

KILL_GRACE_S = 10.0
"""Seconds between the SIGTERM of a point that ran past its limit and the SIGKILL of what is left."""


@dataclass(frozen=True)
class Launch:
    returncode: int | None  # None: stopped at its time limit
    seconds: float          # from the start until it had exited (after a stop: until it was gone)
    log_path: str
    stopped_at_s: float | None = None   # when it was sent SIGTERM for running past its limit

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def launch(cmd: list[str], log_path: str, *, timeout_s: float, env: dict | None = None,
           cwd: str | None = None) -> Launch:
    """Run `cmd` in its own process group, output to `log_path`; past `timeout_s` kill the group
    (torchrun and every rank: a surviving rank would keep its GPU memory into the next point)."""
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    start = time.perf_counter()
    stopped_at = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(0.0, timeout_s - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            stopped_at = round(time.perf_counter() - start, 1)
            _kill_group(proc)
            returncode = None
    return Launch(returncode, round(time.perf_counter() - start, 1), log_path, stopped_at)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the group of the process we started, SIGKILL it after KILL_GRACE_S, wait until it is gone."""
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)  # raises once no process of the group is left
            except ProcessLookupError:
                proc.wait()
                return
            time.sleep(0.2)


def classify_failure(text: str) -> tuple[str, str]:
    """("oom" | "failed", the error line) for a run that exited non-zero with output `text`."""
    lines = text.splitlines()
    # The child's own error (our one-line report, else a traceback's exception line), not torchrun's report
    # around it: its summary's "errors.html" line came last and was kept for every rank's traceback.
    own = [ln for ln in lines if not any(n in ln for n in LAUNCHER_NOISE)]
    errors = [ln for ln in lines if ": error:" in ln] or [ln for ln in own if EXCEPTION_LINE.search(ln)] or \
             [ln for ln in own if "Error" in ln or "error" in ln] or lines[-1:]
    error = errors[-1].strip()[-300:] if errors else ""
    if any(m in text for m in OOM_MARKERS):
        oom = [ln for ln in lines if any(m in ln for m in OOM_MARKERS)]
        return "oom", oom[-1].strip()[-300:]
    if any(m in text for m in SIGKILL_MARKERS):
        return "oom", "a rank was killed by SIGKILL (host out of memory?): " + error
    return "failed", error


def point_from_launch(run: Launch, summarize) -> dict:
    """{status, seconds, error | figures}; `summarize()` reads the finished run's figures."""
    point = {"seconds": run.seconds}
    if run.returncode is None:
        return {**point, "status": "timeout", "stopped_at_s": run.stopped_at_s,
                "error": f"ran past its time limit: stopped (SIGTERM) {run.stopped_at_s} s after its start, "
                         f"gone {run.seconds} s after it"}
    if run.returncode != 0:
        status, error = classify_failure(run.text())
        return {**point, "status": status, "error": error}
    try:
        return {**point, "status": "ok", **summarize()}
    except (OSError, ValueError, KeyError) as err:  # exited 0 without the metrics it should write
        return {**point, "status": "failed", "error": f"no metrics: {type(err).__name__}: {err}"}


def median_after_first(values: list[float]) -> float:
    """The median over the steps after the first (compilation, allocator warm-up); the only one if one."""
    return statistics.median(values[1:] or values)


# ------------------------------------------------------------------------------------------------
# Our trainer
# ------------------------------------------------------------------------------------------------

def train_args(config: str, folder: str, overrides: list[str], *, steps: int) -> list[str]:
    """The job's argv of one point (what `-m mop_train.train` is given)."""
    return ["--job.config_file", config, "--job.dump_folder", folder, "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--checkpoint.no-enable", "--lr_scheduler.total_steps", str(steps), *overrides]


def train_command(config: str, nproc: int, folder: str, overrides: list[str], *, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "mop_train.train", *train_args(config, folder, overrides, steps=steps)]


def config_error(config: str, nproc: int, folder: str, overrides: list[str], *, steps: int,
                 flavors: bool = True) -> str | None:
    """The point's configuration error, found in this process as `mop-train train` finds it before
    its launch (mop_train.config_checks.check_launch), or None. A point with a bad configuration used
    to be launched anyway (torchrun, every rank's imports: seconds on CPU, a minute on a big node)
    only to fail in its ranks; `flavors`: check model.flavor against the zoo (and the launch checks
    that need the model)."""
    from mop_train.config import load_job_config
    from mop_train.config_checks import check_launch
    from mop_train.models import zoo

    try:
        cfg = load_job_config(train_args(config, folder, overrides, steps=steps),
                              model_flavors=zoo.names() if flavors else None, world_size=nproc)
        if flavors:
            check_launch(cfg, nproc, zoo.get_model_args(cfg.model.flavor), source=config)
    except ValueError as err:
        return str(err)
    except SystemExit:   # torchtitan's parser (tyro) printed its own box: an unknown flag or a bad value
        return "the job's flags did not parse (torchtitan's message above): an unknown --section.key or a bad value"
    return None


def read_train_metrics(folder: str) -> dict:
    """Figures of a finished mop_train run from its metrics.jsonl (rank 0's record per step)."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise ValueError(f"{folder}/metrics.jsonl is empty")
    tflops = [r["tflops"] for r in records if r.get("tflops") is not None]
    return {"steps": len(records), "tokens_per_s": median_after_first([r["tokens_per_s"] for r in records]),
            "tflops": median_after_first(tflops) if tflops else None,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in records),
            "peak_mem_kind": records[-1].get("peak_mem_kind"), "final_loss": records[-1]["loss"]}


def run_point(config: str, nproc: int, folder: str, overrides: list[str], *, steps: int,
              timeout_s: float) -> dict:
    """One mop_train run; returns {status, seconds, steps, tokens_per_s, tflops, peak_mem_gib, ...}.
    A configuration error is a failed point without a launch."""
    error = config_error(config, nproc, folder, overrides, steps=steps)
    if error is not None:
        return {"status": "failed", "seconds": 0.0, "error": f"configuration (not launched): {error}"}
    run = launch(train_command(config, nproc, folder, overrides, steps=steps),
                 os.path.join(folder, "output.log"), timeout_s=timeout_s)
    return point_from_launch(run, lambda: read_train_metrics(folder))


# ------------------------------------------------------------------------------------------------
# Search and budget
# ------------------------------------------------------------------------------------------------

@dataclass
class Search:
    """The largest value that completes: double from `start` until a point does not complete or
    `limit` is reached (with `bracket`, go from start straight to limit), then bisect the bracket
    [largest ok, smallest not ok] until it is no wider than 1/`divisions` of its width when
    bisection began. Values stay multiples of `multiple`."""

    start: int
    limit: int
    multiple: int = 1
    divisions: int = 8
    bracket: bool = False
    ok: int | None = None
    fail: int | None = None
    fail_status: str | None = None
    stopped_by: str | None = None  # set from outside when the budget ends the search early
    _resolution: int | None = field(default=None, repr=False)

    def __post_init__(self):
        if not 1 <= self.start <= self.limit:
            raise ValueError(f"search start ({self.start}) must be in [1, limit = {self.limit}]")
        if self.start % self.multiple or self.limit % self.multiple:
            raise ValueError(f"search start ({self.start}) and limit ({self.limit}) must be multiples "
                             f"of {self.multiple}")

    def record(self, value: int, status: str) -> None:
        if status == "ok":
            self.ok = value if self.ok is None else max(self.ok, value)
        elif self.fail is None or value < self.fail:
            self.fail, self.fail_status = value, status

    def next_value(self) -> int | None:
        """The next value to run, or None when the search is over."""
        if self.stopped_by is not None:
            return None
        if self.ok is None:
            return self.start if self.fail is None else None  # the start failed: nothing below is tried
        if self.fail is None:
            if self.ok >= self.limit:
                return None
            return self.limit if self.bracket else min(self._round(self.ok * 2), self.limit)
        if self._resolution is None:
            self._resolution = max(self.multiple, (self.fail - self.ok) // self.divisions)
        mid = self._round((self.ok + self.fail) // 2)
        if self.fail - self.ok <= self._resolution or not self.ok < mid < self.fail:
            return None
        return mid

    def _round(self, value: int) -> int:
        return value // self.multiple * self.multiple

    def stop_reason(self) -> str:
        """What bounded the answer: "budget" (the budget ended it), "unfinished" (left with values
        to try), else the status of the smallest value that did not complete (oom / timeout /
        failed), else "limit"."""
        if self.stopped_by is not None:
            return self.stopped_by
        if self.next_value() is not None:
            return "unfinished"
        if self.fail is not None:
            return self.fail_status
        return "limit"

    def summary(self) -> dict:
        return {"largest_ok": self.ok, "smallest_not_ok": self.fail, "not_ok_status": self.fail_status,
                "stopped_by": self.stop_reason()}


class Clock:
    """Wall time since start against an optional global budget; a point gets what is left."""

    def __init__(self, budget_s: float | None = None, *, reserve_s: float = 0.0):
        self.start, self.budget_s, self.reserve_s = time.perf_counter(), budget_s, reserve_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def time_for_point(self, point_limit_s: float, min_s: float = 1.0) -> float | None:
        """The time limit of the next point, or None when the budget cannot give it `min_s`."""
        if self.budget_s is None:
            return point_limit_s
        left = self.budget_s - self.reserve_s - self.elapsed()
        return min(point_limit_s, left) if left >= min_s else None

    def stamp(self) -> str:
        budget = f"/{self.budget_s:.0f}" if self.budget_s is not None else ""
        return f"[{self.elapsed():7.1f}{budget} s]"


PEAK_LABELS = {"host_max_rss": "host max RSS GiB (rank 0)", "cuda_max_allocated": "peak alloc GiB (rank 0)"}
"""What the peak-memory figure of a point is, by its `peak_mem_kind` (mop_train.train.metrics)."""


def peak_label(points: list[dict]) -> str:
    """The peak column's name: the kind all measured points share, else a plain one."""
    kinds = {p.get("peak_mem_kind") for p in points if p.get("peak_mem_gib") is not None}
    return PEAK_LABELS.get(kinds.pop(), "peak GiB (rank 0)") if len(kinds) == 1 else "peak GiB (rank 0)"


def describe(point: dict, key: str | None) -> str:
    """One progress line's tail: [key=value: ]status, time and figures or error."""
    text = (f"{key}={point.get(key)}: " if key else "") + point["status"]
    if point.get("seconds") is not None:
        text += f" ({point['seconds']} s)"
    if point["status"] == "ok":
        peak = "host max RSS" if point.get("peak_mem_kind") == "host_max_rss" else "peak"
        text += f"  tokens/s {point['tokens_per_s']:,.0f}  {peak} {point['peak_mem_gib']:.2f} GiB"
    elif point.get("error"):
        text += f"  {point['error'][-160:]}"
    return text


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------

def format_table(key: str, points: list[dict], label: str | None = None) -> str:
    cols = ([label] if label else []) + [key, "status", "tokens/s", "TFLOP/s", peak_label(points), "wall s"]
    rows = []
    for p in points:
        tps = f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") is not None else "-"
        tfl = f"{p['tflops']:.1f}" if p.get("tflops") is not None else "-"
        peak = f"{p['peak_mem_gib']:.2f}" if p.get("peak_mem_gib") is not None else "-"
        rows.append(([str(p.get(label, ""))] if label else []) +
                    [str(p.get(key)), p["status"], tps, tfl, peak, str(p.get("seconds", "-"))])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "-" * (sum(widths) + 2 * len(cols))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def write_results(json_path: str, meta: dict, points: list[dict], plot=None) -> dict:
    """<stem>.json (meta + points), <stem>.csv (one row per point), and <stem>.png drawn by
    `plot(points, png_path)` when given and matplotlib imports. Returns the paths written."""
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({**meta, "points": points}, f, indent=1)
    columns = list(dict.fromkeys(k for p in points for k in p))
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(points)
    paths = {"json": stem + ".json", "csv": stem + ".csv", "png": None}
    if plot is not None and points:
        try:
            import matplotlib
        except ImportError:
            print("matplotlib is not installed: no PNG", flush=True)
            return paths
        matplotlib.use("Agg")
        plot(points, stem + ".png")
        paths["png"] = stem + ".png"
    return paths


def plot_sweep(key: str):
    """A plot function for `write_results`: tokens/s and peak memory against `key`, failures marked."""
    def plot(points: list[dict], png_path: str) -> None:
        import matplotlib.pyplot as plt

        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
        ok = sorted((p for p in points if p["status"] == "ok"), key=lambda p: p[key])
        ax_t.plot([p[key] for p in ok], [p["tokens_per_s"] for p in ok], "o-")
        ax_m.plot([p[key] for p in ok], [p["peak_mem_gib"] for p in ok], "o-")
        for p in points:
            if p["status"] not in ("ok", "skipped"):
                for ax in (ax_t, ax_m):
                    ax.axvline(p[key], color="red", alpha=0.3)
                    ax.annotate(p["status"], (p[key], 0), xycoords=("data", "axes fraction"), rotation=90)
        for ax, label in ((ax_t, "tokens/s (all ranks)"), (ax_m, peak_label(points))):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(key)
            ax.set_ylabel(label)
        fig.tight_layout()
        fig.savefig(png_path, dpi=120)
        plt.close(fig)
    return plot


# ------------------------------------------------------------------------------------------------
# The sweep scripts
# ------------------------------------------------------------------------------------------------

def common_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML job config")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per point")
    parser.add_argument("--point-timeout", "--timeout", dest="timeout", type=float, default=1800,
                        help="time limit per point, seconds from its start: then SIGTERM to its processes, "
                             f"SIGKILL {KILL_GRACE_S:g} s later; recorded as timeout with both times")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the whole sweep; points it cannot fit are recorded as skipped")
    parser.add_argument("--bisect", type=int, nargs=2, metavar=("LO", "HI"),
                        help="run LO, then HI, then bisect [largest ok, smallest not ok] to 1/8 of its width")
    parser.add_argument("--root", default="outputs/sweep", help="dump folders go under here")
    parser.add_argument("--out", default=None,
                        help="results path: <out>.json, .csv, .png (default: <root>/<name>.json)")
    parser.add_argument("--max-points", type=int, default=None,
                        help="run at most this many points in this invocation (e.g. 1: one point per device command)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the sweep recorded in --out's JSON: its points are kept and a search goes on "
                             "from them (same config and overrides required)")
    parser.add_argument("overrides", nargs="*", help="extra torchtitan-style flags after --, e.g. -- --mop.layout.seq_degree 8")
    return parser


def sweep(name: str, key: str, flags_for, args, *, values: list[int] | None = None,
          search: Search | None = None, stop_at_failure: bool = False) -> list[dict]:
    """Run every value of `values` (or until the first failure) or follow `search`; print progress
    lines and the table; write JSON + CSV + PNG."""
    if not os.path.isfile(args.config):
        raise SystemExit(f"config file not found: {args.config!r}")
    if values is not None and any(v < 1 for v in values):
        raise SystemExit(f"{key} values must be >= 1, got {values}")
    for flag, value, low in (("--nproc", args.nproc, 1), ("--steps", args.steps, 1)):
        if value < low:
            raise SystemExit(f"{flag} {value} must be >= {low}")
    if args.timeout <= 0:
        raise SystemExit(f"--point-timeout {args.timeout:g} must be > 0 (seconds per point)")
    clock = Clock(args.budget_s)
    out = args.out or os.path.join(args.root, f"{name}.json")
    meta = {"config": args.config, "nproc": args.nproc, "steps": args.steps, "overrides": args.overrides,
            "point_timeout_s": args.timeout, "budget_s": args.budget_s}
    points = resumed_points(out, key, meta, search) if getattr(args, "resume", False) else []
    done = {p[key] for p in points if p["status"] != "skipped" and not p.get("budget_cut")}
    pending = [v for v in (values or []) if v not in done]
    first = search.next_value() if search is not None else (pending[0] if pending else None)
    if first is not None:
        # The flags every point shares (a typo, a bad TOML, a layout that does not divide --nproc) fail
        # every point alike: said once, before any launch, instead of N failed points (model.flavor and
        # the model's checks are left to each point, where run_point checks them).
        error = config_error(args.config, args.nproc, os.path.join(args.root, f"{name}-{key}{first}"),
                             [*flags_for(first), *args.overrides], steps=args.steps, flavors=False)
        if error is not None:
            raise SystemExit(f"{name} sweep: the configuration of its first point ({key}={first}) is invalid, "
                             f"nothing was launched: {error}")
    max_points, ran = getattr(args, "max_points", None), 0
    while True:
        if max_points is not None and ran >= max_points:
            break
        value = search.next_value() if search is not None else (pending.pop(0) if pending else None)
        if value is None:
            break
        ran += 1
        limit = clock.time_for_point(args.timeout)
        if limit is None:
            point = {key: value, "status": "skipped", "error": "global budget spent"}
            if search is not None:
                search.stopped_by = "budget"
        else:
            folder = os.path.join(args.root, f"{name}-{key}{value}")
            point = {key: value, **run_point(args.config, args.nproc, folder, [*flags_for(value), *args.overrides],
                                            steps=args.steps, timeout_s=limit)}
            if point["status"] == "timeout" and limit < args.timeout:
                point["budget_cut"] = True  # the budget's limit, not the point's: says nothing of the value
            if search is not None:
                if point.get("budget_cut"):
                    search.stopped_by = "budget"
                else:
                    search.record(value, point["status"])
        points.append(point)
        print(f"{clock.stamp()} {describe(point, key)}", flush=True)
        write_results(out, {**meta, **({"search": search.summary()} if search else {})}, points)
        if point["status"] == "skipped" or point.get("budget_cut") or \
                (search is None and stop_at_failure and point["status"] != "ok"):
            break
    print(format_table(key, points))
    left = search.next_value() if search is not None else (pending[0] if pending else None)
    if max_points is not None and ran >= max_points and left is not None:
        print(f"stopped after {ran} point(s) (--max-points); next {key}={left}: run the same command with --resume "
              f"to go on", flush=True)
    if search is not None:
        s = search.summary()
        print(f"largest {key} that completed: {s['largest_ok']} (stopped by {s['stopped_by']}"
              + (f" at {s['smallest_not_ok']})" if s["smallest_not_ok"] else ")"))
    paths = write_results(out, {**meta, **({"search": search.summary()} if search else {})}, points,
                          plot=plot_sweep(key))
    print("results: " + ", ".join(p for p in paths.values() if p))
    return points


def resumed_points(out: str, key: str, meta: dict, search: Search | None) -> list[dict]:
    """The points of the sweep recorded at `out` (none if there is no file), replayed into `search` in
    their order, as the sweep that ran them saw them; a file of another sweep is refused."""
    if not os.path.isfile(out):
        return []
    with open(out) as f:
        saved = json.load(f)
    for field_name in ("config", "nproc", "steps", "overrides"):
        if saved.get(field_name) != meta[field_name]:
            raise SystemExit(f"--resume: {out} was written with {field_name} = {saved.get(field_name)!r}, this run "
                             f"has {meta[field_name]!r}; give the same flags or another --out")
    points = saved.get("points", [])
    for point in points:
        if search is not None and point["status"] != "skipped" and not point.get("budget_cut"):
            search.next_value()            # as the sweep asked for it: sets the bisection's resolution
            search.record(point[key], point["status"])
    return points


def search_from_args(args, *, start: int | None, limit: int, multiple: int) -> Search | None:
    """--bisect LO HI, or doubling from `start` up to `limit`; None when neither was asked for."""
    if args.bisect:
        lo, hi = args.bisect
        if not 1 <= lo < hi:
            raise SystemExit(f"--bisect LO HI needs 1 <= LO < HI, got {lo} {hi}")
        return Search(lo, hi, multiple=math.gcd(multiple, lo, hi), bracket=True)
    if start is None:
        return None
    return Search(start, max(limit, start), multiple=math.gcd(multiple, start))
