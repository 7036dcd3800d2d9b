"""Gradient accumulation through the real CLI (fp32, CPU, gloo): a step of M micro-batches gives the
losses and final parameters of one step over the whole batch, at two layouts, and a global batch that
is not a whole number of micro-batches fails before launch."""

import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close

STEPS = 3


def _run(folder, nproc, extra):
    proc = run_train(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--training.steps", str(STEPS),
                      "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--debug.seed", "13",
                      "--checkpoint.enable", "--checkpoint.interval", str(STEPS),
                      "--checkpoint.last_save_model_only", *extra], nproc=nproc, timeout=300)
    check_ok(proc)
    dcp_to_torch_save(os.path.join(folder, "checkpoint", f"step-{STEPS}"), os.path.join(folder, "final.pt"))
    state = torch.load(os.path.join(folder, "final.pt"), weights_only=False)
    return read_metrics(folder), state.get("model", state), proc.stdout


@pytest.mark.slow
def test_micro_batches_equal_one_step_over_the_whole_batch(tmp_path):
    # Global batch 4 sequences. Whole: W=2, B=2, one micro-batch. Accumulated: W=2, B=1, two micro-batches,
    # and W=4 with D=2, E_p=2 (two sequence groups), B=1, two micro-batches.
    whole, whole_params, _ = _run(str(tmp_path / "whole"), 2, ["--training.local_batch_size", "2"])
    for name, nproc, extra in (
            ("accum_w2", 2, ["--training.local_batch_size", "1", "--training.global_batch_size", "4"]),
            ("accum_w4_d2", 4, ["--training.local_batch_size", "1", "--training.global_batch_size", "4",
                                "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2",
                                "--mop.moe.dispatch", "ep"])):
        got, params, stdout = _run(str(tmp_path / name), nproc, extra)
        assert "2 micro-batches per step" in stdout and all(m["micro_batches"] == 2 for m in got)
        assert [m["tokens_seen"] for m in got] == [m["tokens_seen"] for m in whole]
        assert_close(torch.tensor([m["loss"] for m in got]), torch.tensor([m["loss"] for m in whole]),
                     rtol=1e-5, atol=0, name=f"{name} losses")
        for key, ref in whole_params.items():
            if torch.is_tensor(ref) and ref.is_floating_point():
                assert_close(params[key], ref, rtol=1e-5, atol=1e-6, name=f"{name} {key}")


def test_global_batch_not_a_multiple_fails_before_launch(tmp_path):
    proc = run_train(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path / "x"),
                      "--training.local_batch_size", "2", "--training.global_batch_size", "3"],
                     nproc=None, timeout=120)
    assert proc.returncode != 0
    assert "a multiple of 2" in proc.stdout + proc.stderr
