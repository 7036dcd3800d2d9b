"""The sweep scripts run real training points and record what each one did."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_batch_sweep_records_points_and_stops_at_the_first_failure(tmp_path):
    out = tmp_path / "batch.json"
    # global_batch_size = 2 makes local batch 2 valid on one rank and local batch 4 a config error.
    cmd = [sys.executable, os.path.join(REPO, "scripts", "sweep_batch.py"), "--config",
           os.path.join(REPO, "configs", "debug_cpu.toml"), "--nproc", "1", "--steps", "2",
           "--seq-len", "32", "--batches", "4", "2", "8", "--root", str(tmp_path), "--out", str(out),
           "--", "--training.global_batch_size", "2", "--metrics.no-enable-tensorboard"]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads(out.read_text())["points"]
    assert [p["local_batch"] for p in points] == [2, 4], "sorted, and stopped after the first failure"
    assert points[0]["status"] == "ok" and points[0]["steps"] == 2 and points[0]["tokens_per_s"] > 0
    assert points[1]["status"] == "failed" and "global_batch_size" in points[1]["error"]
    assert "local_batch" in proc.stdout and "results:" in proc.stdout
