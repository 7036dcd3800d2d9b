"""torch.compile's gain on one GPU: ours (`small`, configs/small_1gpu.toml) with and without
`[compile] enable`, and torchtitan 0.2.2's own Trainer on its DeepSeek-V3 at `small`'s shape with
and without its compile, at the same shapes in the same lease (issue 34, item 4).

    python benchmarks/compile_gain.py --shapes 2x4096 --out $OUT/compile      # ~7 min on one H200
    python benchmarks/compile_gain.py --shapes 1x32768 --out $OUT/compile     # ~8 min

Every point is a real run of a few steps (torchrun, 1 rank): tokens/s is the median over the steps
after `--warmup` (the first steps compile, and recompile once for the activation-checkpoint
recompute). Both sides use full activation checkpointing, bf16 parameters and fp32 reductions, AdamW,
the embedded corpus and tokenizer; ours compiles each block (attention core and expert dispatch eager,
mop_train/parallel/compile.py) and the chunked loss, torchtitan compiles its blocks and its loss
(`--compile.components model,loss`). The gain is compiled over eager tokens/s of the same series and
shape. Prints a table last; writes <out>/compile_gain.json (every point: status, tokens/s, peak
memory, the command) after each run. `--series ours` or `--series torchtitan` runs one side only.
The CPU smoke test (`--smoke`: `debug` on gloo, aot_eager, tiny shapes) checks the logic here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.e2e_settings import TitanSetting, titan_command  # noqa: E402
from mop_train.sweep import launch, point_from_launch, train_command  # noqa: E402

SERIES = ("ours", "torchtitan")


def _records(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(folder: str, series: str, warmup: int) -> dict:
    """Median tokens/s over the steps after `warmup`, peak memory, final loss, from metrics.jsonl."""
    records = _records(folder)
    timed = [r for r in records if r["step"] > warmup] or records[-1:]
    if not timed:
        raise ValueError(f"{folder}/metrics.jsonl is empty")
    if series == "ours":
        tps = [r["tokens_per_s"] for r in timed]
        peak, loss = max(r["peak_mem_gib"] for r in records), records[-1]["loss"]
    else:
        tps = [r["throughput(tps)"] * r["world_size"] for r in timed]
        peak = max(r["memory/max_active(GiB)"] for r in records)
        loss = records[-1]["loss_metrics/global_avg_loss"]
    return {"tokens_per_s": statistics.median(tps), "steps_timed": len(timed), "peak_mem_gib": peak,
            "final_loss": loss}


def command(series: str, compiled: bool, folder: str, args, batch: int, seq: int) -> list[str]:
    if series == "ours":
        flags = ["--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
                 "--metrics.no-enable-tensorboard", "--activation_checkpoint.mode", "full"]
        flags += (["--compile.enable", "--compile.backend", args.backend] if compiled else ["--compile.no-enable"])
        return train_command(args.config, args.nproc, folder, flags + args.ours_flags, steps=args.steps)
    setting = TitanSetting(cp=1, ep=1, ac="full", compile="model+loss" if compiled else "off")
    return titan_command(args.nproc, folder, setting, flavor=args.model, seq_len=seq, local_batch=batch,
                         steps=args.steps, timeout_s=args.point_timeout_s)


def run_point(series: str, compiled: bool, batch: int, seq: int, args) -> dict:
    folder = os.path.join(os.path.abspath(args.out), "runs", f"{series}-{'compiled' if compiled else 'eager'}-"
                          f"{batch}x{seq}")
    cmd = command(series, compiled, folder, args, batch, seq)
    print(f"run {series} {'compiled' if compiled else 'eager'} {batch}x{seq}", flush=True)
    result = point_from_launch(launch(cmd, os.path.join(folder, "output.log"), timeout_s=args.point_timeout_s,
                                      cwd=REPO), lambda: summarize(folder, series, args.warmup))
    point = {"series": series, "compiled": compiled, "batch": batch, "seq_len": seq, **result,
             "command": " ".join(cmd)}
    print(f"  {point['status']} {point.get('tokens_per_s', point.get('error', ''))}", flush=True)
    return point


def gains(points: list[dict]) -> list[dict]:
    """One row per (series, shape): eager and compiled tokens/s and their ratio."""
    rows = []
    for series in SERIES:
        for batch, seq in sorted({(p["batch"], p["seq_len"]) for p in points if p["series"] == series}):
            pair = {p["compiled"]: p for p in points if (p["series"], p["batch"], p["seq_len"]) == (series, batch, seq)}
            eager, compiled = pair.get(False, {}), pair.get(True, {})
            ratio = (compiled["tokens_per_s"] / eager["tokens_per_s"]
                     if eager.get("status") == compiled.get("status") == "ok" else None)
            rows.append({"series": series, "shape": f"{batch}x{seq}", "eager_tokens_per_s": eager.get("tokens_per_s"),
                         "compiled_tokens_per_s": compiled.get("tokens_per_s"), "gain": ratio,
                         "eager_status": eager.get("status"), "compiled_status": compiled.get("status")})
    return rows


def table(rows: list[dict]) -> str:
    def num(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"{'series':<11} {'shape':>8} {'eager tok/s':>12} {'compiled tok/s':>15} {'gain':>6}  status"]
    for r in rows:
        lines.append(f"{r['series']:<11} {r['shape']:>8} {num(r['eager_tokens_per_s'], ',.0f'):>12} "
                     f"{num(r['compiled_tokens_per_s'], ',.0f'):>15} {num(r['gain'], '.3f'):>6}  "
                     f"{r['eager_status']}/{r['compiled_status']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["2x4096", "1x32768"], help="BATCHxSEQ per point")
    p.add_argument("--series", nargs="+", default=list(SERIES), choices=SERIES)
    p.add_argument("--config", default=os.path.join(REPO, "configs", "small_1gpu.toml"))
    p.add_argument("--model", default="small", help="torchtitan's DeepSeek-V3 at this zoo model's shape")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--backend", default="inductor", help="our compile.backend")
    p.add_argument("--point-timeout-s", type=float, default=240.0)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "compile_gain"))
    p.add_argument("--smoke", action="store_true", help="CPU logic check: debug, gloo, aot_eager, ours only")
    args = p.parse_args(argv)
    args.ours_flags = []
    if args.smoke:
        args.config, args.backend, args.series = os.path.join(REPO, "configs", "debug_cpu.toml"), "aot_eager", ["ours"]
        args.ours_flags = ["--training.mixed_precision_param", "float32"]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    points, start = [], time.perf_counter()
    out_json = os.path.join(args.out, "compile_gain.json")
    for batch, seq in shapes:
        for series in args.series:
            for compiled in (False, True):
                points.append(run_point(series, compiled, batch, seq, args))
                with open(out_json, "w") as f:
                    json.dump({"args": {k: v for k, v in vars(args).items()}, "points": points,
                               "gains": gains(points), "wall_s": round(time.perf_counter() - start, 1)}, f, indent=1)
    print(f"results: {out_json} ({time.perf_counter() - start:.0f} s)")
    print(table(gains(points)))


if __name__ == "__main__":
    main()
