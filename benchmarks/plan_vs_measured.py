"""The memory plan against the measured peak: train `small` a few steps at several context lengths
with operators off and on, read the device allocator's peak from metrics.jsonl, and print it beside
the plan `mop-train plan` gives for the same configuration.

    # on the GPU machine (one run per point under torchrun; JSON and logs under --out):
    python benchmarks/plan_vs_measured.py --nproc 1 --points plain-32k plain-128k ops-32k ops-128k --out $OUT
    # later, anywhere (no GPU): re-plan recorded measurements with the current planner
    python benchmarks/plan_vs_measured.py --replan benchmarks/results/plan_vs_measured_1gpu.json

The goal (issue 23): the plan's device total within 10% of the measured peak. The measured figure is
`torch.cuda.max_memory_allocated` over the run (the loop logs it as peak_mem_gib every step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/small_1gpu.toml"
ALL_OPS = ["--mop.moe.dispatch", "pipelined_llep", "--mop.ring_dtp.enable", "--mop.sco.host_budget", "8GiB",
           "--optimizer.name", "OffloadStreamAdamW"]


def _point(seq_len: int, ops: bool) -> list[str]:
    return ["--training.seq_len", str(seq_len), "--training.local_batch_size", "1", *(ALL_OPS if ops else [])]


POINTS = {f"{kind}-{s // 1024}k": _point(s, kind == "ops")
          for kind in ("plain", "ops") for s in (8192, 32768, 131072, 262144, 393216, 524288)}
"""Name -> overrides of CONFIG: "plain" is the config as shipped (local dispatch, AdamW on the device,
chunked cross-entropy, full activation checkpointing), "ops" every operator on."""

LAYOUTS = {"fsdp": [],
           "sharded": ["--mop.layout.expert_degree", "2", "--mop.layout.vocab_degree", "2", "--mop.moe.dispatch", "ep"]}
"""Layout overrides, applied before the point's: "fsdp" keeps the config's (every rank a whole
sequence, FSDP2 over all ranks), "sharded" shards the experts and the projection over 2 ranks (a
point's own dispatch wins). The default is "fsdp" on one rank and "sharded" on two."""


def planned_gib(overrides: list[str], world: int, host_bytes: int, config: str = CONFIG) -> dict:
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.terms import GIB
    from mop_train.plan.job import plan_for_config

    cfg = load_job_config(["--job.config_file", os.path.join(ROOT, config), *overrides], model_flavors=zoo.names())
    plan = plan_for_config(cfg, world=world, ranks_per_node=world, host_bytes=host_bytes)
    return {"device_gib": plan.device_bytes / GIB,
            "terms_gib": {name: b / GIB for name, b, _ in plan.device_terms}}


def train_small(name: str, overrides: list[str], *, config: str = CONFIG, nproc: int, steps: int, timeout_s: float,
                out: str) -> dict:
    """One `torchrun -m mop_train.train` of `config` + overrides, logging every step to a fresh dump
    folder and its output to out/NAME.log: {rc, wall_s, records (metrics.jsonl), command, log (its path)}."""
    dump = f"/tmp/mop_bench_runs/{name}"
    subprocess.run(["rm", "-rf", dump], check=False)
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m", "mop_train.train",
           "--job.config_file", config, "--job.dump_folder", dump, "--training.steps", str(steps),
           "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", *overrides]
    start = time.perf_counter()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    metrics = os.path.join(dump, "metrics.jsonl")
    records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    return {"rc": rc, "wall_s": time.perf_counter() - start, "records": records, "command": " ".join(cmd),
            "log": log.name}


def _out_of_memory_line(log_path: str) -> str | None:
    """The allocator's own account of an out-of-memory failure ("Tried to allocate ... of which ...
    reserved but unallocated"), which tells a real shortfall from fragmentation."""
    if not os.path.exists(log_path):
        return None
    hits = [line.strip() for line in open(log_path, errors="replace") if "Tried to allocate" in line]
    return hits[0][:600] if hits else None


def measure(name: str, overrides: list[str], *, nproc: int, steps: int, timeout_s: float, out: str) -> dict:
    run = train_small(name, overrides, nproc=nproc, steps=steps, timeout_s=timeout_s, out=out)
    records, log = run.pop("records"), run.pop("log")
    return {**run, "steps_logged": len(records), "out_of_memory": _out_of_memory_line(log),
            "measured_gib": max((r["peak_mem_gib"] for r in records), default=None),
            "tokens_per_s": records[-1]["tokens_per_s"] if records else None}


def table(rows: list[dict]) -> str:
    lines = [f"{'point':<12} {'W':>2} {'measured GiB':>13} {'planned GiB':>12} {'plan/measured':>14}"]
    for r in rows:
        m, p = r.get("measured_gib"), r["planned"]["device_gib"]
        ratio = f"{p / m:.3f}" if m else "-"
        lines.append(f"{r['point']:<12} {r['world']:>2} {m if m is None else round(m, 2)!s:>13} {p:>12.2f} {ratio:>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=1, choices=(1, 2))
    ap.add_argument("--layout", choices=sorted(LAYOUTS), help="default: fsdp on one rank, sharded on two")
    ap.add_argument("--points", nargs="+", default=["plain-32k", "plain-128k", "ops-32k", "ops-128k"],
                    choices=sorted(POINTS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--point-timeout-s", type=float, default=240)
    ap.add_argument("--budget-s", type=float, default=560, help="stop starting points after this many seconds")
    ap.add_argument("--host-bytes", type=int, default=128 * 2**30, help="per node, for SCO's \"auto\"")
    ap.add_argument("--out", default=os.environ.get("OUT", "plan_vs_measured_out"))
    ap.add_argument("--replan", metavar="JSON", help="re-plan a recorded run's points with the current planner")
    a = ap.parse_args(argv)
    if a.replan:
        rows = json.load(open(a.replan))["rows"]
        for r in rows:
            r["planned"] = planned_gib(r["overrides"], r["world"], a.host_bytes)
        print(table(rows))
        return 0
    layout = a.layout or ("fsdp" if a.nproc == 1 else "sharded")
    os.makedirs(a.out, exist_ok=True)
    rows, start = [], time.perf_counter()
    for name in a.points:
        if time.perf_counter() - start > a.budget_s:
            print(f"budget spent: {name} not run", flush=True)
            continue
        overrides = [*LAYOUTS[layout], *POINTS[name]]
        row = {"point": name, "world": a.nproc, "layout": layout, "overrides": overrides,
               "planned": planned_gib(overrides, a.nproc, a.host_bytes)}
        row.update(measure(name, overrides, nproc=a.nproc, steps=a.steps,
                           timeout_s=min(a.point_timeout_s, a.budget_s + 60 - (time.perf_counter() - start)),
                           out=a.out))
        rows.append(row)
        print(f"{name}: rc={row['rc']} measured={row['measured_gib']} planned={row['planned']['device_gib']:.2f} "
              f"GiB in {row['wall_s']:.0f}s", flush=True)
        if row["out_of_memory"]:
            print(f"  {row['out_of_memory']}", flush=True)
    with open(os.path.join(a.out, f"plan_vs_measured_{a.nproc}gpu_{layout}.json"), "w") as f:
        json.dump({"rows": rows, "argv": sys.argv, "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
