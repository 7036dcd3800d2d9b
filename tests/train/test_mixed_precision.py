"""bf16 mixed precision through the real CLI on CPU (gloo runs FSDP2's MixedPrecisionPolicy too),
so the bf16 path that users run on GPUs is covered by CI.

(W=4, D=2, E_p=2, P=2) in bf16 for every dispatch schedule against the fp32 run at W=1 (the same
global batch and seed): per-step losses within 2e-2 relative (bf16's 8-bit mantissa over 3 blocks
and a 2048-token softmax), and never bitwise equal to fp32 (the setting was honoured, not replaced).
"""

import pytest

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train

STEPS = 3
BF16_REL_TOL = 2e-2
SCHEDULE_FLAGS = {
    "ep": [],
    "llep": ["--mop.moe.min_tokens_per_gemm", "8", "--mop.moe.imbalance_threshold", "1.0"],
    "pipelined_llep": ["--mop.moe.token_budget", "24", "--mop.moe.min_tokens_per_gemm", "8",
                       "--mop.moe.imbalance_threshold", "1.0"],
}


def _losses(folder, nproc, extra):
    check_ok(run_train(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--training.steps",
                        str(STEPS), "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
                        "--checkpoint.no-enable", "--debug.seed", "11", *extra], nproc=nproc, timeout=300))
    return [m["loss"] for m in read_metrics(folder)]


@pytest.mark.slow
def test_bf16_layout_matches_fp32_for_every_schedule(tmp_path):
    fp32 = _losses(str(tmp_path / "fp32"), 1, ["--training.local_batch_size", "4"])
    for dispatch, flags in SCHEDULE_FLAGS.items():
        bf16 = _losses(str(tmp_path / f"bf16_{dispatch}"), 4, [
            "--training.local_batch_size", "2", "--training.mixed_precision_param", "bfloat16",
            "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2", "--mop.layout.vocab_degree", "2",
            "--mop.moe.dispatch", dispatch, *flags])
        assert len(bf16) == len(fp32) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(bf16, fp32))
        assert worst <= BF16_REL_TOL, f"{dispatch}: bf16 losses {bf16} vs fp32 {fp32}: max rel {worst:.2e}"
        assert bf16 != fp32, f"{dispatch}: bf16 losses equal fp32's bitwise: bf16 was not used"
