"""End-to-end runs of `python -m mop_train.train` through torchrun on gloo ranks (CPU).

Launches dominate the cost (interpreter + torch + torchtitan imports), so each run is reused:
the 2-rank straight run is both a "loss falls" run and the reference of the resume check.
"""

from __future__ import annotations

import os

import pytest

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train

pytestmark = pytest.mark.slow
STEPS = 30
TINY = ["--job.config_file", DEBUG_CONFIG, "--training.local_batch_size", "2", "--training.seq_len", "64",
        "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", "--lr_scheduler.warmup_steps", "3",
        "--lr_scheduler.total_steps", str(STEPS)]


def check_loss_falls(records: list[dict]) -> None:
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_gib", "optimizer_s"):
        assert all(isinstance(r[key], float) for r in records), key
    assert all(0 < r["optimizer_s"] < r["elapsed_s"] for r in records)
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: first 5 mean {first:.3f}, last 5 mean {last:.3f}"


# The 1-rank run also switches on SCO (host budget: two of the three 32 KiB boundaries) and OffloadStreamAdamW
# with a CPU-updated share.
OPERATORS = ["--mop.sco.host_budget", "64KiB", "--optimizer.name", "OffloadStreamAdamW",
             "--mop.offload_adamw.bucket_params", "40000", "--mop.offload_adamw.host_fraction", "0.3"]


@pytest.mark.parametrize("nproc, extra", [(1, OPERATORS), (4, [])])
def test_debug_trains_and_loss_falls(tmp_path, nproc, extra):
    dump = str(tmp_path / "run")
    proc = run_train([*TINY, "--training.steps", str(STEPS), "--checkpoint.no-enable",
                      "--job.dump_folder", dump, "--debug.seed", "3", *extra], nproc=nproc)
    check_ok(proc)
    records = read_metrics(dump)
    check_loss_falls(records)
    assert "metrics.jsonl" in proc.stdout and "done:" in proc.stdout
    if extra:
        assert all(r["sco_offloaded_layers"] == 2 for r in records), records[-1]


def test_two_ranks_train_and_resume_bitwise(tmp_path):
    """30 straight steps (loss falls); then 4 steps, saved, resumed to 8: steps 5..8 bit for bit."""
    common = [*TINY, "--debug.seed", "11", "--checkpoint.enable", "--checkpoint.interval", "4",
              "--checkpoint.no-last_save_model_only"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    check_ok(run_train([*common, "--training.steps", str(STEPS), "--job.dump_folder", straight,
                        "--metrics.enable_tensorboard"], nproc=2))
    check_loss_falls(read_metrics(straight))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(straight, "tb")))
    check_ok(run_train([*common, "--training.steps", "4", "--job.dump_folder", resumed], nproc=2))
    assert os.path.isdir(os.path.join(resumed, "checkpoint", "step-4"))
    proc = run_train([*common, "--training.steps", "8", "--job.dump_folder", resumed], nproc=2)
    check_ok(proc)
    assert "resumed from step 4" in proc.stdout
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a[4:8], b[4:8]):
        for key in ("loss", "grad_norm", "lr", "tokens_seen"):
            assert ra[key] == rb[key], f"step {ra['step']}: {key} {ra[key]!r} (straight) != {rb[key]!r} (resumed)"


@pytest.mark.parametrize("override, needle", [
    (["--job.config_file", "/nonexistent/job.toml"], "/nonexistent/job.toml"),
    (["--job.config_file", DEBUG_CONFIG, "--training.dataset", "jsonl",
      "--training.dataset_path", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
])
def test_bad_paths_fail_fast_with_the_path(tmp_path, override, needle):
    proc = run_train([*override, "--job.dump_folder", str(tmp_path)], nproc=None, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mop_train.train: error:") and needle in last, last
