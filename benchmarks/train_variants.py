"""`small` trained a few steps under several option sets, side by side in one run on one machine:
tokens/s (median of the logged steps after the warm-up), step time, exposed optimizer time, peak
memory, the plan's device total and the loss of the last step.

    python benchmarks/train_variants.py --variants plain streamed streamed-overlap auto-overlap all-auto \
        --steps 8 --warmup 3 --out $OUT        # one H200: issue 20's goals at B=2 x 4K
    python benchmarks/train_variants.py --variants all all-bf16 all-gstream all-bf16-gstream all-stream \
        --base all --steps 6 --warmup 2 --out $OUT   # issue 32: weights / gradients at B=2 x 4K (bitwise column)

A variant is a list of overrides of configs/small_1gpu.toml (or --config; see VARIANTS); every run is a plain
`torchrun -m mop_train.train`, so this measures what users run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from plan_vs_measured import ALL_OPS, CONFIG, planned_gib, train_small  # noqa: E402

OFFLOAD = ["--optimizer.name", "OffloadStreamAdamW"]
VARIANTS = {
    "plain": [],
    "streamed": OFFLOAD,
    "streamed-overlap": [*OFFLOAD, "--mop.offload_adamw.overlap"],
    "auto": [*OFFLOAD, "--mop.offload_adamw.device_fraction", "auto"],
    "auto-overlap": [*OFFLOAD, "--mop.offload_adamw.device_fraction", "auto", "--mop.offload_adamw.overlap"],
    "all": ALL_OPS,
    "all-auto": [*ALL_OPS, "--mop.offload_adamw.device_fraction", "auto", "--mop.offload_adamw.overlap"],
    "accum4-plain": ["--training.global_batch_size", "8"],
    "accum4-streamed": ["--training.global_batch_size", "8", *OFFLOAD],
    # issue 32: the model's own weights and gradients, every operator on ("all" is device/device)
    "all-bf16": [*ALL_OPS, "--mop.offload_adamw.weights", "bf16"],
    "all-gstream": [*ALL_OPS, "--mop.offload_adamw.gradients", "stream"],
    "all-bf16-gstream": [*ALL_OPS, "--mop.offload_adamw.weights", "bf16", "--mop.offload_adamw.gradients", "stream"],
    "all-stream": [*ALL_OPS, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients", "stream"],
}
"""Name -> overrides of CONFIG (B=2 x 4K unless --shape says otherwise)."""


def run_variant(name: str, overrides: list[str], *, config: str, nproc: int, steps: int, warmup: int,
                timeout_s: float, out: str) -> dict:
    run = train_small(name, overrides, config=config, nproc=nproc, steps=steps, timeout_s=timeout_s, out=out)
    records, rc = run["records"], run["rc"]
    timed = [r for r in records if r["step"] > warmup]
    row = {"variant": name, "overrides": overrides, "rc": rc, "wall_s": run["wall_s"],
           "steps_logged": len(records), "command": run["command"]}
    row["losses"] = [r["loss"] for r in records]
    if timed:
        tps = statistics.median(r["tokens_per_s"] for r in timed)
        exposed = [r["optimizer_exposed_s"] for r in timed if r.get("optimizer_exposed_s") is not None]
        row.update(tokens_per_s=tps, step_s=statistics.median(r["elapsed_s"] for r in timed),
                   optimizer_s=statistics.median(r["optimizer_s"] for r in timed if r.get("optimizer_s") is not None)
                   if any(r.get("optimizer_s") is not None for r in timed) else None,
                   optimizer_exposed_s=statistics.median(exposed) if exposed else None,
                   peak_gib=max(r["peak_mem_gib"] for r in records), last_loss=records[-1]["loss"])
    return row


def table(rows: list[dict], base_name: str = "plain") -> str:
    """One line per variant; `x base` and `bitwise` (every logged loss equal to the base's, bit for
    bit) against the variant `base_name`; `plan P+G` is the plan's parameters + gradients lines."""
    base = next((r for r in rows if r["variant"] == base_name and r.get("step_s")), None)
    lines = [f"{'variant':<18} {'rc':>4} {'tok/s':>9} {'step s':>7} {'x ' + base_name:>9} {'opt s':>6} {'exposed':>8} "
             f"{'peak GiB':>9} {'plan GiB':>9} {'plan P+G':>9} {'loss':>8} {'bitwise':>8}"]
    for r in rows:
        if not r.get("step_s"):
            lines.append(f"{r['variant']:<18} {r['rc']!s:>4}  (no timed steps)")
            continue
        rel = f"{r['step_s'] / base['step_s']:.3f}" if base else "-"
        f = (lambda v: "-" if v is None else f"{v:.3f}")
        terms = r["planned"]["terms_gib"]
        same = "-" if base is None else ("yes" if r["losses"] == base["losses"] else "NO")
        lines.append(f"{r['variant']:<18} {r['rc']!s:>4} {r['tokens_per_s']:>9,.0f} {r['step_s']:>7.3f} {rel:>9} "
                     f"{f(r['optimizer_s']):>6} {f(r['optimizer_exposed_s']):>8} {r['peak_gib']:>9.2f} "
                     f"{r['planned']['device_gib']:>9.2f} {terms['parameters'] + terms['gradients']:>9.2f} "
                     f"{r['last_loss']:>8.4f} {same:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["plain", "streamed", "auto-overlap", "all-auto"],
                    choices=sorted(VARIANTS))
    ap.add_argument("--shape", default="2x4096", help="BxS per rank, e.g. 1x32768")
    ap.add_argument("--config", default=CONFIG, help="the base TOML (a CPU smoke: configs/debug_cpu.toml)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="logged steps left out of the medians")
    ap.add_argument("--point-timeout-s", type=float, default=180)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--out", default=os.environ.get("OUT", "train_variants_out"))
    ap.add_argument("--base", default="plain", help="the variant the x-column and the bitwise check compare with")
    a = ap.parse_args(argv)
    if a.warmup >= a.steps:
        ap.error(f"--warmup ({a.warmup}) must be below --steps ({a.steps}) to leave timed steps")
    batch, seq = (int(v) for v in a.shape.split("x"))
    shape = ["--training.local_batch_size", str(batch), "--training.seq_len", str(seq)]
    os.makedirs(a.out, exist_ok=True)
    rows, start = [], time.perf_counter()
    for name in a.variants:
        left = a.budget_s - (time.perf_counter() - start)
        if left < 30:
            print(f"budget spent: {name} not run", flush=True)
            continue
        overrides = [*shape, *VARIANTS[name]]
        row = run_variant(name, overrides, config=a.config, nproc=a.nproc, steps=a.steps, warmup=a.warmup,
                          timeout_s=min(a.point_timeout_s, left), out=a.out)
        row["planned"] = planned_gib(overrides, a.nproc, 128 * 2**30, config=a.config)
        rows.append(row)
        print(f"{name}: rc={row['rc']} {row.get('tokens_per_s', 0):,.0f} tok/s in {row['wall_s']:.0f}s", flush=True)
    with open(os.path.join(a.out, "train_variants.json"), "w") as f:
        json.dump({"rows": rows, "argv": sys.argv, "shape": a.shape, "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(table(rows, a.base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
