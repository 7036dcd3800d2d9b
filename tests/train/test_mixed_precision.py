"""bf16 mixed precision through the real training loop on CPU (gloo runs FSDP2's MixedPrecisionPolicy
too), so the bf16 path that users run on GPUs is covered by CI.

(W=4, D=2, E_p=2, P=2) in bf16 for every dispatch schedule against the fp32 run at W=1 (the same
global batch and seed): per-step losses within 2e-2 relative (bf16's 8-bit mantissa over 3 blocks
and a 2048-token softmax), and never bitwise equal to fp32 (the setting was honoured, not replaced).
Two steps: step 1 is the bf16 forward of the same weights, step 2 follows an update made from bf16
gradients (reduced in FSDP2's reduce dtype) into the fp32 master weights. The three schedules train
in one W=4 spawn (`train` in process, tests/train/in_process.py), the fp32 reference in a W=1 spawn.
"""

import os

import pytest

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, read_metrics
from tests.train.in_process import stdout_of, train_here

STEPS = 2
BF16_REL_TOL = 2e-2
BASE = ["--job.config_file", DEBUG_CONFIG, "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--metrics.no-enable-tensorboard", "--checkpoint.no-enable", "--debug.seed", "11"]
FP32 = ["--training.local_batch_size", "4"]
BF16 = ["--training.local_batch_size", "2", "--training.mixed_precision_param", "bfloat16",
        "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2", "--mop.layout.vocab_degree", "2"]
SCHEDULE_FLAGS = {
    "ep": [],
    "llep": ["--mop.moe.min_tokens_per_gemm", "8", "--mop.moe.imbalance_threshold", "1.0"],
    "pipelined_llep": ["--mop.moe.token_budget", "24", "--mop.moe.min_tokens_per_gemm", "8",
                       "--mop.moe.imbalance_threshold", "1.0"],
}


def _world_worker(rank, world, root):
    if world == 1:
        train_here(os.path.join(root, "fp32"), [*BASE, *FP32])
        return
    for dispatch, flags in SCHEDULE_FLAGS.items():
        train_here(os.path.join(root, f"bf16_{dispatch}"), [*BASE, *BF16, "--mop.moe.dispatch", dispatch, *flags])


@pytest.mark.slow
def test_bf16_layout_matches_fp32_for_every_schedule(tmp_path):
    for world in (1, 4):
        run_distributed(_world_worker, world, str(tmp_path), timeout_s=600)
    fp32 = [m["loss"] for m in read_metrics(str(tmp_path / "fp32"))]
    for dispatch in SCHEDULE_FLAGS:
        folder = str(tmp_path / f"bf16_{dispatch}")
        assert f"dispatch {dispatch}" in stdout_of(folder)
        bf16 = [m["loss"] for m in read_metrics(folder)]
        assert len(bf16) == len(fp32) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(bf16, fp32))
        assert worst <= BF16_REL_TOL, f"{dispatch}: bf16 losses {bf16} vs fp32 {fp32}: max rel {worst:.2e}"
        assert bf16 != fp32, f"{dispatch}: bf16 losses equal fp32's bitwise: bf16 was not used"
