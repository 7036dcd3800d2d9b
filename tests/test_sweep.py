"""The sweep scripts run real training points and record what each one did; their search, budget,
failure classification and process-group kill, judged with fake runners on CPU."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from mop_train import sweep
from mop_train.sweep import Clock, Search, classify_failure, launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_search(search: Search, fits) -> list[int]:
    """Drive `search` with a fake runner: a value completes when fits(value), else it is "oom"."""
    seen = []
    while (value := search.next_value()) is not None:
        seen.append(value)
        search.record(value, "ok" if fits(value) else "oom")
    return seen


def test_search_doubles_then_bisects_to_an_eighth_of_the_bracket():
    search = Search(32768, 1 << 22, multiple=1024)
    seen = run_search(search, lambda s: s <= 100_000)
    assert seen == [32768, 65536, 131072, 98304, 114688, 106496]
    assert search.summary() == {"largest_ok": 98304, "smallest_not_ok": 106496, "not_ok_status": "oom",
                                "stopped_by": "oom"}
    assert 106496 - 98304 <= (131072 - 65536) // 8


def test_search_stops_at_its_limit_and_when_the_start_fails():
    top = Search(32768, 131072, multiple=1024)
    assert run_search(top, lambda s: True) == [32768, 65536, 131072]
    assert top.summary()["stopped_by"] == "limit" and top.ok == 131072
    low = Search(32768, 131072, multiple=1024)
    assert run_search(low, lambda s: False) == [32768]
    assert low.summary() == {"largest_ok": None, "smallest_not_ok": 32768, "not_ok_status": "oom",
                             "stopped_by": "oom"}


def test_bisect_mode_runs_lo_then_hi_then_bisects():
    search = Search(8, 16, bracket=True)
    assert run_search(search, lambda b: b <= 11) == [8, 16, 12, 10, 11]
    assert search.ok == 11 and search.fail == 12
    assert run_search(Search(8, 16, bracket=True), lambda b: True) == [8, 16]


def test_search_records_budget_and_unfinished():
    search = Search(1, 64)
    search.record(1, "ok")
    assert search.summary()["stopped_by"] == "unfinished"
    search.stopped_by = "budget"
    assert search.next_value() is None and search.summary()["stopped_by"] == "budget"
    with pytest.raises(ValueError, match="multiples of 1024"):
        Search(1000, 4096, multiple=1024)


def test_classify_failure():
    assert classify_failure("x\ntorch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB\n")[0] == "oom"
    status, error = classify_failure("Traceback\nValueError: seq_len (7) must be divisible by 2\nChildFailedError:\n")
    assert status == "failed" and "seq_len (7)" in error
    assert classify_failure("rank 1\nexitcode  : -9 (pid: 12)\nSignal 9 (SIGKILL) received\n")[0] == "oom"


TORCHRUN_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
mop_train.train FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 19467)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_ranks_traceback_is_recorded_by_its_exception_and_a_cpu_oom_is_an_oom():
    """A point whose rank died in a traceback under torchrun was recorded with torchrun's summary line
    "traceback : To enable traceback see: .../errors.html" (the last line holding "error") instead of the
    rank's exception; a CPU sweep's out-of-memory (torch's CPU allocator: "can't allocate memory", met at
    seq_len 100000 of `debug` on CPU) was "failed", not "oom"."""
    import random

    from tests.utils import fresh_seed

    rng = random.Random(fresh_seed(4100))
    n = rng.randint(10**9, 10**11)
    oom = (f"[rank0]:   File \"/x/attention.py\", line 84, in forward\n[rank0]: RuntimeError: [enforce fail at "
           f"alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate {n} bytes. "
           f"Error code 12 (Cannot allocate memory)\n" + TORCHRUN_SUMMARY)
    status, error = classify_failure(oom)
    assert status == "oom" and f"allocate {n} bytes" in error, (status, error)
    key = f"layers.{rng.randint(0, 9)}.w{rng.randint(1, 3)}"
    crash = (f"[rank1]: Traceback (most recent call last):\n[rank1]:   File \"/x/loop.py\", line 128\n"
             f"[rank1]: KeyError: '{key}'\n" + TORCHRUN_SUMMARY)
    status, error = classify_failure(crash)
    assert status == "failed" and f"KeyError: '{key}'" in error, (status, error)
    ours = f"mop_train.train: error: training.seq_len = {n} exceeds ...\n" + TORCHRUN_SUMMARY
    assert classify_failure(ours) == ("failed", ours.splitlines()[0])


def test_launch_kills_the_whole_process_group_at_its_time_limit(tmp_path, monkeypatch):
    """Stopped at its limit counted from its start; a child that ignores SIGTERM is SIGKILLed after
    the grace; the record tells the stop time from the time it was gone. The grace is 2 s here
    instead of KILL_GRACE_S = 10 s: the test waits it out, and any grace shows the two times apart."""
    monkeypatch.setattr(sweep, "KILL_GRACE_S", 2.0)
    pid_file = tmp_path / "grandchild.pid"
    # The child starts a grandchild (as torchrun starts ranks), ignores SIGTERM, and both sleep far past the limit.
    code = ("import signal, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    start = time.perf_counter()
    run = launch([sys.executable, "-c", code], str(tmp_path / "out.log"), timeout_s=3)
    assert run.returncode is None and time.perf_counter() - start < 30
    grandchild = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(grandchild, 0)
    point = sweep.point_from_launch(run, dict)
    assert point["status"] == "timeout" and 3 <= point["stopped_at_s"] < 4, point
    assert point["seconds"] >= point["stopped_at_s"] + sweep.KILL_GRACE_S - 0.5, point
    assert f"stopped (SIGTERM) {point['stopped_at_s']} s after its start, gone {point['seconds']} s" in \
        point["error"], point


def test_clock_gives_a_point_what_the_budget_has_left():
    assert Clock(None).time_for_point(100) == 100
    clock = Clock(50, reserve_s=10)
    assert 39 < clock.time_for_point(100) <= 40
    assert Clock(5, reserve_s=10).time_for_point(100, min_s=1) is None


def fake_args(tmp_path, **kw):
    config = tmp_path / "job.toml"
    config.write_text("")
    return SimpleNamespace(**{**dict(config=str(config), nproc=2, steps=2, timeout=60, budget_s=None, bisect=None,
                                     root=str(tmp_path / "runs"), out=str(tmp_path / "res.json"), overrides=[]),
                              **kw})


def test_context_sweep_records_an_oom_and_goes_on(tmp_path, monkeypatch, capsys):
    def fake_run_point(config, nproc, folder, overrides, *, steps, timeout_s):
        seq = int(overrides[overrides.index("--training.seq_len") + 1])
        if seq == 65536:
            return {"status": "oom", "seconds": 3.0, "error": "CUDA out of memory"}
        return {"status": "ok", "seconds": 5.0, "steps": steps, "tokens_per_s": 1e5 / seq * 1e3,
                "tflops": None, "peak_mem_gib": seq / 1e4, "peak_mem_kind": "host_max_rss"}

    monkeypatch.setattr(sweep, "run_point", fake_run_point)
    args = fake_args(tmp_path)
    points = sweep.sweep("context", "seq_len", lambda s: ["--training.seq_len", str(s)], args,
                         values=[32768, 65536, 131072])
    assert [p["status"] for p in points] == ["ok", "oom", "ok"], "an OOM is recorded and the sweep goes on"
    saved = json.loads((tmp_path / "res.json").read_text())
    assert [p["seq_len"] for p in saved["points"]] == [32768, 65536, 131072]
    csv_lines = (tmp_path / "res.csv").read_text().splitlines()
    assert csv_lines[0].startswith("seq_len,") and len(csv_lines) == 4
    out = capsys.readouterr().out
    assert "s] seq_len=65536: oom" in out, "progress lines carry the elapsed time"
    assert "host max RSS GiB (rank 0)" in out and "host max RSS 3.28 GiB" in out, "on CPU the peak is the RSS"
    assert sweep.peak_label([{"peak_mem_gib": 1.0, "peak_mem_kind": "cuda_max_allocated"}]) == \
        "peak alloc GiB (rank 0)"


def test_bisect_sweep_with_a_fake_runner_and_a_budget(tmp_path, monkeypatch):
    calls = []

    def fake_run_point(config, nproc, folder, overrides, *, steps, timeout_s):
        b = int(overrides[overrides.index("--training.local_batch_size") + 1])
        calls.append(b)
        ok = b <= 13
        return {"status": "ok" if ok else "oom", "seconds": 1.0, **({"tokens_per_s": 10.0 * b, "peak_mem_gib": b,
                                                                      "tflops": None, "steps": 2} if ok else {})}

    monkeypatch.setattr(sweep, "run_point", fake_run_point)
    args = fake_args(tmp_path)
    args.bisect = [8, 16]
    search = sweep.search_from_args(args, start=None, limit=4096, multiple=1)
    sweep.sweep("batch", "local_batch", lambda b: ["--training.local_batch_size", str(b)], args,
                search=search, stop_at_failure=True)
    assert calls == [8, 16, 12, 14, 13]
    assert json.loads((tmp_path / "res.json").read_text())["search"]["largest_ok"] == 13

    args = fake_args(tmp_path, )
    args.budget_s = 0.0
    points = sweep.sweep("batch", "local_batch", lambda b: ["--training.local_batch_size", str(b)], args,
                         search=Search(1, 64))
    assert points == [{"local_batch": 1, "status": "skipped", "error": "global budget spent"}]
    assert json.loads((tmp_path / "res.json").read_text())["search"]["stopped_by"] == "budget"


def test_a_search_one_point_per_command_equals_one_search(tmp_path, monkeypatch, capsys):
    """--max-points 1 --resume, run until nothing is left: the same points in the same order, the same
    answer, as one uninterrupted search; a file written with other flags is refused."""
    def fake_run_point(config, nproc, folder, overrides, *, steps, timeout_s):
        seq = int(overrides[overrides.index("--training.seq_len") + 1])
        ok = seq <= 300_000
        return {"status": "ok" if ok else "oom", "seconds": 1.0,
                **({"tokens_per_s": 1.0, "peak_mem_gib": 1.0, "tflops": None, "steps": steps} if ok else {})}

    monkeypatch.setattr(sweep, "run_point", fake_run_point)
    flags = lambda s: ["--training.seq_len", str(s)]  # noqa: E731
    whole = sweep.sweep("context", "seq_len", flags, fake_args(tmp_path, out=str(tmp_path / "whole.json")),
                        search=Search(65536, 1 << 21, multiple=1024))
    commands = 0
    while True:
        args = fake_args(tmp_path, out=str(tmp_path / "steps.json"), max_points=1, resume=True)
        before = len(json.loads((tmp_path / "steps.json").read_text())["points"]) if commands else 0
        points = sweep.sweep("context", "seq_len", flags, args, search=Search(65536, 1 << 21, multiple=1024))
        commands += 1
        if len(points) == before:
            break
        assert len(points) == before + 1
    assert [p["seq_len"] for p in points] == [p["seq_len"] for p in whole] and commands == len(whole) + 1
    saved = json.loads((tmp_path / "steps.json").read_text())["search"]
    assert saved == json.loads((tmp_path / "whole.json").read_text())["search"]
    assert "run the same command with --resume" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="overrides"):
        sweep.sweep("context", "seq_len", flags, fake_args(tmp_path, out=str(tmp_path / "steps.json"), resume=True,
                                                           overrides=["--mop.attention.keep"]),
                    search=Search(65536, 1 << 21, multiple=1024))


@pytest.mark.slow
def test_batch_sweep_records_points_and_stops_at_the_first_failure(tmp_path):
    out = tmp_path / "batch.json"
    # global_batch_size = 2 makes local batch 2 valid on one rank and local batch 4 a config error.
    cmd = [sys.executable, os.path.join(REPO, "scripts", "sweep_batch.py"), "--config",
           os.path.join(REPO, "configs", "debug_cpu.toml"), "--nproc", "1", "--steps", "2",
           "--seq-len", "32", "--batches", "4", "2", "8", "--root", str(tmp_path), "--out", str(out),
           "--point-timeout", "240", "--", "--training.global_batch_size", "2", "--metrics.no-enable-tensorboard"]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads(out.read_text())["points"]
    assert [p["local_batch"] for p in points] == [2, 4], "sorted, and stopped after the first failure"
    assert points[0]["status"] == "ok" and points[0]["steps"] == 2 and points[0]["tokens_per_s"] > 0
    assert points[1]["status"] == "failed" and "global_batch_size" in points[1]["error"]
    assert "local_batch" in proc.stdout and "results:" in proc.stdout
    assert (tmp_path / "batch.csv").is_file()


def test_results_include_the_png_the_sweeps_promise(tmp_path):
    """With the `sweep` extra installed (README's install command), write_results draws the PNG."""
    pytest.importorskip("matplotlib", reason="the `sweep` extra (pip install -e '.[sweep]') is not installed")
    points = [{"seq_len": 1024, "status": "ok", "tokens_per_s": 10.0, "peak_mem_gib": 0.5,
               "peak_mem_kind": "host_max_rss"},
              {"seq_len": 2048, "status": "oom", "error": "out of memory"}]
    paths = sweep.write_results(str(tmp_path / "res.json"), {}, points, plot=sweep.plot_sweep("seq_len"))
    assert paths["png"] and open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
