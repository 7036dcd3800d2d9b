"""[validation] on one CUDA device the way users launch it (issue 34 item 2): `torchrun -m mop_train.train`,
NCCL, bf16 mixed precision, deterministic kernels, the debug model validating every 2 steps on the
embedded held-out split, in three settings of one seed:

- plain: local dispatch, torch AdamW;
- every operator: PipelinedLLEP chunking, Ring-DTP (its loss-only path in validation), SCO, and
  OffloadStreamAdamW overlapping the next forward (so validation must wait for the weights);
- every operator with weights and gradients streamed (`weights = "stream"`, `gradients = "stream"`):
  validation's no-grad forward loads each block's working weights through the same windows.

Streaming is bitwise by construction (tests/train/test_offload_streaming_gpu.py), so the third
setting's validation and training losses equal the second's exactly; the operators change the bf16
rounding, so the second against the first agrees within bf16 tolerance. Each run's validation
records sit at steps 2 and 4 with 3 batches of B x S tokens, finite. Passed on one H200 on 2026-12-02 (tree 7e5833c).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import requires_gpus
from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close, fresh_seed

pytestmark = [pytest.mark.gpu, requires_gpus(1)]
B, S, VALIDATION_BATCHES = 2, 256, 3
OPERATORS = ["--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget", "96", "--mop.moe.min_tokens_per_gemm",
             "16", "--mop.moe.imbalance_threshold", "1.0", "--mop.ring_dtp.enable", "--mop.sco.host_budget", "64MiB",
             "--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.overlap"]
SETTINGS = {
    "plain": [],
    "operators": OPERATORS,
    "operators-streamed": [*OPERATORS, "--mop.offload_adamw.weights", "stream",
                           "--mop.offload_adamw.gradients", "stream"],
}


def _args(seed: int, folder: str, flags: list[str]) -> list[str]:
    return ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--training.steps", "4",
            "--training.local_batch_size", str(B), "--training.seq_len", str(S),
            "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "1", "--checkpoint.no-enable",
            "--debug.seed", str(seed), "--debug.deterministic", "--validation.enable", "--validation.dataset",
            "embedded", "--validation.freq", "2", "--validation.steps", str(VALIDATION_BATCHES),
            "--validation.local_batch_size", str(B), "--validation.seq_len", str(S), *flags]


def test_validation_on_cuda_with_every_operator_and_streamed_weights(tmp_path):
    seed = fresh_seed(9504) % 1000
    runs = {}
    for name, flags in SETTINGS.items():
        folder = str(tmp_path / name)
        check_ok(run_train(_args(seed, folder, flags), nproc=1, timeout=300))
        records = read_metrics(folder)
        validated = [r for r in records if "validation/loss" in r]
        assert [r["step"] for r in validated] == [2, 4], (name, validated)
        for r in validated:
            assert r["validation/batches"] == VALIDATION_BATCHES and r["validation/tokens"] == VALIDATION_BATCHES * B * S
            assert math.isfinite(r["validation/loss"]), (name, r)
        runs[name] = ([r["validation/loss"] for r in validated], [r["loss"] for r in records if "loss" in r])
    assert runs["operators-streamed"] == runs["operators"], runs    # bitwise: the same bits moved elsewhere
    for i, label in enumerate(("validation", "training")):
        assert_close(torch.tensor(runs["operators"][i]), torch.tensor(runs["plain"][i]), rtol=2e-2, atol=0,
                     name=f"{label} losses, every operator vs plain (bf16)")
