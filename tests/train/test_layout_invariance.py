"""Layout invariance, the test that proves the layout: the same seed and global batch give the
same per-step losses and the same final parameters under every MoP layout (fp32, `debug`).

Layouts: W=1; (W=4, D=2, E_p=4); (W=4, D=4, E_p=2); (W=2, D=1, E_p=2); and with the vocab split
P > 1 through Ring-DTP: (W=4, D=2, E_p=4, P=2, pipelined_llep with chunking and relocation) and
(W=2, P=2, llep). The global batch is 4 sequences of 128 tokens in every case.
"""

import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close

GLOBAL_BATCH = 4
STEPS = 3
LAYOUTS = [  # (W, D, E_p, P, dispatch, extra flags)
    (1, 1, 1, 1, "local", []),
    (4, 2, 4, 1, "ep", []),
    (4, 4, 2, 1, "ep", []),
    (2, 1, 2, 1, "ep", []),
    (4, 2, 4, 2, "pipelined_llep", ["--mop.moe.token_budget", "24", "--mop.moe.min_tokens_per_gemm", "8",
                                    "--mop.moe.imbalance_threshold", "1.0"]),
    (2, 1, 2, 2, "llep", ["--mop.moe.min_tokens_per_gemm", "8", "--mop.moe.imbalance_threshold", "1.0",
                          "--mop.ring_dtp.mode", "move_weights"]),
]


def _run(tmp_path, W, D, Ep, P, dispatch, extra):
    folder = str(tmp_path / f"w{W}d{D}e{Ep}p{P}{dispatch}")
    proc = run_train([
        "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--training.steps", str(STEPS),
        "--training.local_batch_size", str(GLOBAL_BATCH * D // W), "--metrics.log_freq", "1",
        "--metrics.no-enable-tensorboard", "--debug.seed", "11", "--checkpoint.enable",
        "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_model_only",
        "--mop.layout.seq_degree", str(D), "--mop.layout.expert_degree", str(Ep),
        "--mop.layout.vocab_degree", str(P), "--mop.moe.dispatch", dispatch, *extra], nproc=W, timeout=300)
    check_ok(proc)
    losses = [m["loss"] for m in read_metrics(folder)]
    ckpt = os.path.join(folder, "checkpoint", f"step-{STEPS}")
    dcp_to_torch_save(ckpt, os.path.join(folder, "final.pt"))
    state = torch.load(os.path.join(folder, "final.pt"), weights_only=False)
    return losses, state.get("model", state), read_metrics(folder)


@pytest.mark.slow
def test_losses_and_final_parameters_match_across_layouts(tmp_path):
    ref_losses, ref_params, _ = _run(tmp_path, *LAYOUTS[0])
    assert len(ref_losses) == STEPS
    assert any(".experts.w1" in k for k in ref_params) and "output.weight" in ref_params
    for layout in LAYOUTS[1:]:
        losses, params, metrics = _run(tmp_path, *layout)
        name = "W=%d D=%d E_p=%d P=%d %s" % layout[:5]
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, name=f"{name} losses")
        assert sorted(params) == sorted(ref_params), f"{name}: parameter names differ"
        for key, ref in ref_params.items():
            if torch.is_tensor(ref) and ref.is_floating_point():
                assert_close(params[key], ref, rtol=1e-5, atol=1e-6, name=f"{name} {key}")
        if layout[4] == "pipelined_llep":  # the run really chunked and relocated
            assert all(m["moe_num_chunks"] > 1 and m["moe_relocated_routes"] > 0 for m in metrics)


@pytest.mark.slow
def test_resume_is_exact_with_sharded_experts_and_vocab(tmp_path):
    """DCP saves and restores the group-sharded DTensors (experts over E_p, projection over P)."""
    common = ["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "1", "--debug.seed", "5",
              "--training.local_batch_size", "2", "--mop.layout.seq_degree", "2",
              "--mop.layout.expert_degree", "4", "--mop.layout.vocab_degree", "2",
              "--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget", "24",
              "--mop.moe.min_tokens_per_gemm", "8", "--metrics.no-enable-tensorboard",
              "--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "4"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    check_ok(run_train([*common, "--training.steps", "4", "--job.dump_folder", straight], nproc=4, timeout=300))
    check_ok(run_train([*common, "--training.steps", "2", "--job.dump_folder", resumed], nproc=4, timeout=300))
    proc = run_train([*common, "--training.steps", "4", "--job.dump_folder", resumed], nproc=4, timeout=300)
    check_ok(proc)
    assert "resumed from step 2" in proc.stdout
    want = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(straight)][2:]
    got = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(resumed)][2:]
    assert got == want, f"resumed {got} != straight {want}"
