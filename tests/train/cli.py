"""Run the real training CLI in a subprocess and read back its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG_CONFIG = os.path.join(REPO, "configs", "debug_cpu.toml")
DROPOUT_ENTRY = os.path.join(REPO, "tests", "train", "dropout_entry.py")   # the model draws every step


def run_train(args: list[str], *, nproc: int | None, timeout: float = 180,
              entry: tuple[str, ...] = ("-m", "mop_train.train")) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc -m mop_train.train ARGS` (plain python if nproc is
    None); `entry`: another entry point, e.g. (DROPOUT_ENTRY,)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc else [sys.executable]) + [*entry, *args]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def failure_text(proc: subprocess.CompletedProcess) -> str:
    """A failed run's account: the first rank traceback (torchrun prints its own after it, which a tail
    alone would keep instead) and the output's tail."""
    out = proc.stdout + proc.stderr
    first = out.find("Traceback (most recent call last)")
    head = f"first traceback:\n{out[first:first + 4000]}\n...\n" if first >= 0 else ""
    return f"training failed ({proc.returncode}):\n{head}tail:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def check_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        raise AssertionError(failure_text(proc))


def read_metrics(dump_folder: str, name: str = "metrics.jsonl") -> list[dict]:
    with open(os.path.join(dump_folder, name)) as f:
        return [json.loads(line) for line in f]
