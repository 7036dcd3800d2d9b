"""Gradient accumulation through the real training loop (fp32, CPU, gloo): a step of M micro-batches
gives the losses and final parameters of one step over the whole batch, at two layouts, and a global
batch that is not a whole number of micro-batches fails before training.

Global batch 4 sequences. Whole: W=2, B=2, one micro-batch. Accumulated: W=2, B=1, two micro-batches,
and W=4 with D=2, E_p=2 (two sequence groups), B=1, two micro-batches. Two steps: step 2's loss is
computed with the weights step 1's accumulated gradient moved, and the final parameters carry both
steps' updates (AdamW's moments included), so a wrong sum or scale of the micro-batch gradients shows
in both. Each world trains all its cases in one spawn (`train` in process, tests/train/in_process.py);
a module fixture runs them once for both tests.
"""

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, read_metrics
from tests.train.in_process import final_model, stdout_of, train_here
from tests.utils import assert_close

STEPS = 2
BASE = ["--job.config_file", DEBUG_CONFIG, "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--metrics.no-enable-tensorboard", "--debug.seed", "13", "--checkpoint.enable",
        "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_model_only"]
CASES = {  # world size -> {case: flags}
    2: {"whole": ["--training.local_batch_size", "2"],
        "accum_w2": ["--training.local_batch_size", "1", "--training.global_batch_size", "4"]},
    4: {"accum_w4_d2": ["--training.local_batch_size", "1", "--training.global_batch_size", "4",
                        "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2", "--mop.moe.dispatch", "ep"]},
}
NOT_A_MULTIPLE = ["--training.local_batch_size", "1", "--training.global_batch_size", "3"]  # at W=2: 1 x 2 per micro


def _world_worker(rank, world, root):
    for name, flags in CASES[world].items():
        train_here(os.path.join(root, name), [*BASE, *flags], convert_steps=(STEPS,))
    if world == 2:  # the config error is raised by every rank before step 1, and nothing is trained
        folder = os.path.join(root, "not_a_multiple")
        with pytest.raises(ValueError) as err:
            train_here(folder, [*BASE, *NOT_A_MULTIPLE])
        assert not os.path.exists(os.path.join(folder, "metrics.jsonl"))
        if rank == 0:
            with open(os.path.join(root, "not_a_multiple.txt"), "w") as f:
                f.write(str(err.value))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("accum"))
    for world in CASES:
        run_distributed(_world_worker, world, root, timeout_s=600)
    return root


@pytest.mark.slow
def test_micro_batches_equal_one_step_over_the_whole_batch(runs):
    whole = read_metrics(os.path.join(runs, "whole"))
    whole_params = final_model(os.path.join(runs, "whole"), STEPS)
    assert len(whole) == STEPS and all(m["micro_batches"] == 1 for m in whole)
    assert any(".experts.w1" in k for k in whole_params) and "output.weight" in whole_params
    for name in ("accum_w2", "accum_w4_d2"):
        folder = os.path.join(runs, name)
        got, params = read_metrics(folder), final_model(folder, STEPS)
        assert "2 micro-batches per step" in stdout_of(folder) and all(m["micro_batches"] == 2 for m in got)
        assert [m["tokens_seen"] for m in got] == [m["tokens_seen"] for m in whole]
        assert_close(torch.tensor([m["loss"] for m in got]), torch.tensor([m["loss"] for m in whole]),
                     rtol=1e-5, atol=0, name=f"{name} losses")
        assert sorted(params) == sorted(whole_params), f"{name}: parameter names differ"
        for key, ref in whole_params.items():
            if torch.is_tensor(ref) and ref.is_floating_point():
                assert_close(params[key], ref, rtol=1e-5, atol=1e-6, name=f"{name} {key}")


@pytest.mark.slow
def test_global_batch_not_a_multiple_fails_before_launch(runs):
    with open(os.path.join(runs, "not_a_multiple.txt")) as f:
        message = f.read()
    assert "training.global_batch_size = 3" in message and "a multiple of 2" in message, message
