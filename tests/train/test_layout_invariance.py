"""Layout invariance, the test that proves the layout: the same seed and global batch give the
same per-step losses and the same final parameters under every MoP layout (fp32, `debug`).

Layouts: W=1; (W=4, D=2, E_p=4); (W=4, D=4, E_p=2); (W=2, D=1, E_p=2); and with the vocab split
P > 1 through Ring-DTP: (W=4, D=2, E_p=4, P=2, pipelined_llep with chunking and relocation) and
(W=2, P=2, llep). The global batch is 4 sequences of 128 tokens in every case. Two steps: step 2's
loss is computed with the weights that step 1's (layout-reduced) gradients moved, and the final
parameters carry both updates with AdamW's moments, so a layout that sums, scales or places any
gradient differently shows in both.

Resume: (W=4, D=2, E_p=4, P=2, pipelined_llep) trains 3 steps straight, and 1 step then a resume to
3; the resumed steps 2 and 3 (loss, grad norm) and the final parameters are bitwise the straight
run's. Step 2 shows the restored weights and data position, step 3 the restored optimizer moments
and schedule (they made step 2's update).

Each world size trains all its layouts in one spawn (`train` in process, tests/train/in_process.py),
in a module fixture that both tests read.
"""

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, read_metrics
from tests.train.in_process import final_model, stdout_of, train_here
from tests.utils import assert_close

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 4
STEPS = 2
LAYOUTS = [  # (W, D, E_p, P, dispatch, extra flags); LAYOUTS[0] is the reference
    (1, 1, 1, 1, "local", []),
    (4, 2, 4, 1, "ep", []),
    (4, 4, 2, 1, "ep", []),
    (2, 1, 2, 1, "ep", []),
    (4, 2, 4, 2, "pipelined_llep", ["--mop.moe.token_budget", "24", "--mop.moe.min_tokens_per_gemm", "8",
                                    "--mop.moe.imbalance_threshold", "1.0"]),
    (2, 1, 2, 2, "llep", ["--mop.moe.min_tokens_per_gemm", "8", "--mop.moe.imbalance_threshold", "1.0",
                          "--mop.ring_dtp.mode", "move_weights"]),
]
RESUME_STEPS = 3
RESUME = ["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "1", "--debug.seed", "5",
          "--training.local_batch_size", "2", "--mop.layout.seq_degree", "2",
          "--mop.layout.expert_degree", "4", "--mop.layout.vocab_degree", "2",
          "--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget", "24",
          "--mop.moe.min_tokens_per_gemm", "8", "--metrics.no-enable-tensorboard",
          "--checkpoint.enable", "--checkpoint.interval", "1", "--lr_scheduler.total_steps", "4"]


def _name(layout) -> str:
    return "w%dd%de%dp%d%s" % layout[:5]


def _layout_args(W, D, Ep, P, dispatch, extra) -> list[str]:
    return ["--job.config_file", DEBUG_CONFIG, "--training.steps", str(STEPS),
            "--training.local_batch_size", str(GLOBAL_BATCH * D // W), "--metrics.log_freq", "1",
            "--metrics.no-enable-tensorboard", "--debug.seed", "11", "--checkpoint.enable",
            "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_model_only",
            "--mop.layout.seq_degree", str(D), "--mop.layout.expert_degree", str(Ep),
            "--mop.layout.vocab_degree", str(P), "--mop.moe.dispatch", dispatch, *extra]


def _world_worker(rank, world, root):
    for layout in LAYOUTS:
        if layout[0] == world:
            train_here(os.path.join(root, _name(layout)), _layout_args(*layout), convert_steps=(STEPS,))
    if world == 4:  # DCP saves and restores the group-sharded DTensors (experts over E_p, projection over P)
        straight, resumed = os.path.join(root, "straight"), os.path.join(root, "resumed")
        train_here(straight, [*RESUME, "--training.steps", str(RESUME_STEPS)], convert_steps=(RESUME_STEPS,))
        train_here(resumed, [*RESUME, "--training.steps", "1"])
        train_here(resumed, [*RESUME, "--training.steps", str(RESUME_STEPS)], convert_steps=(RESUME_STEPS,))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    for world in sorted({layout[0] for layout in LAYOUTS}):
        run_distributed(_world_worker, world, root, timeout_s=800)
    return root


def test_losses_and_final_parameters_match_across_layouts(runs):
    ref_folder = os.path.join(runs, _name(LAYOUTS[0]))
    ref_losses, ref_params = [m["loss"] for m in read_metrics(ref_folder)], final_model(ref_folder, STEPS)
    assert len(ref_losses) == STEPS
    assert any(".experts.w1" in k for k in ref_params) and "output.weight" in ref_params
    for layout in LAYOUTS[1:]:
        folder = os.path.join(runs, _name(layout))
        metrics, params = read_metrics(folder), final_model(folder, STEPS)
        losses = [m["loss"] for m in metrics]
        name = "W=%d D=%d E_p=%d P=%d %s" % layout[:5]
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, name=f"{name} losses")
        assert sorted(params) == sorted(ref_params), f"{name}: parameter names differ"
        for key, ref in ref_params.items():
            if torch.is_tensor(ref) and ref.is_floating_point():
                assert_close(params[key], ref, rtol=1e-5, atol=1e-6, name=f"{name} {key}")
        if layout[4] == "pipelined_llep":  # the run really chunked and relocated
            assert all(m["moe_num_chunks"] > 1 and m["moe_relocated_routes"] > 0 for m in metrics)


def test_resume_is_exact_with_sharded_experts_and_vocab(runs):
    straight, resumed = os.path.join(runs, "straight"), os.path.join(runs, "resumed")
    assert "resumed from step 1" in stdout_of(resumed)
    want = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(straight)][1:]
    got = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(resumed)][1:]
    assert [m[0] for m in want] == list(range(2, RESUME_STEPS + 1))
    assert got == want, f"resumed {got} != straight {want}"
    ours, theirs = final_model(resumed, RESUME_STEPS), final_model(straight, RESUME_STEPS)
    params = {k: v for k, v in theirs.items() if torch.is_tensor(v) and v.is_floating_point()}
    assert any(".experts.w1" in k for k in params) and "output.weight" in params
    for key, value in params.items():
        assert torch.equal(ours[key], value), f"resumed final {key} differs from the straight run's"
