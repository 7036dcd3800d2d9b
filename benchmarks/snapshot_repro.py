"""Which CUDA memory-history setting trips the checkpointed cross-entropy, outside our loop.

On one H200 (2026-12-01) a training run with `[profiling] enable_memory_snapshot` failed in backward with
"SystemError: <built-in function cross_entropy_loss> returned NULL without setting an exception", raised
in the chunked loss's recompute (mop_train/train/loss.py, a non-reentrant checkpoint); the same run
with traces alone passed. This script runs that loss forward and backward on CUDA, each case in its own
process (a SystemError can leave the interpreter unusable), under each recording setting of
`torch.cuda.memory._record_memory_history`, with and without autocast, and prints which pass:

    python benchmarks/snapshot_repro.py [--out DIR]

Cases: "off" (no recording), "ours" (max_entries only: context "all", stacks "all", as our
RunProfiler and torchtitan's profiler call it), "python-stacks" (stacks "python"), "alloc-only"
(context "alloc", stacks "python"), "ours-no-early-stop" ("ours" with the checkpoints' early stop
off, as RunProfiler now runs while the history records). Needs CUDA; writes snapshot_repro.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "off": None,
    "ours": {"max_entries": 100_000},
    "python-stacks": {"max_entries": 100_000, "stacks": "python"},
    "alloc-only": {"max_entries": 100_000, "context": "alloc", "stacks": "python"},
    "ours-no-early-stop": {"max_entries": 100_000},   # what RunProfiler now does: checkpoint early stop off
}


def run_case(name: str, autocast: bool) -> None:
    import torch

    sys.path.insert(0, ROOT)
    from mop_train.train.loss import chunked_cross_entropy_sum

    if CASES[name] is not None:
        torch.cuda.memory._record_memory_history(**CASES[name])
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    n, h, v = 4096, 256, 32_000
    hidden = torch.randn(n, h, device="cuda", generator=gen, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    early_stop = not name.endswith("no-early-stop")
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), \
                torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            loss = chunked_cross_entropy_sum(hidden, weight, targets)
        loss.backward()
    torch.cuda.synchronize()
    if CASES[name] is not None:
        torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), help="(internal) run one case in this process")
    ap.add_argument("--autocast", action="store_true", help="(internal)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if a.case:
        run_case(a.case, a.autocast)
        return 0
    rows = []
    for name in CASES:
        for autocast in (False, True):
            cmd = [sys.executable, os.path.abspath(__file__), "--case", name] + (["--autocast"] if autocast else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            rows.append({"case": name, "autocast": autocast, "rc": proc.returncode, "last_line": last[-200:]})
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "snapshot_repro.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['case']:14s} autocast={str(r['autocast']):5s} rc={r['rc']}  {r['last_line'] if r['rc'] else 'ok'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
