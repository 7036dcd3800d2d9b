"""Re-test mutmut's survivors with the tests mutmut cannot follow: the gloo ranks (`slow`) and CUDA (`gpu`).

mutmut 3 writes every mutant into one copy of the source (`mutants/`), behind a trampoline that calls the
mutant named by the MUTANT_UNDER_TEST environment variable. A rank started by torch.multiprocessing or
torchrun inherits the variable, so a mutant is live in every rank; but mutmut maps a test to a function only
when the test calls it in the pytest process, and it runs only the tests it mapped. Code that runs inside
ranks is therefore reported "survived" or "no tests" although a multi-rank test would kill it.

Two steps, run from the folder where `mutmut run` ran (it holds `mutants/`):

    # 1. every test of the marker once, with a hook that records in every process (ranks included) which
    #    mutated functions it entered: {function: [test ids]}, and which tests failed unmutated
    python tools/mutants_in_ranks.py map --marker "slow and not gpu" --jobs 16 --out map_slow.json
    # 2. each survivor (and each mutant without a test) against the tests that reach its function
    python tools/mutants_in_ranks.py run --map map_slow.json --jobs 12 --budget-s 500 --out run_slow.json

`run` skips mutants already in --out, so a second call resumes. A verdict is "killed" only when pytest
reports a failed test (exit code 1); the failing test is recorded. Results: tools/results/mutmut_*.md.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

# Imported at start-up by every Python process whose PYTHONPATH holds its folder: with MUTANT_UNDER_TEST=stats
# the trampoline reports each mutated function it enters; this appends the first report per function to a
# file named by the process id, so ranks that leave with os._exit still leave their record.
_HOOK = '''
import os
if os.environ.get("MOP_MUTANT_HITS"):
    import mutmut.mutation.trampoline as _trampoline
    _seen = set()
    _path = os.path.join(os.environ["MOP_MUTANT_HITS"], f"{os.getpid()}.txt")
    def _record(name, caller=None):
        if name not in _seen:
            _seen.add(name)
            with open(_path, "a") as f:
                f.write(name + "\\n")
    _trampoline.record_trampoline_hit = _record
'''

SURVIVED, NO_TESTS = 0, (5, 33)   # mutmut's exit codes in its .meta files


def _tally(values: list[str]) -> str:
    """"killed 12, survived 3" (most common first)."""
    return ", ".join(f"{v} {n}" for v, n in collections.Counter(values).most_common())


def function_of(mutant: str) -> str:
    """mutmut's mutant name -> the key its trampoline reports: `pkg.mod.x_fn__mutmut_7` -> `pkg.mod.x_fn`."""
    return re.sub(r"__mutmut_\d+$", "", mutant)


def mutant_status(mutants_dir: str) -> dict[str, int | None]:
    status: dict[str, int | None] = {}
    for meta in glob.glob(os.path.join(mutants_dir, "**", "*.py.meta"), recursive=True):
        with open(meta) as f:
            status.update(json.load(f)["exit_code_by_key"])
    if not status:
        raise SystemExit(f"no mutmut results under {mutants_dir}/: run `mutmut run` first")
    return status


def _env(mutants_dir: str, hook_dir: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # the mutated copy first, for the pytest process, spawned ranks and torchrun children alike
    env["PYTHONPATH"] = os.pathsep.join([hook_dir, os.path.abspath(mutants_dir), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _pytest(args: list[str], cwd: str, env: dict[str, str], timeout_s: float) -> tuple[int | str, str]:
    """Run pytest in its own session; on timeout the whole group (ranks too) is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", out


def _failed_tests(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


def collect(mutants_dir: str, marker: str, keyword: str, paths: list[str], env: dict[str, str]) -> list[str]:
    rc, out = _pytest(["--collect-only", "-m", marker, *(["-k", keyword] if keyword else []), *paths], mutants_dir,
                      env, 600)
    ids = [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(("FAILED", "ERROR"))]
    if rc not in (0, 5) or not ids:
        raise SystemExit(f"collecting `{marker}` tests in {mutants_dir}/ failed (rc={rc}):\n{out[-3000:]}")
    return ids


def cmd_map(a: argparse.Namespace, hook_dir: str) -> int:
    env = _env(a.mutants, hook_dir)
    tests = collect(a.mutants, a.marker, a.keyword, a.paths, env)
    print(f"{len(tests)} `{a.marker}` tests; recording the mutated functions each enters ({a.jobs} at a time)",
          flush=True)
    hits_root = tempfile.mkdtemp(prefix="mutant_hits_")

    def one(i_test: tuple[int, str]) -> dict:
        i, test = i_test
        hits = os.path.join(hits_root, str(i))
        os.makedirs(hits)
        start = time.perf_counter()
        rc, out = _pytest([test], a.mutants, {**env, "MUTANT_UNDER_TEST": "stats", "MOP_MUTANT_HITS": hits},
                          a.timeout_s)
        if rc == 0 and " passed" not in out.strip().splitlines()[-1]:
            rc = "skipped"   # it judges nothing (e.g. an nccl-2 test on one GPU)
        functions = set()
        for path in glob.glob(os.path.join(hits, "*.txt")):
            with open(path) as f:
                functions.update(line.strip() for line in f if line.strip())
        return {"test": test, "rc": rc, "seconds": round(time.perf_counter() - start, 1),
                "functions": sorted(functions), "tail": out.strip().splitlines()[-1:] if rc != 0 else []}

    rows: list[dict] = []

    def save() -> list[dict]:
        """Written after every test, so a map cut short by a time limit still holds what it saw."""
        broken = [r for r in rows if r["rc"] != 0]   # a test that fails unmutated cannot judge a mutant
        by_function: dict[str, list[str]] = {}
        for r in rows:
            if r["rc"] == 0:
                for fn in r["functions"]:
                    by_function.setdefault(fn, []).append(r["test"])
        with open(a.out, "w") as f:
            json.dump({"marker": a.marker, "tests": {r["test"]: r["seconds"] for r in rows if r["rc"] == 0},
                       "broken": {r["test"]: [str(r["rc"]), *r["tail"]] for r in broken},
                       "not_mapped": sorted(set(tests) - {r["test"] for r in rows}),
                       "by_function": by_function}, f, indent=1)
        return broken

    with cf.ThreadPoolExecutor(a.jobs) as pool:
        for row in pool.map(one, enumerate(tests)):
            rows.append(row)
            print(f"{str(row['rc']):>7} {row['seconds']:6.1f}s {len(row['functions']):4d} functions  {row['test']}",
                  flush=True)
            save()
    broken = save()
    print(f"{len(rows) - len(broken)} tests mapped; "
          f"{len(broken)} failed or were skipped unmutated: {[r['test'] for r in broken]}", flush=True)
    return 1 if broken and a.strict else 0


def cmd_run(a: argparse.Namespace, hook_dir: str) -> int:
    with open(a.map) as f:
        mapping = json.load(f)
    status = mutant_status(a.mutants)
    wanted = {m for m, code in status.items() if code == SURVIVED or code in NO_TESTS}
    if a.names:
        with open(a.names) as f:
            wanted &= {line.strip() for line in f if line.strip()}
    done: dict[str, dict] = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            done = {r["mutant"]: r for r in json.load(f)["rows"]}

    def tests_of(m: str) -> list[str]:
        """The tests that reach m's function, fastest first (-x stops at the first failure), within --cap-s."""
        reaching = sorted((t for t in mapping["by_function"].get(function_of(m), [])
                           if not t.startswith(tuple(a.exclude))), key=lambda t: (mapping["tests"][t], t))
        chosen, seconds = [], 0.0
        for t in reaching:
            if chosen and seconds + mapping["tests"][t] > a.cap_s:
                break
            chosen.append(t)
            seconds += mapping["tests"][t]
        return chosen

    def cost(m: str) -> float:
        return sum(mapping["tests"][t] for t in tests_of(m))

    todo = sorted((m for m in wanted if m not in done), key=lambda m: (cost(m), m))
    unreached = [m for m in todo if not tests_of(m)]
    for m in unreached:
        verdict = "only excluded tests reach it" if mapping["by_function"].get(function_of(m)) else "no test reaches it"
        done[m] = {"mutant": m, "verdict": verdict, "tests": 0, "seconds": 0.0, "killed_by": []}
    todo = [m for m in todo if m not in done]
    print(f"{len(wanted)} survivors/no-test mutants; {len(done)} already judged or unreached; {len(todo)} to run "
          f"against `{mapping['marker']}` tests ({a.jobs} at a time, budget {a.budget_s:.0f} s)", flush=True)
    env = _env(a.mutants, hook_dir)
    start = time.perf_counter()

    def one(m: str) -> dict | None:
        if time.perf_counter() - start > a.budget_s:
            return None
        tests = tests_of(m)
        t0 = time.perf_counter()
        rc, out = _pytest(["-x", *tests], a.mutants, {**env, "MUTANT_UNDER_TEST": m}, a.timeout_s)
        verdict = {0: "survived", 1: "killed"}.get(rc, "timeout" if rc == "timeout" else f"error rc={rc}")
        reaching = len(mapping["by_function"][function_of(m)])
        # "survived" means survived `ran`: with --cap-s that can be fewer than the tests reaching the function
        return {"mutant": m, "verdict": verdict, "tests": len(tests), "tests_reaching": reaching,
                "ran": tests, "seconds": round(time.perf_counter() - t0, 1),
                "killed_by": _failed_tests(out)[:3], "tail": out.strip().splitlines()[-1:]}

    def save() -> None:
        with open(a.out, "w") as f:
            json.dump({"marker": mapping["marker"], "rows": sorted(done.values(), key=lambda r: r["mutant"])}, f,
                      indent=1)

    with cf.ThreadPoolExecutor(a.jobs) as pool:
        for row in pool.map(one, todo):
            if row is None:
                continue
            done[row["mutant"]] = row
            print(f"{row['verdict']:>9} {row['seconds']:6.1f}s {row['tests']:3d} tests  {row['mutant']}  "
                  f"{' '.join(row['killed_by'][:1])}", flush=True)
            save()
    save()
    verdicts = [r["verdict"] for r in done.values()]
    left = len(todo) - sum(1 for m in todo if m in done)
    print("verdicts: " + _tally(verdicts)
          + (f"; {left} not run (budget)" if left else ""), flush=True)
    return 0


KILLED_BY_READER = ("killed-new-test", "killed-existing-test")


def cmd_ledger(a: argparse.Namespace) -> int:
    """One line per mutant the fast tests did not kill: every verdict it got, and the final one."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    status = mutant_status(a.mutants)
    runs: dict[str, dict[str, dict]] = {}
    survived_checks = set()   # survivors of runs made with the readers' new tests: they refute kill claims
    for path in a.runs + a.checking:
        with open(path) as f:
            run = json.load(f)
        runs.setdefault(run["marker"], {}).update({r["mutant"]: r for r in run["rows"]})   # later files win
        if path in a.checking:
            survived_checks |= {r["mutant"] for r in run["rows"] if r["verdict"] == "survived"}
    judged: dict[str, tuple[str, str]] = {}
    for path in a.judged:
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                if line.strip():
                    name, verdict, *reason = line.split("\t")
                    if verdict.strip() != "not-read" or name.strip() not in judged:   # a reading beats none
                        judged[name.strip()] = (verdict.strip(), " ".join(reason).strip())
    rows, contradicted = [], []
    for m, code in sorted(status.items()):
        if not (code == SURVIVED or code in NO_TESTS):
            continue
        machine = {marker: by[m] for marker, by in runs.items() if m in by}
        killed = [f"killed by {r['killed_by'][0] if r['killed_by'] else marker}"
                  for marker, r in machine.items() if r["verdict"] == "killed"]
        # a time-out on a loaded machine is not proof of a hang: it stays a time-out unless a reader judged it
        timed_out = [marker for marker, r in machine.items() if r["verdict"] == "timeout"]
        verdict, reason = judged.get(m, ("", ""))
        if killed:
            final = "killed (rank/gpu tests)"
            killed_off_gpu = any(r["verdict"] == "killed" and "gpu" not in marker.replace("not gpu", "")
                                 and "interpreter" not in marker for marker, r in machine.items())
            # "cpu-equivalent" predicts a kill by a GPU test (or Triton's interpreter of the GPU path), only there
            if verdict in ("equivalent", "text") or (verdict == "cpu-equivalent" and killed_off_gpu):
                contradicted.append(f"{m}: read as {verdict}, but {killed[0]}")
        elif verdict in KILLED_BY_READER and m in survived_checks:
            final = "weakness (kill claim refuted)"
            contradicted.append(f"{m}: read as {verdict} ({reason[:80]}), but it survived the tests that reach it")
        elif verdict in KILLED_BY_READER:
            final = "killed (read, test named)"
        elif verdict and verdict != "not-read":
            final = verdict
        elif timed_out:
            final = "timeout"
        else:
            final = "unjudged"
        added = [line[1:].strip() for line in get_diff_for_mutant(m).splitlines()
                 if line.startswith("+") and not line.startswith("+++")]
        rows.append([m, "survived" if code == SURVIVED else "no tests",
                     "; ".join(f"{marker}: {r['verdict']}" for marker, r in machine.items()) or "not run",
                     killed[0] if killed else reason, verdict, final, (added[0] if added else "")[:100]])
    with open(a.out, "w") as f:
        f.write("mutant\tfast tests\trank/gpu tests\tevidence\treader\tfinal\tmutated line\n")
        f.writelines("\t".join(c.replace("\t", " ") for c in row) + "\n" for row in rows)
    finals = [r[5] for r in rows]
    for line in contradicted:   # a reading the tests refuted: the reader's other verdicts deserve a second look
        print("contradicted:", line)
    print(f"{len(rows)} mutants not killed by the fast tests: "
          + _tally(finals))
    return 0


def cmd_verify(a: argparse.Namespace, hook_dir: str) -> int:
    """Re-run a seeded sample of the readers' "killed" claims: the test named in the reason, with the mutant live."""
    import random

    claims = []
    for path in a.judged:
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                name, verdict, *reason = line.split("\t")
                if verdict.strip() in KILLED_BY_READER:
                    claims.append((name.strip(), " ".join(reason)))
    sample = random.Random(a.seed).sample(claims, min(a.sample, len(claims)))
    env = _env(a.mutants, hook_dir)

    # readers name tests loosely ("test_x", "test_file.py::test_x[gloo-2]"): resolve each to its file
    defined: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(a.mutants, "tests", "**", "test_*.py"), recursive=True):
        with open(path) as f:
            for test in re.findall(r"^def (test_\w+)", f.read(), flags=re.M):
                defined.setdefault(test, []).append(os.path.relpath(path, a.mutants))

    def named_tests(reason: str) -> list[str]:
        ids = []
        for file, test, params in re.findall(r"(?:([\w/]+\.py)::)?(test_\w+)(\[[\w\-.,]+\])?", reason):
            where = [p for p in defined.get(test, []) if not file or p.endswith(file)]
            if len(where) == 1 and f"{where[0]}::{test}{params}" not in ids:
                ids.append(f"{where[0]}::{test}{params}")
        return ids[:2]

    def one(claim: tuple[str, str]) -> dict:
        name, reason = claim
        tests = named_tests(reason)
        if not tests:
            return {"mutant": name, "verdict": "no test named", "reason": reason}
        rc, out = _pytest(["-x", *tests], a.mutants, {**env, "MUTANT_UNDER_TEST": name}, a.timeout_s)
        verdict = {1: "confirmed", 0: "NOT killed"}.get(rc, "timeout" if rc == "timeout" else f"error rc={rc}")
        return {"mutant": name, "verdict": verdict, "tests": tests, "killed_by": _failed_tests(out)[:2],
                "tail": out.strip().splitlines()[-1:]}

    with cf.ThreadPoolExecutor(a.jobs) as pool:
        rows = []
        for row in pool.map(one, sample):
            rows.append(row)
            print(f"{row['verdict']:>12}  {row['mutant']}  {' '.join(row.get('tests', []))[:120]}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"claims": len(claims), "sampled": len(rows), "seed": a.seed, "rows": rows}, f, indent=1)
    verdicts = [r["verdict"] for r in rows]
    print(f"{len(claims)} kill claims, {len(rows)} re-run: "
          + _tally(verdicts), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    m = sub.add_parser("map", help="record which mutated functions each test of a marker enters")
    m.add_argument("--marker", required=True, help='pytest -m expression, e.g. "slow and not gpu" or "gpu"')
    m.add_argument("-k", "--keyword", default="",
                   help='pytest -k expression, e.g. "not nccl" on one GPU: a test that skips would judge nothing')
    m.add_argument("--paths", nargs="+", default=["tests"], help="test paths inside mutants/")
    m.add_argument("--strict", action="store_true", help="exit 1 when a test fails unmutated")
    r = sub.add_parser("run", help="run each survivor against the tests that reach its function")
    r.add_argument("--map", required=True, help="the JSON written by `map`")
    r.add_argument("--names", help="a file of mutant names to restrict to (one per line)")
    r.add_argument("--exclude", nargs="*", default=[], help="test id prefixes not to run (e.g. tests/train)")
    r.add_argument("--cap-s", type=float, default=float("inf"),
                   help="per mutant, run the fastest reaching tests until their mapped seconds pass this")
    r.add_argument("--budget-s", type=float, default=3600, help="start no mutant after this many seconds")
    g = sub.add_parser("ledger", help="merge the runs and the readers' verdicts into one line per mutant")
    g.add_argument("--runs", nargs="*", default=[], help="JSON files written by `run`")
    g.add_argument("--checking", nargs="*", default=[],
                   help="JSON files written by `run` after the readers' tests landed (read after --runs): a "
                        "survivor there refutes a kill claim")
    g.add_argument("--judged", nargs="*", default=[], help="TSV files `mutant<TAB>verdict<TAB>reason` from reading")
    v = sub.add_parser("verify", help="re-run a seeded sample of the readers' kill claims with the mutant live")
    v.add_argument("--judged", nargs="+", required=True)
    v.add_argument("--sample", type=int, default=40)
    v.add_argument("--seed", type=int, default=20261201)
    for p in (m, r, g, v):
        p.add_argument("--mutants", default="mutants", help="mutmut's folder of mutated source")
        p.add_argument("--out", required=True)
    for p in (m, r, v):
        p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
        p.add_argument("--timeout-s", type=float, default=600, help="per test run")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.mutants):
        raise SystemExit(f"--mutants {a.mutants!r} is not a folder: run `mutmut run` here first")
    if a.step == "ledger":
        return cmd_ledger(a)
    with tempfile.TemporaryDirectory(prefix="mutant_hook_") as hook_dir:
        with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
            f.write(_HOOK)
        return {"map": cmd_map, "run": cmd_run, "verify": cmd_verify}[a.step](a, hook_dir)


if __name__ == "__main__":
    raise SystemExit(main())
