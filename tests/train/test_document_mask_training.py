"""[mop.data] document_mask through the real CLI: the same losses on one rank and on a Ulysses
sequence group of two (document ids come from the full sequences before the split), and
different losses from the unmasked run (the packed rows do hold several documents). The one-rank
masked run also offloads block inputs through SCO, whose wrapper must pass the document ids on."""

from __future__ import annotations

import pytest
import torch

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close

pytestmark = pytest.mark.slow
STEPS = 6
GLOBAL_BATCH = 4
FAST_LR = ["--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-2"]  # attention matters sooner


def _run(tmp_path, W: int, D: int, mask: bool, extra=()) -> tuple[list[dict], str]:
    folder = str(tmp_path / f"w{W}d{D}{'mask' if mask else 'plain'}")
    proc = run_train([
        "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--training.steps", str(STEPS),
        "--training.seq_len", "512", "--training.local_batch_size", str(GLOBAL_BATCH * D // W),
        "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--checkpoint.no-enable",
        "--debug.seed", "13", "--mop.layout.seq_degree", str(D), *FAST_LR,
        *(["--mop.data.document_mask"] if mask else []), *extra], nproc=W, timeout=300)
    check_ok(proc)
    return read_metrics(folder), proc.stdout


def test_document_mask_losses_match_across_sequence_parallel_layouts(tmp_path):
    records, stdout = _run(tmp_path, 1, 1, mask=True, extra=["--mop.sco.host_budget", "1MiB"])
    assert "document mask on" in stdout
    assert all(r["sco_offloaded_layers"] == 2 for r in records), records[-1]  # 2 of 3 512 KiB inputs
    two_records, _ = _run(tmp_path, 2, 2, mask=True)
    plain_records, plain_stdout = _run(tmp_path, 1, 1, mask=False)
    assert "document mask on" not in plain_stdout
    one, two, plain = ([r["loss"] for r in recs] for recs in (records, two_records, plain_records))
    assert len(one) == STEPS
    assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=0, name="W=2 D=2 vs W=1 losses")
    rel = ((torch.tensor(plain) - torch.tensor(one)).abs() / torch.tensor(one)).max().item()
    assert rel > 1e-4, f"the mask did not change the losses (max rel diff {rel:.2e}): no EOS in the batches?"
