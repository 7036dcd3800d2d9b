"""Regressions of `--comm.mode fake_backend` (mop_train.parallel.fake_world) found by probing it.

- the logged max routes any destination received per chunk (moe_max_received_per_chunk) is the
  identical world's, not this rank's own: the stats' MAX all-reduce stands in with the local value,
  so a fake rank of LLEP / pipelined LLEP (balanced: 42 for the real 43 at W=4) and of EP under a
  skewed profile hot on another rank's experts reported its own receipts;
- tokens/s, TFLOP/s, MFU, tokens_seen and validation/tokens count the world's tokens (W x this rank's),
  not this rank's alone (the count all-reduce stands in with the local value: W times too few), and the
  fake rank prints its validation line (it is its own log) with the mode's note;
- a missing WORLD_SIZE is named before the layout meets a world of 1 rank; `mop-train train` (torchrun's
  launcher) refuses the mode before it launches anything.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics
from tests.train.test_fake_world import _argv, _fake_cli, run_alone


def _peaks(argv: list[str], out_path: str, profile_at: int | None) -> None:
    """One training step of `argv` in this process's world; writes this rank's per-layer receipts and
    the per-chunk max over destinations the stats report."""
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.parallel.apply import dispatch_metrics
    from mop_train.parallel.fake_world import apply_routing_profile
    from mop_train.train.build import build_run
    from mop_train.train.loop import StepGuards, train_step
    from mop_train.train.reliability import NonFiniteGuard, StopFlag

    cfg = load_job_config(argv, model_flavors=zoo.names())
    device = torch.device("cpu")
    run = build_run(cfg, device)
    if profile_at is not None:   # the hot experts on expert-group position `profile_at`, on every rank
        apply_routing_profile(run.parts.model, cfg.mop.moe.routing_profile, expert_position=profile_at,
                              expert_degree=run.layout.expert_size)
    guards = StepGuards(NonFiniteGuard(cfg.mop.reliability, rank=dist.get_rank(), world=dist.get_world_size(),
                                       device=device), StopFlag(), run.schedule_steps)
    train_step(run.parts, run.layout, [next(iter(run.dataloader))], run.optimizers, run.lr_schedulers,
               max_norm=cfg.training.max_norm, bias_rate=cfg.mop.moe.bias_update_rate, device=device,
               guards=guards, step=1)
    layers = [{"received": m.dispatch.stats.chunk_received, "peak": m.dispatch.stats.chunk_max_received}
              for m in run.parts.model.moe_layers()]
    with open(out_path, "w") as f:
        json.dump({"layers": layers, "metrics": dispatch_metrics(run.parts.model)}, f)


def _real(rank, world_size, argv, out_dir, profile_at):
    _peaks(argv, os.path.join(out_dir, f"real{rank}.json"), profile_at)


def _fake(world_size, rank, argv, out_path, profile_at):
    from mop_train.parallel.fake_world import init_fake_world

    init_fake_world(world_size, rank, torch.device("cpu"))
    _peaks(argv + ["--comm.mode", "fake_backend"], out_path, profile_at)


PEAKS = [  # (D, P, dispatch, seq_len, extra, routing profile, hot position, fake rank); W = E_p = 4
    pytest.param(2, 2, "pipelined_llep", 120, ["--mop.moe.token_budget", "24", "--mop.moe.imbalance_threshold",
                                               "1.0", "--mop.moe.min_tokens_per_gemm", "4"], "balanced", None, 1,
                 id="pipelined-balanced-rank1"),
    pytest.param(1, 1, "ep", 32, [], "80/4", 2, 1, id="ep-hot-on-rank2-fake-rank1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("D, P, dispatch, seq_len, extra, profile, profile_at, rank", PEAKS)
def test_fake_rank_reports_the_identical_worlds_max_received_per_chunk(tmp_path, D, P, dispatch, seq_len, extra,
                                                                       profile, profile_at, rank):
    W = 4
    args = ["--mop.moe.routing_profile", profile, *extra]
    real = _argv(str(tmp_path / "real"), W, D, W, P, dispatch, seq_len, args)
    run_distributed(_real, W, real, str(tmp_path), profile_at, timeout_s=400)
    fake = _argv(str(tmp_path / "fake"), W, D, W, P, dispatch, seq_len, args)
    run_alone(_fake, W, rank, fake, str(tmp_path / "fake.json"), profile_at)
    got, expected = json.load(open(tmp_path / "fake.json")), json.load(open(tmp_path / f"real{rank}.json"))
    assert [layer["received"] for layer in got["layers"]] == [layer["received"] for layer in expected["layers"]]
    assert [layer["peak"] for layer in got["layers"]] == [layer["peak"] for layer in expected["layers"]]
    assert got["metrics"] == expected["metrics"]
    own = max(max(layer["received"]) for layer in got["layers"])
    assert got["metrics"]["max_received_per_chunk"] > own     # another destination is the busiest one


@pytest.mark.slow
def test_fake_rank_counts_the_worlds_tokens(tmp_path):
    folder = str(tmp_path / "tokens")
    W, D, S, steps = 4, 2, 64, 2
    args = _argv(folder, W, D, W, 1, "ep", S, ["--comm.mode", "fake_backend", "--training.steps", str(steps),
                                              "--metrics.log_freq", "1", "--validation.enable", "--validation.dataset",
                                              "embedded", "--validation.freq", "2", "--validation.steps", "2",
                                              "--validation.seq_len", str(S), "--validation.local_batch_size", "1"])
    out = _fake_cli(args, {"WORLD_SIZE": str(W), "RANK": "3"})
    check_ok(out)
    records = read_metrics(folder)
    per_step = 1 * S * (W // D)                  # local_batch_size x seq_len x sequence groups: every target
    assert [r["tokens_seen"] for r in records] == [per_step * (i + 1) for i in range(steps)]
    for r in records:
        assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / W)
    # validation counts the world's tokens too, and the fake rank (not rank 0) prints its line with the note
    assert records[-1]["validation/tokens"] == 2 * per_step
    line = next(x for x in out.stdout.splitlines() if x.startswith("validation at step 2"))
    assert "fake world W=4 rank 3" in line and "meaningless" in line


def test_fake_launch_names_a_missing_world_size_before_the_layout(tmp_path):
    args = _argv(str(tmp_path / "x"), 4, 1, 4, 1, "ep", 32, ["--comm.mode", "fake_backend"])
    proc = _fake_cli(args, {"RANK": "0"}, timeout=120)
    assert proc.returncode == 2 and "needs WORLD_SIZE set" in proc.stderr, proc.stderr[-2000:]
    proc = _fake_cli(args, {"WORLD_SIZE": "four", "RANK": "0"}, timeout=120)
    assert proc.returncode == 2 and "needs WORLD_SIZE set" in proc.stderr, proc.stderr[-2000:]


def test_mop_train_train_refuses_the_fake_mode_before_launching(tmp_path, capsys):
    from mop_train.cli import main

    code = main(["train", DEBUG_CONFIG, "--comm.mode", "fake_backend", "--checkpoint.no-enable",
                 "--mop.layout.expert_degree", "4", "--mop.moe.dispatch", "ep", "--job.dump_folder", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "python -m mop_train.train" in err and "WORLD_SIZE=W RANK=r" in err, err
