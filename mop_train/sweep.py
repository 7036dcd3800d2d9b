"""Sweep context length or batch size with real training runs and tabulate what each one did.

    python scripts/sweep_context.py --config configs/mop_37b.toml --nproc 8 --seq-lens 16384 65536 262144
    python scripts/sweep_batch.py --config configs/small_1gpu.toml --nproc 1 --seq-len 8192 --batches 1 2 4 8

Each point is one `torchrun -m mop_train.train` for a few steps in its own dump folder; the
point's figures come from that run's metrics.jsonl (median over the steps after the first:
tokens/s, TFLOP/s, peak memory). A run that dies is recorded as "oom" when its output says the
device ran out of memory, else "failed" with the last line of its error. The batch sweep stops at
the first point that does not complete; the context sweep tries every length (a failure at one
length says nothing about a shorter one with another layout). Results: a table on stdout and a
JSON list under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OOM_MARKERS = ("out of memory", "OutOfMemoryError", "CUDA error: out of memory")


def run_point(config: str, nproc: int, folder: str, overrides: list[str], *, steps: int,
              timeout_s: float) -> dict:
    """One training run; returns {status, seconds, tokens_per_s, tflops, peak_mem_gib, error}."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "mop_train.train", "--job.config_file", config, "--job.dump_folder", folder,
           "--training.steps", str(steps), "--metrics.log_freq", "1", "--checkpoint.no-enable",
           "--lr_scheduler.total_steps", str(steps), *overrides]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": timeout_s}
    point = {"seconds": round(time.perf_counter() - start, 1)}
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        # The child's own error ("mop_train.train: error: ..." or a traceback's last line), not
        # torchrun's ChildFailedError report around it.
        lines = text.splitlines()
        errors = [line for line in lines if "mop_train.train: error:" in line] or \
                 [line for line in lines if "Error" in line and "ChildFailedError" not in line] or lines[-1:]
        point["status"] = "oom" if any(m in text for m in OOM_MARKERS) else "failed"
        point["error"] = errors[-1][-300:] if errors else ""
        return point
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steady = records[1:] or records
    point.update(status="ok", steps=len(records),
                 tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                 tflops=statistics.median(r["tflops"] for r in steady) if "tflops" in steady[0] else None,
                 peak_mem_gib=max(r["peak_mem_gib"] for r in records), final_loss=records[-1]["loss"])
    return point


def format_table(key: str, points: list[dict]) -> str:
    lines = [f"{key:>10}  {'status':>7}  {'tokens/s':>10}  {'TFLOP/s':>8}  {'peak GiB':>8}  {'wall s':>7}",
             "-" * 60]
    for p in points:
        tps = f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") is not None else "-"
        tfl = f"{p['tflops']:.1f}" if p.get("tflops") is not None else "-"
        peak = f"{p['peak_mem_gib']:.2f}" if p.get("peak_mem_gib") is not None else "-"
        lines.append(f"{p[key]:>10}  {p['status']:>7}  {tps:>10}  {tfl:>8}  {peak:>8}  {p.get('seconds', '-'):>7}")
    return "\n".join(lines)


def common_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="TOML job config")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per point")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per point")
    parser.add_argument("--root", default="outputs/sweep", help="dump folders go under here")
    parser.add_argument("--out", default=None, help="JSON results file (default: <root>/<name>.json)")
    parser.add_argument("overrides", nargs="*", help="extra torchtitan-style flags after --, e.g. -- --mop.layout.seq_degree 8")
    return parser


def sweep(name: str, key: str, values: list[int], flags_for, args, *, stop_at_failure: bool) -> list[dict]:
    """Run every value (or until the first failure), print the table, write the JSON."""
    if not os.path.isfile(args.config):
        raise SystemExit(f"config file not found: {args.config!r}")
    if any(v < 1 for v in values):
        raise SystemExit(f"{key} values must be >= 1, got {values}")
    points = []
    for value in values:
        folder = os.path.join(args.root, f"{name}-{key}{value}")
        point = {key: value, **run_point(args.config, args.nproc, folder, [*flags_for(value), *args.overrides],
                                        steps=args.steps, timeout_s=args.timeout)}
        points.append(point)
        print(f"{key}={value}: {point['status']} ({point.get('seconds')} s)", flush=True)
        if stop_at_failure and point["status"] != "ok":
            break
    print(format_table(key, points))
    out = args.out or os.path.join(args.root, f"{name}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"config": args.config, "nproc": args.nproc, "steps": args.steps,
                   "overrides": args.overrides, "points": points}, f, indent=1)
    print(f"results: {out}")
    return points
