"""Re-test surviving mutants against the tests mutmut leaves out: the multi-process gloo tests
(`slow`) on CPU, the `gpu` tests on a CUDA machine.

mutmut maps a test to a function only when the test calls it in its own process, so a mutant whose
function the fast tests reach but whose consequence only shows across ranks, or on a CUDA stream,
is reported as surviving. This applies each mutant as a patch to a clean checkout, runs the test
files of its package with the chosen marker, and records killed (a test failed) or survived.

    # patches: one `git diff` per mutant, made with `mutmut apply NAME` in the mutmut checkout, and
    # an index.json of [{patch, name, bucket, mod}]; then, in a clean checkout:
    python benchmarks/mutant_retest.py --patches .mutpatch --marker slow --buckets multi-rank other --out $OUT
    python benchmarks/mutant_retest.py --patches .mutpatch --marker gpu --buckets gpu-path --out $OUT

Results: benchmarks/results/mutmut_2026-11-30.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TESTS = {
    "mop_train.ops.moe_dispatch": ["tests/ops/test_moe_dispatch.py", "tests/ops/test_moe_dispatch_chunks.py",
                                   "tests/ops/test_moe_dispatch_reference.py", "tests/ops/test_llep_plan.py",
                                   "tests/models/test_moe.py"],
    "mop_train.ops.ring_dtp": ["tests/ops/test_ring_dtp.py", "tests/ops/test_ring_dtp_calls.py",
                               "tests/ops/test_ring_dtp_mixed_precision.py"],
    "mop_train.ops.offload_adamw": ["tests/ops/test_offload_adamw.py", "tests/ops/test_offload_adamw_overlap.py",
                                    "tests/ops/test_offload_adamw_share.py"],
    "mop_train.ops.sco": ["tests/ops/test_sco.py"],
    "mop_train.layout": ["tests/test_layout.py"],
    "mop_train.parallel": ["tests/test_sharding.py", "tests/test_ulysses.py", "tests/test_precision.py",
                           "tests/train/test_layout_invariance.py"],
}
"""Module prefix -> the test files of its package (the longest matching prefix wins)."""


def tests_for(module: str) -> list[str]:
    matches = [p for p in TESTS if module == p or module.startswith(p + ".")]
    if not matches:
        raise SystemExit(f"no test files mapped for {module}: add its package to TESTS")
    return TESTS[max(matches, key=len)]


def git_apply(patch: str, reverse: bool = False) -> None:
    subprocess.run(["git", "apply", *(["-R"] if reverse else []), patch], check=True)


def retest(entry: dict, patch_dir: str, marker: str, timeout_s: float) -> dict:
    patch = os.path.join(patch_dir, entry["patch"])
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", marker,
           *tests_for(entry["mod"])]
    git_apply(patch)
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        # pytest: 0 all passed, 1 a test failed, 5 nothing selected; anything else is not a verdict
        verdict = {0: "survived", 1: "killed", 5: "no tests"}.get(run.returncode, f"error rc={run.returncode}")
        tail = run.stdout.strip().splitlines()[-1:] if run.stdout else []
    except subprocess.TimeoutExpired:
        verdict, tail = "timeout", []
    finally:
        git_apply(patch, reverse=True)
    return {**entry, "verdict": verdict, "seconds": round(time.perf_counter() - start, 1),
            "summary": tail[0] if tail else "", "command": " ".join(cmd[1:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patches", required=True, help="folder with index.json and the patches")
    ap.add_argument("--marker", required=True, help='pytest -m expression, e.g. "slow" or "gpu"')
    ap.add_argument("--buckets", nargs="+", required=True)
    ap.add_argument("--timeout-s", type=float, default=300, help="per mutant")
    ap.add_argument("--budget-s", type=float, default=3600, help="stop starting mutants after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "mutant_retest_out"))
    a = ap.parse_args(argv)
    index = [e for e in json.load(open(os.path.join(a.patches, "index.json"))) if e["bucket"] in a.buckets]
    os.makedirs(a.out, exist_ok=True)
    out_path = os.path.join(a.out, f"mutant_retest_{a.marker.replace(' ', '_')}.json")
    rows, start = [], time.perf_counter()
    for entry in index:
        if time.perf_counter() - start > a.budget_s:
            print(f"budget spent: {len(index) - len(rows)} mutants not run", flush=True)
            break
        rows.append(retest(entry, a.patches, a.marker, a.timeout_s))
        r = rows[-1]
        print(f"{r['verdict']:>9} {r['seconds']:6.1f}s {r['name']}  {r['summary']}", flush=True)
        json.dump({"marker": a.marker, "rows": rows}, open(out_path, "w"), indent=1)
    for bucket in a.buckets:
        got = [r["verdict"] for r in rows if r["bucket"] == bucket]
        print(f"{bucket}: {got.count('killed')} killed, {got.count('survived')} survived, "
              f"{len(got) - got.count('killed') - got.count('survived')} other, of {len(got)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
