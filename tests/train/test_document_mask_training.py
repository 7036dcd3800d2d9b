"""[mop.data] document_mask through the real training loop: the same losses on one rank and on a
Ulysses sequence group of two (document ids come from the full sequences before the split), and
different losses from the unmasked run (the packed rows do hold several documents). The one-rank
masked run also offloads block inputs through SCO, whose wrapper must pass the document ids on.

The one-rank runs (masked, plain) train in one W=1 spawn, the sequence group in a W=2 spawn (`train`
in process, tests/train/in_process.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, read_metrics
from tests.train.in_process import stdout_of, train_here
from tests.utils import assert_close

pytestmark = pytest.mark.slow
STEPS = 6  # the mask's effect on the loss grows as attention trains: 3 steps gave a max rel diff of 5e-5 only
GLOBAL_BATCH = 4
FAST_LR = ["--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-2"]  # attention matters sooner
RUNS = {  # world size -> (D, mask, extra flags) per run
    1: [(1, True, ["--mop.sco.host_budget", "1MiB"]), (1, False, [])],
    2: [(2, True, [])],
}


def _folder(root, W: int, D: int, mask: bool) -> str:
    return os.path.join(root, f"w{W}d{D}{'mask' if mask else 'plain'}")


def _world_worker(rank, world, root):
    for D, mask, extra in RUNS[world]:
        train_here(_folder(root, world, D, mask), [
            "--job.config_file", DEBUG_CONFIG, "--training.steps", str(STEPS),
            "--training.seq_len", "512", "--training.local_batch_size", str(GLOBAL_BATCH * D // world),
            "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--checkpoint.no-enable",
            "--debug.seed", "13", "--mop.layout.seq_degree", str(D), *FAST_LR,
            *(["--mop.data.document_mask"] if mask else []), *extra])


def test_document_mask_losses_match_across_sequence_parallel_layouts(tmp_path):
    root = str(tmp_path)
    for world in RUNS:
        run_distributed(_world_worker, world, root, timeout_s=600)
    records = read_metrics(_folder(root, 1, 1, True))
    assert "document mask on" in stdout_of(_folder(root, 1, 1, True))
    assert all(r["sco_offloaded_layers"] == 2 for r in records), records[-1]  # 2 of 3 512 KiB inputs
    assert "document mask on" in stdout_of(_folder(root, 2, 2, True))
    assert "document mask on" not in stdout_of(_folder(root, 1, 1, False))
    one, two, plain = ([r["loss"] for r in read_metrics(_folder(root, *run))]
                       for run in ((1, 1, True), (2, 2, True), (1, 1, False)))
    assert len(one) == STEPS
    assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=0, name="W=2 D=2 vs W=1 losses")
    rels = ((torch.tensor(plain) - torch.tensor(one)).abs() / torch.tensor(one)).tolist()
    assert max(rels) > 1e-4, f"the mask did not change the losses (rel diffs {rels}): no EOS in the batches?"
