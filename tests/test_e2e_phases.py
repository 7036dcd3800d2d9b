"""The comparison's phases (benchmarks/e2e_vs_torchtitan.py, e2e_report.py) against a fake machine:
every torchtitan setting per throughput point with the fastest reported and the rest kept, memory
pruning, failed settings reported and replaced, reach and batch searches bisected to 1/8 of their
bracket whatever the other side did, budget cuts, resuming and merging across commands, the loss
curves, and one FLOP count for both sides. No torchrun: `_launch` is replaced by the fake."""

import json
import math

import pytest

from benchmarks import e2e_report as report
from benchmarks import e2e_vs_torchtitan as e2e
from benchmarks.e2e_settings import AutoSetting, TitanSetting, candidates
from mop_train.models import zoo
from mop_train.train.metrics import flops_per_token

AC_MEM, COMPILE_MEM = {"full": 1, "selective": 2, "none": 3}, {"model+loss": 1, "loss": 1.5, "off": 3}
AC_SPEED, COMPILE_SPEED = {"full": 1.0, "selective": 1.2, "none": 1.3}, {"model+loss": 1.2, "loss": 1.1, "off": 1.0}
TITAN_CAP, OURS_CAP = 100_000, 300_000  # token-memory units a run may hold
BROKEN = TitanSetting(ac="full", compile="loss").name


class FakeBench(e2e.Bench):
    """torchtitan holds tokens x AC_MEM x COMPILE_MEM <= TITAN_CAP, ours tokens <= OURS_CAP; one
    torchtitan setting (BROKEN) fails with an error; every run costs no time."""

    def __init__(self, *args, broken=(BROKEN,), **kwargs):
        super().__init__(*args, **kwargs)
        self.launched, self.broken_names = [], set(broken)

    def _launch(self, series, setting, seq_len, local_batch, steps, limit, warmup_steps, *, losses):
        self.launched.append((series, setting.name, seq_len, local_batch, steps))
        tokens = seq_len * local_batch
        if setting.name in self.broken_names:
            return {"status": "failed", "seconds": 1.0, "error": "RuntimeError: broken"}
        if series == e2e.TITAN:
            need, speed = tokens * AC_MEM[setting.ac] * COMPILE_MEM[setting.compile], AC_SPEED[setting.ac] * COMPILE_SPEED[setting.compile]
        else:
            need, speed = tokens * TITAN_CAP / OURS_CAP, 1.25
        if need > TITAN_CAP:
            return {"status": "oom", "seconds": 1.0, "error": "CUDA out of memory"}
        point = {"status": "ok", "seconds": 1.0, "steps": steps, "tokens_per_s": 1e4 * speed,
                 "peak_mem_gib": need / 1e4, "tflops": 1.0}
        if losses:
            point["losses"] = [8.0 / math.sqrt(1 + i) + (0.01 if series == e2e.TITAN else 0.0) for i in range(steps)]
        return point


def bench(tmp_path, flags, *, cls=FakeBench, points=(), **kwargs):
    args = e2e.parse_args(["--out", str(tmp_path), "--no-auto", *flags])
    return cls(args, candidates(args.nproc, 1), assets="/nowhere", titan_error=kwargs.pop("titan_error", None),
               meta={}, points=list(points), **kwargs)


def run_phases(b):
    for name in b.args.phases:
        b.phase(name)
    return b.headline()


def test_throughput_runs_every_torchtitan_setting_prunes_keeps_failures_and_reports_the_fastest(tmp_path, capsys):
    b = bench(tmp_path, ["--phases", "tps", "--tps-points", "32768x1", "4096x8"])
    h = run_phases(b)
    grid = {s.name: s for s in candidates(1, 1)["torchtitan"]["tps"]}
    first_round = b.launched[:6]
    assert [x[0] for x in first_round] == ["torchtitan", "ours-best", "ours-all"] * 2, "each series' first setting first"
    for point in ("32768x1", "4096x8"):
        titan = h["tps"][point]["torchtitan"]
        tried = {t["setting"]: t["status"] for t in titan["tried"]}
        assert set(tried) == set(grid), "every setting of the grid is accounted for"
        fits = {n: 32768 * AC_MEM[s.ac] * COMPILE_MEM[s.compile] <= TITAN_CAP for n, s in grid.items()}
        ok = [n for n in grid if fits[n] and n != BROKEN]
        assert sorted(n for n, st in tried.items() if st == "ok") == sorted(ok)
        fastest = max(ok, key=lambda n: AC_SPEED[grid[n].ac] * COMPILE_SPEED[grid[n].compile])
        assert titan["fastest"]["setting"] == fastest
        pruned = [n for n, st in tried.items() if st == "pruned"]
        assert pruned and all(not fits[n] for n in pruned), "only settings that would not fit are pruned"
        assert not any(x[1] in pruned and x[2] * x[3] == 32768 for x in b.launched), "a pruned setting is not run"
        assert tried[BROKEN] == "failed"
        assert h["tps"][point]["ours-best"]["fastest"]["tokens_per_s"] == 1.25e4
    assert sum(1 for x in b.launched if x[1] == BROKEN) == 1, "a failed setting runs once, not at the next point"
    assert "s] torchtitan" in capsys.readouterr().out, "progress lines carry the elapsed time"


def test_one_flop_count_for_both_sides(tmp_path):
    b = bench(tmp_path, ["--phases", "tps", "--tps-points", "32768x1", "--series", "torchtitan", "ours-best"])
    h = run_phases(b)
    a = zoo.get_model_args("small")
    f = flops_per_token(a, 32768, active_params=zoo.param_counts("small")["active"])
    for series in ("torchtitan", "ours-best"):
        v = h["tps"]["32768x1"][series]["fastest"]
        assert v["model_tflops"] == round(v["tokens_per_s"] * f / 1e12, 1)
        assert v["mfu_pct"] == round(100 * v["tokens_per_s"] * f / 1e12 / 790, 1)
    assert h["flop_count"]["per_token"]["32768"] == f and "causal half" in h["flop_count"]["note"]
    assert {p["series"] for p in b.points} == {"torchtitan", "ours-best"}, "--series limits the tps phase"
    table = report.format_points(b.points, model="small", peak_tflops=790)
    assert table.splitlines()[0].startswith(report.FLOP_NOTE) and "790" in table.splitlines()[0]


def check_bisected(summary, cap, width):
    assert summary["largest_ok"] <= cap < summary["smallest_not_ok"], summary
    assert summary["smallest_not_ok"] - summary["largest_ok"] <= width / 8, summary


def test_our_reach_runs_whatever_torchtitan_did_and_is_bisected(tmp_path):
    b = bench(tmp_path, ["--phases", "reach-titan", "reach-ours", "--max-seq", "1048576"],
              titan_error="ImportError: no torchtitan")
    h = run_phases(b)
    assert h["reach"]["torchtitan"]["not_ok_status"] == "failed" and h["reach"]["torchtitan"]["largest_ok"] is None
    assert not any(x[0] == "torchtitan" for x in b.launched)
    check_bisected(h["reach"]["ours-all"], OURS_CAP, 524288 - 262144)
    assert h["reach"]["ours-all"]["stopped_by"] == "oom"


def test_a_failed_reach_setting_is_reported_and_the_next_one_tried(tmp_path):
    b = bench(tmp_path, ["--phases", "reach-titan", "--reach-bracket", "torchtitan=32768:131072"])
    h = run_phases(b)
    titan = [x for x in b.launched if x[0] == "torchtitan"]
    assert titan[0][1] == BROKEN and titan[1][1] != BROKEN and titan[1][2] == 32768, "the next setting, same point"
    assert [x[2] for x in titan[1:3]] == [32768, 131072], "a bracket runs LO, then HI, then bisects"
    best = min(AC_MEM[s.ac] * COMPILE_MEM[s.compile] for s in candidates(1, 1)["torchtitan"]["reach"] if s.name != BROKEN)
    check_bisected(h["reach"]["torchtitan"], TITAN_CAP / best, 131072 - 32768)
    assert sum(1 for x in titan if x[1] == BROKEN) == 1


def test_more_reach_tries_use_the_next_setting_where_the_first_runs_out_of_memory(tmp_path):
    b = bench(tmp_path, ["--phases", "reach-titan", "--reach-tries", "2"], broken=())
    h = run_phases(b)
    at_fail = [x[1] for x in b.launched if x[2] == h["reach"]["torchtitan"]["smallest_not_ok"]]
    assert len(at_fail) == 2, at_fail


def test_batch_search_bisects_with_the_first_setting_that_works(tmp_path):
    b = bench(tmp_path, ["--phases", "batch8k", "--batch-bracket", "ours-best=4:64"])
    h = run_phases(b)
    titan = h["batch"]["torchtitan"]
    assert titan["setting"] != BROKEN and titan["seq_len"] == 8192
    first = next(s for s in candidates(1, 1)["torchtitan"]["batch"] if s.name != BROKEN)
    assert titan["setting"] == first.name
    mem = AC_MEM[first.ac] * COMPILE_MEM[first.compile]
    assert titan["largest_ok"] * 8192 * mem <= TITAN_CAP < (titan["largest_ok"] + 1) * 8192 * mem
    ours = h["batch"]["ours-best"]
    check_bisected({k: v * 8192 for k, v in ours.items() if k in ("largest_ok", "smallest_not_ok")}, OURS_CAP,
                   60 * 8192)
    assert [x[3] for x in b.launched if x[0] == "ours-best"][:2] == [4, 64]


def test_the_budget_and_torchtitan_import_errors_are_recorded(tmp_path):
    b = bench(tmp_path, ["--budget-s", "0"], titan_error="ImportError: no")
    h = run_phases(b)
    assert not b.launched
    assert {p["status"] for p in b.points if p["series"] == e2e.TITAN} == {"failed"}
    assert {p["status"] for p in b.points if p["series"] != e2e.TITAN} == {"skipped"}
    assert h["reach"]["ours-all"]["stopped_by"] == "budget"


def test_a_timeout_under_the_budgets_limit_ends_the_search_as_budget(tmp_path):
    class Slow(FakeBench):
        def _launch(self, series, setting, seq_len, local_batch, steps, limit, warmup_steps, *, losses):
            return {"status": "timeout", "seconds": limit, "error": f"killed after {limit} s"}

    b = bench(tmp_path, ["--budget-s", "100", "--point-timeout-s", "150", "--phases", "reach-ours"], cls=Slow)
    h = run_phases(b)
    assert b.points[0]["status"] == "timeout" and b.points[0]["budget_cut"]
    assert h["reach"]["ours-all"]["stopped_by"] == "budget" and h["reach"]["ours-all"]["largest_ok"] is None


def test_phases_resume_in_another_command_and_merge(tmp_path):
    first = bench(tmp_path / "a", ["--phases", "tps", "reach-titan"])
    run_phases(first)
    assert (tmp_path / "a" / "phase-tps.json").exists() and (tmp_path / "a" / "phase-reach-titan.json").exists()
    loaded = report.load_points([str(tmp_path / "a" / "e2e.json")])
    second = bench(tmp_path / "b", ["--phases", "tps", "reach-titan", "reach-ours", "loss8k"], points=loaded)
    h = run_phases(second)
    assert not any(x[0] == "torchtitan" and x[4] <= 4 for x in second.launched), "nothing already run runs again"
    assert {x[0] for x in second.launched} == {"ours-all", "torchtitan", "ours-best"}
    e2e.main(["--merge-only", "--resume", str(tmp_path / "a" / "phase-tps.json"),
              str(tmp_path / "a" / "phase-reach-titan.json"), str(tmp_path / "b" / "phase-reach-ours.json"),
              str(tmp_path / "b" / "phase-loss8k.json"), "--out", str(tmp_path / "m"), "--no-auto"])
    merged = json.loads((tmp_path / "m" / "e2e.json").read_text())["headline"]
    assert merged == json.loads(json.dumps(h)), "the figures are the points'"


def test_loss_curves_use_torchtitans_fastest_setting_and_compare_step_by_step(tmp_path):
    b = bench(tmp_path, ["--phases", "tps", "loss8k", "--tps-points", "32768x1", "--loss-steps", "60"])
    h = run_phases(b)
    loss = [x for x in b.launched if x[4] == 60]
    assert [x[0] for x in loss] == ["torchtitan", "ours-best"] and {x[2] for x in loss} == {8192}
    assert loss[0][1] == h["tps"]["32768x1"]["torchtitan"]["fastest"]["setting"]
    cmp = h["loss_curves"]["comparison"]
    assert cmp["max_running_mean_gap"] == pytest.approx(0.01) and h["loss_curves"]["torchtitan"]["steps"] == 60


class StubAuto:
    """The planner's answers without planning: fits up to 200K tokens."""

    def at(self, seq_len, local_batch):
        if seq_len * local_batch > 200_000:
            return None
        return AutoSetting(("--mop.layout.seq_degree", "1"), f"D1 S{seq_len}", 1, 1e4, 50.0)


def test_ours_auto_runs_at_each_point_and_what_it_cannot_fit_is_recorded(tmp_path):
    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "tps", "--tps-points", "32768x1", "262144x1"])
    b = FakeBench(args, candidates(1, 1), assets="/nowhere", titan_error=None, meta={}, auto=StubAuto())
    h = run_phases(b)
    auto = [p for p in b.points if p["series"] == e2e.OURS_AUTO]
    auto.sort(key=lambda p: p["seq_len"])
    assert [(p["seq_len"], p["status"]) for p in auto] == [(32768, "ok"), (32768, "ok"), (262144, "skipped")]
    assert auto[0]["flags"] == "--mop.layout.seq_degree 1" and auto[0]["predicted_tokens_per_s"] == 1e4
    # the same choice compiled, as torchtitan's grid is: the faster of the two is the series' figure
    assert auto[1]["flags"] == "--mop.layout.seq_degree 1 --compile.enable --compile.components model,loss"
    assert "plan --auto" in auto[2]["error"]
    fastest = max(auto[:2], key=lambda p: p["tokens_per_s"])["setting"]
    assert h["tps"]["32768x1"][e2e.OURS_AUTO]["fastest"]["setting"] == fastest
    assert {auto[0]["setting"], auto[1]["setting"]} == {"auto-D1S32768", "auto-D1S32768-compiled"}


def test_compiled_auto_setting_does_not_compile_ring_dtps_loss():
    plain = AutoSetting(("--mop.layout.vocab_degree", "1", "--mop.ring_dtp.no-enable"), "D1", 1, 1e4, 50.0)
    assert plain.compiled().flags()[-1] == "model,loss"
    for flags in (("--mop.ring_dtp.enable",), ("--mop.layout.vocab_degree", "2", "--mop.ring_dtp.no-enable")):
        assert AutoSetting(flags, "D1", 1, 1e4, 50.0).compiled().flags()[-3:] == (
            ["--compile.enable", "--compile.components", "model"])


@pytest.mark.parametrize("flag", [["--reach-bracket", "titan=1:2"], ["--reach-bracket", "torchtitan=9:3"],
                                  ["--tps-points", "32768"]])
def test_bad_brackets_and_points_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        e2e.parse_args(flag)
    assert "e.g." in capsys.readouterr().err


def test_ours_runs_at_torchtitans_longest_context(tmp_path):
    b = bench(tmp_path, ["--phases", "reach-titan", "tps-at-titan-max", "--reach-bracket", "torchtitan=32768:131072"])
    h = run_phases(b)
    longest = h["titan_longest_seq"]
    assert longest == h["reach"]["torchtitan"]["largest_ok"] and longest is not None
    at = h["tps_at_titan_longest"]
    assert set(at) == {"torchtitan", "ours-best", "ours-all"} and at["ours-best"]["fastest"]["tokens_per_s"] == 1.25e4
    assert {x[0] for x in b.launched if x[2] == longest and x[4] == 4} == {"ours-best", "ours-all"}
