"""Run the real training CLI in a subprocess and read back its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG_CONFIG = os.path.join(REPO, "configs", "debug_cpu.toml")


def run_train(args: list[str], *, nproc: int | None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc -m mop_train.train ARGS` (plain python if nproc is None)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc else [sys.executable]) + ["-m", "mop_train.train", *args]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def read_metrics(dump_folder: str) -> list[dict]:
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
