"""Scale on paper: for every zoo model at W = 8, 16, 64, 256 H200s, the longest context and the largest
batch that `mop-train plan --auto` fits (README's scale table; issue 35 item 4). CPU only: a plan, not a run.

    python benchmarks/scale_table.py --out benchmarks/results/scale_table.json     # ~30 min on a 2-core CPU
    python benchmarks/scale_table.py --markdown benchmarks/results/scale_table.json  # the README table again

Per (model, W), with the model's config (configs/), 141 GiB per GPU (2 GiB kept free), 2 TiB of host
per node of min(W, 8) GPUs, batch 1 sequence per sequence group:
  - longest context: `AutoPlanner.longest_context()` (= `plan --auto --objective context`); the search
    stops at the model's max_seq_len (then the table says ">=").
  - largest batch at S = 8,192: the largest local batch B (sequences per sequence group, a power of two,
    then bisected) for which some configuration's frugal knobs fit (what the search tests first), confirmed
    by `AutoPlanner.fastest_at(8192)` (= `plan --auto --objective throughput --seq-len 8192
    --training.local_batch_size B`), whose chosen D gives the global batch B x W / D sequences.
A point measured on a GPU (benchmarks/fake_world.py) is marked in the README's last column by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIGS = {"debug": "debug_cpu.toml", "small": "small_1gpu.toml", "gpt-oss-20b-shape": "gpt_oss_20b_shape.toml",
           "mop-37b": "mop_37b.toml", "mop-120b": "mop_120b.toml", "mop-241b": "mop_241b.toml",
           "mop-667b": "mop_667b.toml"}
WORLDS = (8, 16, 64, 256)
BATCH_SEQ = 8192
GIB, TIB = 2**30, 2**40


def planner(model: str, world: int, overrides: list[str]):
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.auto import AutoPlanner, fixed_keys

    cfg = load_job_config(["--job.config_file", os.path.join(ROOT, "configs", CONFIGS[model]), *overrides],
                          model_flavors=zoo.names())
    return AutoPlanner(cfg, fixed=fixed_keys(overrides), world=world, ranks_per_node=min(world, 8),
                       gpu_bytes=141 * GIB, host_bytes=2 * TIB, headroom=2 * GIB)


def _layout(e) -> str:
    s = e.settings
    return f"D={s.seq_degree} E_p={s.expert_degree} P={s.vocab_degree}"


def longest_context(model: str, world: int) -> dict:
    from mop_train.plan.auto import NothingFits

    try:
        r = planner(model, world, ["--training.local_batch_size", "1"]).longest_context()
    except NothingFits as err:
        return {"fits": False, "why": str(err).splitlines()[0]}
    return {"fits": True, "seq_len": r.seq_len, "capped": r.stopped_by == "max_seq_len", "layout": _layout(r.chosen),
            "peak_gib": r.chosen.device / GIB}


def _fits_frugal(model: str, world: int, batch: int) -> bool:
    p = planner(model, world, ["--training.local_batch_size", str(batch)])
    return any(p.frugal(s).fits for s in p.structures(BATCH_SEQ, frugal_only=True))


def largest_batch(model: str, world: int, cap: int = 1 << 22) -> dict:
    from mop_train.plan.auto import NothingFits

    if not _fits_frugal(model, world, 1):
        return {"fits": False}
    ok, bad = 1, None
    while ok < cap:
        if not _fits_frugal(model, world, 2 * ok):
            bad = 2 * ok
            break
        ok *= 2
    while bad is not None and bad - ok > max(1, ok // 8):          # to 1/8 of B: the table's resolution
        mid = (ok + bad) // 2
        ok, bad = (mid, bad) if _fits_frugal(model, world, mid) else (ok, mid)
    while ok >= 1:
        try:
            r = planner(model, world, ["--training.local_batch_size", str(ok)]).fastest_at(BATCH_SEQ)
            break
        except NothingFits:
            ok = ok * 7 // 8 if ok > 1 else 0
    if ok < 1:
        return {"fits": False}
    D = r.chosen.settings.seq_degree
    return {"fits": True, "local_batch": ok, "global_batch": ok * world // D, "layout": _layout(r.chosen),
            "capped": bad is None, "peak_gib": r.chosen.device / GIB}


def _k(n: int) -> str:
    return f"{n // 1024:,}K" if n % 1024 == 0 else f"{n:,}"


def markdown(rows: list[dict]) -> str:
    lines = ["| model | W | longest context (batch 1) | its layout | largest batch at 8K: sequences (B per group) "
             "| its layout | measured on GPU |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c, b = r["context"], r["batch"]
        ctx = (f"{'>= ' if c['capped'] else ''}{_k(c['seq_len'])}" if c["fits"] else "nothing fits")
        bat = (f"{'>= ' if b['capped'] else ''}{b['global_batch']:,} ({b['local_batch']:,})" if b["fits"]
               else "nothing fits")
        lines.append(f"| {r['model']} | {r['world']} | {ctx} | {c.get('layout', '')} | {bat} | "
                     f"{b.get('layout', '')} | none yet |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "scale_table.json"))
    ap.add_argument("--markdown", help="print the table of an existing JSON and stop")
    ap.add_argument("--models", nargs="*", default=list(CONFIGS))
    ap.add_argument("--worlds", nargs="*", type=int, default=list(WORLDS))
    a = ap.parse_args()
    if a.markdown:
        print(markdown(json.load(open(a.markdown))["rows"]))
        return
    rows = []
    for model in a.models:
        for world in a.worlds:
            start = time.perf_counter()
            rows.append({"model": model, "world": world, "context": longest_context(model, world),
                         "batch": largest_batch(model, world), "seconds": time.perf_counter() - start})
            print(json.dumps(rows[-1]), flush=True)
            with open(a.out, "w") as f:
                json.dump({"gpu_gib": 141, "host_tib_per_node": 2, "headroom_gib": 2, "batch_seq_len": BATCH_SEQ,
                           "rows": rows}, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
