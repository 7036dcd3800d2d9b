"""Faults injected into real launches (2 gloo ranks on CPU, the `mop-train train` launcher or torchrun).

Each launch checks several things to keep the CPU time down: non-finite steps (skip, then stop)
with checkpoints at every step; a damaged checkpoint refused, then the older one taken; a run
extended past its LR schedule (on an install without triton) and stopped by SIGTERM; a second job
on a held dump folder and the launcher SIGKILLed; a hung collective (launched with torchrun's
rendezvous flags passed through); a configuration error under torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.train.cli import DEBUG_CONFIG, REPO, check_ok, read_metrics, run_train

pytestmark = pytest.mark.slow
TINY = ["--training.local_batch_size", "2", "--training.seq_len", "64", "--metrics.log_freq", "1",
        "--metrics.no-enable_tensorboard", "--lr_scheduler.warmup_steps", "2", "--debug.seed", "5",
        "--checkpoint.enable", "--checkpoint.no-last_save_model_only"]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", **extra}


def without_triton(tmp_path) -> dict:
    """The environment of an install without triton: a sitecustomize (first on PYTHONPATH, so every
    rank runs it too) makes `import triton` fail and find_spec("triton") return None."""
    blocker = tmp_path / "no_triton"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["triton"] = None\n')
    env = _env()
    env["PYTHONPATH"] = str(blocker) + os.pathsep + env["PYTHONPATH"]
    return env


def mop_train(args: list[str], *, env: dict | None = None, timeout: float = 300, background: bool = False,
              launcher: tuple[str, ...] = ("--standalone",)):
    """`mop-train train LAUNCHER --nproc-per-node 2 configs/debug_cpu.toml ARGS`."""
    cmd = [sys.executable, "-m", "mop_train.cli", "train", *launcher, "--nproc-per-node", "2", DEBUG_CONFIG, *TINY,
           *args]
    if background:
        return subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error:" in line]


def checkpoint_tensors(folder: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder + ".pt"
    dcp_to_torch_save(folder, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
    walk("", torch.load(out, weights_only=False))
    os.unlink(out)
    return flat


def wait_for_records(dump: str, n: int, proc, limit: float = 300) -> list[dict]:
    deadline = time.time() + limit
    while time.time() < deadline:
        path = os.path.join(dump, "metrics.jsonl")
        if os.path.exists(path):
            records = read_metrics(dump)
            if len(records) >= n:
                return records
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} records in {dump} after {limit} s")


def test_nonfinite_steps_skip_then_stop_and_damaged_checkpoints(tmp_path):
    """NaN gradients on rank 1 at steps 3, 5, 6: 3 and 5 are skipped (nothing moves), the second
    in a row stops the run (exit 3) naming the step, the rank and the parameter; then a flipped byte
    in the newest checkpoint is named, and --mop.reliability.resume_from_verified takes the older
    verified one (without the flag: exit 4, tests/train/test_reliability.py checks the message)."""
    dump = str(tmp_path / "run")
    common = ["--job.dump_folder", dump, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
              "--mop.reliability.max_consecutive_skips", "2"]
    proc = mop_train([*common, "--training.steps", "8"],
                     env=_env(MOP_TRAIN_FAULT="nan_grad:3,5,6:1:layers.1."))
    assert proc.returncode == 3, proc.stderr[-3000:]
    (line,) = errors(proc)
    for part in ("step 6", "layers.1.", "(rank 1)", "max_consecutive_skips = 2",
                 f"The run's last checkpoint, {os.path.join(dump, 'checkpoint', 'step-5')}, holds finite state"):
        assert part in line, f"{part!r} missing from: {line}"
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [json.loads(x) for x in f]          # strict JSON: json.loads rejects bare NaN
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    for s in (3, 5):
        assert by_step[s]["skipped"] and by_step[s]["grad_norm"] is None and "grad_norm" in by_step[s]["nonfinite"]
    assert by_step[5]["skipped_steps"] == 2 and not by_step[4]["skipped"]
    assert by_step[4]["lr"] == by_step[3]["lr"]       # the skipped step did not advance the schedule
    ckpt = os.path.join(dump, "checkpoint")
    assert sorted(os.listdir(ckpt)) == [f"step-{s}" for s in range(1, 6)]   # nothing saved at step 6
    before, skipped, after = (checkpoint_tensors(os.path.join(ckpt, f"step-{s}")) for s in (2, 3, 4))
    moved = [k for k in before if "train_state" not in k and "dataloader" not in k
             and not torch.equal(before[k], skipped[k])]
    assert moved == [], f"a skipped step changed {moved[:5]}"
    assert any("expert_bias" in k for k in before)
    assert not all(torch.equal(skipped[k], after[k]) for k in skipped if "model" in k or "layers" in k)

    shard = os.path.join(ckpt, "step-5", "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
    # one step past the verified step 4 shows the resumed run trains on (steps 6-7 added nothing to check)
    proc = mop_train([*common, "--training.steps", "5", "--mop.reliability.resume_from_verified"])
    check_ok(proc)
    note = next(line for line in proc.stdout.splitlines() if "failed verification" in line)
    for part in (shard, "SHA-256", os.path.join(ckpt, "step-4")):
        assert part in note, f"{part!r} missing from: {note}"
    assert "resumed from step 4" in proc.stdout
    assert read_metrics(dump)[-1]["step"] == 5


def test_extend_past_the_schedule_then_sigterm(tmp_path):
    """6 steps on a 6-step schedule, on an install without triton (keep_latest_k = 2 holds after the
    final save); extended to 200 steps the final LR is held; SIGTERM stops every rank at a step
    boundary with a verified save, said in one line by rank 0."""
    dump = str(tmp_path / "run")
    common = ["--job.dump_folder", dump, "--lr_scheduler.total_steps", "6", "--checkpoint.interval", "2",
              "--checkpoint.keep_latest_k", "2"]
    check_ok(mop_train([*common, "--training.steps", "6"], env=without_triton(tmp_path)))
    ckpt = os.path.join(dump, "checkpoint")
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-6"]
    first = read_metrics(dump)
    proc = mop_train([*common, "--training.steps", "200", "--checkpoint.interval", "1000"], background=True)
    wait_for_records(dump, len(first) + 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err[-3000:]
    records = read_metrics(dump)
    extended = records[len(first):]
    assert extended[0]["step"] == 7 and all(r["lr"] == first[-1]["lr"] for r in extended), \
        [(r["step"], r["lr"]) for r in records]
    last = extended[-1]["step"]
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]   # one line, from rank 0
    assert line.startswith("mop_train.train: error: stopped by a signal") and \
        f"end of step {last}; saved a resumable checkpoint" in line, err[-3000:]
    assert set(os.listdir(ckpt)) == {"step-6", f"step-{last}"}
    for name in os.listdir(ckpt):
        assert os.path.isfile(os.path.join(ckpt, name, "manifest.json"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_one_writer_and_no_orphans(tmp_path):
    """A second job on a held dump folder exits 7 naming the holder; SIGKILL of the launcher takes its
    ranks with it within seconds. The holder's ranks are paused (SIGSTOP) while the second job starts,
    so its two ranks have the machine's cores to themselves instead of sharing them with training: a
    paused rank 0 is alive and holds the lock all the same. They train again (SIGCONT, a step logged)
    before the launcher is killed."""
    dump = str(tmp_path / "run")
    # a collective the pause catches counts the pause against the train timeout (100 s by default)
    common = ["--job.dump_folder", dump, "--training.steps", "500", "--checkpoint.interval", "1000",
              "--comm.train_timeout_seconds", "900"]
    first = mop_train(common, background=True)
    try:
        wait_for_records(dump, 1, first)
        ranks = _children(first.pid)
        assert len(ranks) == 2, ranks
        for r in ranks:
            os.kill(r, signal.SIGSTOP)
        second = mop_train(common)
        for r in ranks:
            os.kill(r, signal.SIGCONT)
        paused_at = len(read_metrics(dump))
        assert second.returncode == 7, second.stderr[-3000:]
        (line,) = errors(second)
        assert "in use by another job" in line and any(f"pid {r}" in line for r in ranks), line
        wait_for_records(dump, paused_at + 1, first)   # training again
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline and any(os.path.exists(f"/proc/{r}") and _state(r) != "Z" for r in ranks):
            time.sleep(0.1)
        alive = [r for r in ranks if os.path.exists(f"/proc/{r}") and _state(r) != "Z"]
        assert alive == [], f"ranks {alive} outlived their launcher"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.communicate()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_hung_collective_fails_within_the_timeout_naming_it(tmp_path):
    """Launched as one node of a multi-node job would be: torchrun's rendezvous flags pass through.
    Rank 1 hangs before step 2 (the first step under the train timeout: step 1 runs under the init
    timeout): rank 0 exits 6 within seconds of the 3 s timeout (timed from step 1's record, so a slow
    start on a loaded machine does not count; the init timeout would be 300 s)."""
    dump = str(tmp_path / "run")
    rendezvous = ("--nnodes", "1", "--node-rank", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"127.0.0.1:{_free_port()}", "--rdzv-id", "hung")
    proc = mop_train(["--job.dump_folder", dump, "--training.steps", "4", "--checkpoint.no-enable",
                      "--comm.train_timeout_seconds", "3"],
                     env=_env(MOP_TRAIN_FAULT="hang:2:1"), launcher=rendezvous, background=True)
    wait_for_records(dump, 1, proc)
    start = time.time()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 6, err[-3000:]
    assert time.time() - start < 60
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert "rank 0, step 2" in line and "during the target-token count all-reduce" in line, line
    assert "comm.train_timeout_seconds = 3" in line, line


def test_config_error_under_torchrun_is_printed_once(tmp_path):
    proc = run_train(["--job.config_file", DEBUG_CONFIG, "--model.flavor", "gigantic",
                      "--job.dump_folder", str(tmp_path)], nproc=2, timeout=120)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("mop_train.train: error:")]
    assert len(ours) == 1, proc.stderr[-3000:]
    for part in (DEBUG_CONFIG, "--model.flavor", "'gigantic'", "debug, small"):
        assert part in ours[0], f"{part!r} missing from: {ours[0]}"
    assert proc.returncode == 1 and "exitcode  : 2" in proc.stderr   # torchrun's own code is 1
    # the rank's error file makes torchrun's root cause our line, not a link to its docs
    assert f"traceback : exit 2: {ours[0].split('error: ', 1)[1]}" in proc.stderr, proc.stderr[-3000:]
    assert 'File "' + os.path.join(REPO, "mop_train") not in proc.stderr   # no traceback of ours
