"""The operator options a TOML reaches through the real CLI change no loss (fp32, CPU, 2 gloo ranks):
OffloadStreamAdamW with a device-resident share and overlap, attention kept across the recompute,
Ring-DTP's grad_in_forward schedule and sequence tiling, against the same run with each left at its
default (that reference run in spawned ranks, through the training function the CLI calls)."""

import pytest

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train

COMMON = ["--job.config_file", DEBUG_CONFIG, "--training.steps", "2", "--metrics.log_freq", "1",
          "--metrics.no-enable-tensorboard", "--checkpoint.no-enable", "--debug.seed", "5",
          "--optimizer.name", "OffloadStreamAdamW", "--mop.layout.expert_degree", "2",
          "--mop.layout.vocab_degree", "2", "--mop.moe.dispatch", "ep"]


OPTIONS = ["--mop.offload_adamw.device_fraction", "0.4", "--mop.offload_adamw.overlap", "--mop.attention.keep",
           "--mop.ring_dtp.schedule", "grad_in_forward", "--mop.tiling.ffn_tokens", "48",
           "--mop.tiling.block_tokens", "48"]


def _defaults_worker(rank, world, folder):
    from tests.train.in_process import train_here

    train_here(folder, COMMON)


@pytest.mark.slow
def test_new_operator_options_keep_the_losses(tmp_path):
    """The options through a real launch (`torchrun -m mop_train.train`, the summary names each); the
    reference with the defaults through the same training function in 2 spawned ranks
    (tests/train/in_process.py), one launch fewer."""
    from tests.dist_utils import run_distributed

    runs = {}
    defaults, options = str(tmp_path / "defaults"), str(tmp_path / "options")
    run_distributed(_defaults_worker, 2, defaults, timeout_s=300)
    runs["defaults"] = [m["loss"] for m in read_metrics(defaults)]
    proc = run_train([*COMMON, "--job.dump_folder", options, *OPTIONS], nproc=2, timeout=300)
    check_ok(proc)
    runs["options"] = [m["loss"] for m in read_metrics(options)]
    assert "device_fraction 0.400" in proc.stdout and "attention kept" in proc.stdout
    assert "tiled FFN 48 tokens, attention stages 48 tokens" in proc.stdout
    want, got = runs["defaults"], runs["options"]
    assert len(got) == len(want) == 2  # step 2's loss follows step 1's update
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, f"{got} vs {want}"


def test_options_for_another_optimizer_fail_before_launch(tmp_path):
    proc = run_train(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path / "x"),
                      "--mop.offload_adamw.device_fraction", "0.5"], nproc=None, timeout=120)
    assert proc.returncode != 0
    assert "device_fraction = '0.5' only applies to optimizer.name = 'OffloadStreamAdamW'" in proc.stdout + proc.stderr
