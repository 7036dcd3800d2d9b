"""A step that logs nothing ends without reading a device value in the loop (mop_train.train.loop.run_steps).

A read at a step's end (`.item()`, `.tolist()`, `int()` of a tensor) makes the host wait for the
device to finish the step, optimizer included, before it launches the next step's first kernels.
The loop's token count (tokens seen, and from it the throughput window: mop_train.train.device_count) and the
expert dispatch's figures (DispatchStats) are read only when a record is written.

On CPU there is no device to wait for, so the test watches the Python-level reads themselves:
`Tensor.item`, `.tolist`, `__int__`, `__float__` and `__bool__` are wrapped for the run, and each
call made from the loop's, the counter's or the dispatch statistics' own code is charged to the
step it follows. W=2 gloo ranks, `debug` with expert-parallel dispatch (E_p=2, so every MoE layer
keeps DispatchStats), 6 steps, a record at the first, every 4th and the last: steps 2, 3 and 5 must
show no such read; steps 1, 4 and 6 must (so the watch itself is seen to work).
"""

from __future__ import annotations

import os
import sys

import torch

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, read_metrics
from tests.train.in_process import train_here

STEPS, LOG_FREQ = 6, 4
LOGGED = {1, 4, 6}            # the first step, every 4th, the last
WATCHED = (os.path.join("mop_train", "train", "loop.py"), os.path.join("mop_train", "train", "device_count.py"),
           os.path.join("mop_train", "ops", "moe_dispatch", "stats.py"),
           os.path.join("mop_train", "parallel", "apply.py"))
READS = ("item", "tolist", "__int__", "__float__", "__bool__")


def _worker(rank, world, root):
    import mop_train.train.loop as loop
    state = {"step": 0, "inside": False}
    reads: list[tuple[int, str]] = []          # (step the read follows, caller) outside train_step
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def watched(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            if not state["inside"] and path.endswith(WATCHED):
                reads.append((state["step"], f"{os.path.basename(path)}:{caller.f_lineno} {name}"))
            return original(self, *args, **kwargs)
        return read

    train_step = loop.train_step

    def counted_step(*args, **kwargs):
        state["step"], state["inside"] = kwargs["step"], True
        try:
            return train_step(*args, **kwargs)
        finally:
            state["inside"] = False

    loop.train_step = counted_step
    for name in READS:
        setattr(torch.Tensor, name, watched(name))
    try:
        train_here(os.path.join(root, "run"), [
            "--job.config_file", DEBUG_CONFIG, "--training.steps", str(STEPS), "--metrics.log_freq", str(LOG_FREQ),
            "--metrics.no-enable-tensorboard", "--checkpoint.no-enable", "--training.local_batch_size", "2",
            "--mop.layout.expert_degree", "2", "--mop.moe.dispatch", "ep", "--debug.seed", "5"])
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        loop.train_step = train_step
    torch.save(reads, os.path.join(root, f"reads{rank}.pt"))


def test_a_step_that_logs_nothing_reads_nothing_at_its_end(tmp_path):
    run_distributed(_worker, 2, str(tmp_path), timeout_s=300)
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == sorted(LOGGED)
    assert all(r["moe_num_chunks"] >= 1 for r in records), "the dispatch figures reached the records"
    for rank in range(2):
        reads = torch.load(tmp_path / f"reads{rank}.pt")
        by_step = {s: [c for t, c in reads if t == s] for s in range(1, STEPS + 1)}
        for step in range(1, STEPS + 1):
            if step in LOGGED:
                assert by_step[step], f"rank {rank}: the watch saw no read at logged step {step}"
            else:
                assert not by_step[step], f"rank {rank}, step {step} (not logged): the loop read {by_step[step]}"
