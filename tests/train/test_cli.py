"""End-to-end runs of `python -m mop_train.train` through torchrun on gloo ranks (CPU), and the
`mop-train train` launcher's checks that stop a job before any rank starts (in process).

Launches dominate the cost (interpreter + torch + torchtitan imports), so each run is reused:
the 2-rank straight run is both a "loss falls" run and the reference of the resume check, and a
copy of its dump folder (checkpoints, metrics.jsonl, TensorBoard) is the run whose save is cut.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.train.cli import DEBUG_CONFIG, DROPOUT_ENTRY, check_ok, read_metrics, run_train

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


def check_done(proc, records: list[dict]) -> None:
    check_loss_falls(records)
    assert "metrics.jsonl" in proc.stdout and "done:" in proc.stdout


# A plain 4-rank case (all layout degrees 1) was dropped: it ran the same data-parallel path as the 2-rank
# run of test_two_ranks_train_and_resume_bitwise (FSDP over the whole world, the same check_done); 4 ranks
# add no code path there, and the 4-rank sharded layouts train in test_reliability_reshard.py.
@pytest.mark.slow
def test_debug_trains_and_loss_falls_on_one_rank_with_sco_and_offload(tmp_path):
    dump = str(tmp_path / "run")
    proc = run_train([*TINY, "--training.steps", str(STEPS), "--checkpoint.no-enable",
                      "--job.dump_folder", dump, "--debug.seed", "3", *OPERATORS], nproc=1)
    check_ok(proc)
    records = read_metrics(dump)
    check_done(proc, records)
    assert all(r["sco_offloaded_layers"] == 2 for r in records), records[-1]


def check_progress_lines(stdout: str, steps: int) -> None:
    """Every logged step prints `step N/steps  elapsed H:MM:SS  eta H:MM:SS`, the ETA 0 at the end."""
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    pattern = re.compile(rf"step +(\d+)/{steps}  elapsed (\d+):(\d\d):(\d\d)  eta (\d+):(\d\d):(\d\d)  loss ")
    matches = [pattern.match(line) for line in lines]
    assert lines and all(matches), lines[:3]
    assert [int(m.group(1)) for m in matches] == list(range(steps - len(lines) + 1, steps + 1))
    elapsed = [int(m.group(2)) * 3600 + int(m.group(3)) * 60 + int(m.group(4)) for m in matches]
    assert elapsed == sorted(elapsed) and matches[-1].group(5, 6, 7) == ("0", "00", "00"), lines[-1]


def tensorboard_steps(folder: str, tag: str = "loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(folder, "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_two_ranks_train_and_resume_bitwise(tmp_path):
    """Dropout on (tests/train/dropout_entry.py: the model draws from the RNG every step). 30 straight
    steps (checkpoints every 4, all kept): loss falls, TensorBoard events, `step N/30 elapsed eta`
    lines. A copy of that dump folder (metrics.jsonl and TensorBoard of steps 1-30, checkpoints up to
    step 8) whose step-8 save is cut short (manifest and a shard gone), resumed to 8: the cut save is
    skipped in one line naming it and step-4 and moved aside (step-8 is then the resumed run's save),
    the records of steps 5-30 move aside (metrics.jsonl and TensorBoard read as one run), and steps
    5..8 repeat the straight run bit for bit. (The copy stands in for a separate launch cut at step 8,
    whose records and saves of steps 1-8 would be the same: the same seed, schedule and steps; one
    launch fewer.)"""
    common = [*TINY, "--debug.seed", "11", "--checkpoint.enable", "--checkpoint.interval", "4",
              "--checkpoint.keep_latest_k", "0", "--checkpoint.no-last_save_model_only",
              "--metrics.enable_tensorboard"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    # 600 s: on a 2-core machine shared with other jobs the 30-step launch took longer than run_train's 180 s
    proc = run_train([*common, "--training.steps", str(STEPS), "--job.dump_folder", straight], nproc=2,
                     entry=(DROPOUT_ENTRY,), timeout=600)
    check_ok(proc)
    check_done(proc, read_metrics(straight))
    check_progress_lines(proc.stdout, STEPS)
    assert tensorboard_steps(straight) == list(range(1, STEPS + 1))
    ckpt = os.path.join(resumed, "checkpoint")
    shutil.copytree(straight, resumed, ignore=lambda folder, names: [
        n for n in names if folder == os.path.join(straight, "checkpoint") and n not in ("step-4", "step-8")])
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-8"]
    assert not os.path.exists(os.path.join(resumed, ".mop_train.lock"))   # released at the end of the run
    cut = os.path.join(ckpt, "step-8")
    os.unlink(os.path.join(cut, "manifest.json"))   # what a save killed before its commit leaves
    os.unlink(os.path.join(cut, "__1_0.distcp"))
    proc = run_train([*common, "--training.steps", "8", "--job.dump_folder", resumed], nproc=2,
                     entry=(DROPOUT_ENTRY,), timeout=600)
    check_ok(proc)
    (note,) = [line for line in proc.stdout.splitlines() if line.startswith("skipped ")]
    for part in ("step-8", "no manifest.json", os.path.join(ckpt, "incomplete-8"), os.path.join(ckpt, "step-4")):
        assert part in note, f"{part!r} missing from: {note}"
    assert "resumed from step 4" in proc.stdout
    # the cut save was moved aside whole; step-8 is now the resumed run's own, complete save
    assert "manifest.json" not in os.listdir(os.path.join(ckpt, "incomplete-8"))
    assert os.path.isfile(os.path.join(cut, "manifest.json"))
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 9)), "metrics.jsonl reads as one run"
    (aside,) = [n for n in os.listdir(resumed) if n.startswith("metrics.jsonl.superseded-")]
    assert [r["step"] for r in read_metrics(resumed, aside)] == list(range(5, STEPS + 1))
    assert tensorboard_steps(resumed) == list(range(1, 9)), "TensorBoard purged the superseded steps"
    for ra, rb in zip(a[4:8], b[4:8]):
        for key in ("loss", "grad_norm", "lr", "tokens_seen"):
            assert ra[key] == rb[key], f"step {ra['step']}: {key} {ra[key]!r} (straight) != {rb[key]!r} (resumed)"


@pytest.mark.slow
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


def launcher_flags(argv: list[str]) -> list[str]:
    from mop_train.cli import build_parser, torchrun_args

    return torchrun_args(build_parser().parse_args(["train", *argv, DEBUG_CONFIG]))


def test_train_passes_torchruns_launcher_flags_through():
    """One node alone by default; several nodes meet at --rdzv-endpoint (c10d unless told otherwise);
    torchrun's own parser takes what comes out; a multi-node launch without an endpoint is refused."""
    from torch.distributed import run as torchrun

    assert launcher_flags(["--nproc-per-node", "2"]) == ["--nproc-per-node=2", "--nnodes=1", "--standalone"]
    assert launcher_flags(["--standalone", "--nproc_per_node", "3"])[-1] == "--standalone"
    multi = launcher_flags(["--nnodes", "4", "--node-rank", "2", "--rdzv-endpoint", "node0:29400",
                            "--rdzv-id", "job7", "--nproc-per-node", "8"])
    assert multi == ["--nproc-per-node=8", "--nnodes=4", "--rdzv-endpoint=node0:29400", "--rdzv-backend=c10d",
                     "--rdzv-id=job7", "--node-rank=2"]
    parsed = torchrun.parse_args([*multi, "-m", "mop_train.train"])
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint, parsed.rdzv_backend, parsed.nproc_per_node,
            parsed.standalone) == ("4", 2, "node0:29400", "c10d", "8", False)
    for argv, needle in ((["--nnodes", "2"], "needs --rdzv-endpoint"),
                         (["--standalone", "--rdzv-endpoint", "h:1"], "alternatives"),
                         (["--node-rank", "1"], "need --rdzv-endpoint"),
                         (["--nnodes", "3:2"], "MIN:MAX")):
        with pytest.raises(ValueError, match=needle):
            launcher_flags(argv)


def cli(argv: list[str], capsys) -> tuple[int, str]:
    from mop_train.cli import main

    code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_train_refuses_before_any_rank_starts_in_its_own_words(tmp_path, capsys):
    """`mop-train train` takes its config as an argument (a missing one is said so, not as
    --job.config_file), checks the layout against nproc-per-node x nnodes naming the key and the
    flag, and its own flags after the config are put back in their place."""
    code, err = cli(["train", "--nproc-per-node", "2", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "CONFIG argument of `mop-train train`" in err and "--job.config_file" not in err, err
    code, err = cli(["train", "--nproc-per-node", "2", DEBUG_CONFIG, "--mop.layout.seq_degree", "3"], capsys)
    assert code == 2, err
    for part in (DEBUG_CONFIG, "--mop.layout.seq_degree", "mop.layout.seq_degree = 3", "world size (2 ranks)",
                 "valid: [1, 2]"):
        assert part in err, f"{part!r} missing from: {err}"
    code, err = cli(["train", "--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", DEBUG_CONFIG,
                     "--mop.layout.vocab_degree", "3"], capsys)
    assert code == 2 and "world size (4 ranks)" in err and "valid: [1, 2, 4]" in err, err
    code, err = cli(["train", DEBUG_CONFIG, "--nproc-per-node", "2"], capsys)
    assert code == 2 and "put it before the config file" in err, err


def test_config_names_the_layout_key_against_the_world():
    """The ranks' own check (under plain torchrun: WORLD_SIZE): key, value, where it was set, valid values."""
    from mop_train.config import load_job_config

    with pytest.raises(ValueError) as info:
        load_job_config(["--job.config_file", DEBUG_CONFIG, "--mop.layout.vocab_degree", "4"], world_size=6)
    for part in ("--mop.layout.vocab_degree", "mop.layout.vocab_degree = 4", "valid: [1, 2, 3, 6]",
                 "[mop.layout] vocab_degree"):
        assert part in str(info.value), str(info.value)
    assert load_job_config(["--job.config_file", DEBUG_CONFIG], world_size=3).mop.layout.seq_degree == 1
