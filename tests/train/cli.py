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


def check_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def read_metrics(dump_folder: str, name: str = "metrics.jsonl") -> list[dict]:
    with open(os.path.join(dump_folder, name)) as f:
        return [json.loads(line) for line in f]
