"""[mop.offload_adamw] weights and gradients, through the real training loop (CPU, gloo): every
combination is bitwise the run of weights = "device", gradients = "device" (issue 32).

Under the fp32 and the bf16 policy, at W=1 and at (W=4, D=2, E_p=2, P=2, PipelinedLLEP with
chunks), with two micro-batches per step: each combination trains 2 steps with checkpoints at steps
1 and 2 (step 2 follows a step and a mid-run save); its per-step losses and gradient norms and both
checkpoints (every tensor: model, optimizer, schedule, data position, RNG) are bitwise those of
device/device. From device/device's step-1 checkpoint (W=1: fp32 and bf16; W=4: bf16), runs resumed
with weights = "bf16" and "stream" (the setting changed at the resume) repeat its step 2, and their
step-2 checkpoints are those of a device/device resume (not of the straight run: a resumed run's
torch CPU RNG state differs at its next checkpoint, device/device too, a behaviour that predates
these settings). The W=4 checkpoint, resumed at W=2 (E_p=2, the same two sequence groups), gives the
same bits with device/device and with stream/stream. At W=3 FSDP2's shards are uneven (the debug
model's dims are not multiples of 3: padded shards, the window's slots hold them): stream/stream, and
the device and CPU shares beside the streams (cuts at other places than the buckets'; the CPU share reads
streamed gradients in host memory), are device/device there too, and so is the first buckets' state
staged during the last backward (stage_in_backward), paced by the units' backward (one bucket after each
unit's, `pace_staging`).
Each world runs all its cases in one spawn (`train` called in process); the checkpoints are read
back here with DCP's own reader, in memory (no torch.save copy of each).
"""

from __future__ import annotations

import json
import os
import shutil
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG

pytestmark = pytest.mark.slow
STEPS = 2
SAVED = 1  # the checkpoint the resumes start from
BASE = ["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
        "--debug.seed", "17", "--training.seq_len", "64", "--training.global_batch_size", "4",
        "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.no-last_save_model_only", "--lr_scheduler.total_steps", "3", "--lr_scheduler.warmup_steps", "1",
        "--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.bucket_params", "3000",
        "--mop.offload_adamw.weight_window", "2"]
WIDE = ["--training.local_batch_size", "1", "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2",
        "--mop.layout.vocab_degree", "2", "--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget", "12",
        "--mop.moe.min_tokens_per_gemm", "4", "--mop.moe.imbalance_threshold", "1.0"]
NARROW = ["--training.local_batch_size", "1", "--mop.layout.expert_degree", "2", "--mop.moe.dispatch", "ep"]
ONE = ["--training.local_batch_size", "2", "--mop.moe.dispatch", "ep"]
POLICY = {"fp32": ["--training.mixed_precision_param", "float32"],
          "bf16": ["--training.mixed_precision_param", "bfloat16"]}


def _setting(weights: str, gradients: str) -> list[str]:
    return ["--mop.offload_adamw.weights", weights, "--mop.offload_adamw.gradients", gradients]


def _combos(policy: str) -> list[tuple[str, str]]:
    weights = ("device", "bf16", "stream") if policy == "bf16" else ("device", "stream")
    return [(w, g) for w in weights for g in ("device", "stream")]


def _train(folder: str, args: list[str], steps: int = STEPS) -> None:
    from mop_train.config import load_job_config  # (first: a CPU install has no triton; see optional_triton)
    from mop_train.models import zoo
    from mop_train.train.loop import train
    from mop_train.train.reliability import StopFlag
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    cfg = load_job_config([*BASE, *args, "--training.steps", str(steps), "--job.dump_folder", folder],
                          model_flavors=zoo.names())
    train(cfg, torch.device("cpu"), StopFlag())


def _resume(source: str, folder: str, args: list[str]) -> None:
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(folder, "checkpoint"))
        step = f"step-{SAVED}"
        shutil.copytree(os.path.join(source, "checkpoint", step), os.path.join(folder, "checkpoint", step))
    dist.barrier()
    _train(folder, args)


def _world_worker(rank, world, root, layout, plan, resharded_from):
    if resharded_from:  # the wide layout's step-1 checkpoint at this (narrower) world
        for name, setting in (("dd", _setting("device", "device")), ("ss", _setting("stream", "stream"))):
            _resume(resharded_from, os.path.join(root, f"resharded-{name}"), [*layout, *POLICY["bf16"], *setting])
        return
    for policy, resumed in plan:
        for w, g in _combos(policy):
            _train(os.path.join(root, f"{policy}-{w}-{g}"), [*layout, *POLICY[policy], *_setting(w, g)])
        ref = os.path.join(root, f"{policy}-device-device")
        for w, g in resumed:
            _resume(ref, os.path.join(root, f"{policy}-resumed-{w}-{g}"), [*layout, *POLICY[policy], *_setting(w, g)])


RESUMED = [("device", "device"), ("stream", "stream")]
AT_W1 = [("fp32", RESUMED), ("bf16", RESUMED + [("bf16", "stream")])]
AT_W4 = [("fp32", []), ("bf16", RESUMED)]  # (the resharded resume loads this layout's checkpoint too)


def _metrics(folder: str) -> list[tuple]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f)]


def _tensors(state, prefix="") -> dict:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensors(value, f"{prefix}.{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _tensors(value, f"{prefix}.{i}").items()}
    return {}


@lru_cache(maxsize=8)  # (a reference is compared with several runs)
def _checkpoint(folder: str, step: int) -> dict:
    """Every tensor of a DCP checkpoint, as DCP's own reader assembles it (dcp_to_torch_save's load)."""
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(os.path.join(folder, "checkpoint", f"step-{step}")),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return _tensors(state)


def _assert_same_checkpoint(folder: str, ref: str, step: int, name: str) -> None:
    ours, theirs = _checkpoint(folder, step), _checkpoint(ref, step)
    assert sorted(ours) == sorted(theirs), f"{name} step {step}: checkpoint keys differ"
    assert any(".experts.w1" in k for k in ours) and any("exp_avg_sq" in k for k in ours)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), f"{name} step {step}: {key} differs"


def _check_world(root: str, plan) -> None:
    for policy, resumed in plan:
        ref = os.path.join(root, f"{policy}-device-device")
        want = _metrics(ref)
        assert [m[0] for m in want] == list(range(1, STEPS + 1))
        for w, g in _combos(policy)[1:]:
            folder, name = os.path.join(root, f"{policy}-{w}-{g}"), f"{policy} weights={w} gradients={g}"
            assert _metrics(folder) == want, f"{name}: {_metrics(folder)} != {want}"
            for step in (SAVED, STEPS):
                _assert_same_checkpoint(folder, ref, step, name)
        resumed_ref = os.path.join(root, f"{policy}-resumed-device-device")
        for w, g in resumed:
            folder, name = os.path.join(root, f"{policy}-resumed-{w}-{g}"), f"{policy} resumed with {w}/{g}"
            assert _metrics(folder) == want[SAVED:], f"{name}: {_metrics(folder)} != {want[SAVED:]}"
            _assert_same_checkpoint(folder, resumed_ref, STEPS, name)


def test_every_setting_is_bitwise_device_device_at_w1(tmp_path):
    run_distributed(_world_worker, 1, str(tmp_path), ONE, AT_W1, None, timeout_s=900)
    _check_world(str(tmp_path), AT_W1)


UNEVEN = ["--training.local_batch_size", "1", "--training.global_batch_size", "6", "--mop.moe.dispatch", "ep"]


UNEVEN_RUNS = {  # name: overrides beside UNEVEN and the bf16 policy; "dd" is the reference
    "dd": _setting("device", "device"), "ss": _setting("stream", "stream"),
    # the shares cut the uneven shards at other places than the buckets do (buckets.PIECE_ALIGN)
    "ss-share": [*_setting("stream", "stream"), "--mop.offload_adamw.device_fraction", "0.5",
                 "--mop.offload_adamw.overlap"],
    "bd-shares": [*_setting("bf16", "device"), "--mop.offload_adamw.device_fraction", "0.3",
                  "--mop.offload_adamw.host_fraction", "0.3"],
    # the CPU share reading (and clipping) the streamed gradients in host memory, beside streamed or bf16 weights
    "ss-host": [*_setting("stream", "stream"), "--mop.offload_adamw.host_fraction", "0.4"],
    "bs-shares": [*_setting("bf16", "stream"), "--mop.offload_adamw.device_fraction", "0.2",
                  "--mop.offload_adamw.host_fraction", "0.3", "--mop.offload_adamw.overlap"],
    # the first buckets' state staged before the step's last backward (stage_in_backward), two micro-batches
    "ss-staged": [*_setting("stream", "stream"), "--mop.offload_adamw.stage_in_backward", "--mop.offload_adamw.slots", "2"],
    "dd-staged-share": [*_setting("device", "device"), "--mop.offload_adamw.stage_in_backward",
                        "--mop.offload_adamw.device_fraction", "0.25", "--mop.offload_adamw.overlap"]}


def _uneven_worker(rank, world, root):
    from mop_train.ops.offload_adamw import OffloadStreamAdamW
    begin, stage_next, step = OffloadStreamAdamW.begin_staging, OffloadStreamAdamW._stage_next, OffloadStreamAdamW.step
    staged, paced = [], []

    def counted_begin(opt):  # the loop arms the staging once per step, and each step consumed the last one
        staged.append([opt._early is None, 0, 0])
        begin(opt)

    def counted_stage_next(opt, count):  # a unit's backward staging its run of buckets
        before = len(opt._early)
        stage_next(opt, count)
        paced.append(len(opt._early) - before)

    def counted_step(opt, *args, **kwargs):  # what the step found staged, and by how many of the units' backward
        if staged:
            staged[-1][1:] = [len(opt._early or []), sum(1 for n in paced if n)]
        paced.clear()
        return step(opt, *args, **kwargs)

    OffloadStreamAdamW.begin_staging, OffloadStreamAdamW._stage_next = counted_begin, counted_stage_next
    OffloadStreamAdamW.step = counted_step
    try:
        for name, setting in UNEVEN_RUNS.items():
            staged.clear()
            _train(os.path.join(root, name), [*UNEVEN, *POLICY["bf16"], *setting])
            with open(os.path.join(root, name, f"staged-{rank}.json"), "w") as f:
                json.dump(staged, f)
    finally:
        OffloadStreamAdamW.begin_staging, OffloadStreamAdamW._stage_next = begin, stage_next
        OffloadStreamAdamW.step = step


def test_settings_and_shares_are_bitwise_device_device_at_w3_with_uneven_shards(tmp_path):
    root = str(tmp_path)
    run_distributed(_uneven_worker, 3, root, timeout_s=600)
    ref = os.path.join(root, "dd")
    assert len(_metrics(ref)) == STEPS
    for name in UNEVEN_RUNS:
        ours = os.path.join(root, name)
        assert _metrics(ours) == _metrics(ref), name
        for rank in range(3):
            with open(os.path.join(ours, f"staged-{rank}.json")) as f:
                calls = json.load(f)
            if "staged" in name:  # every slot's bucket staged, by as many units' backward (paced: one each, as
                slots = 2 if name == "ss-staged" else 3   # the debug model's 3 blocks + head outnumber the slots)
                assert calls == [[True, slots, slots]] * STEPS, (name, rank, calls)
            else:
                assert calls == [], (name, rank, calls)
        for step in (SAVED, STEPS):
            _assert_same_checkpoint(ours, ref, step, f"W=3 {name}")


def test_every_setting_is_bitwise_device_device_at_w4_and_resharded(tmp_path):
    wide, narrow = str(tmp_path / "w4"), str(tmp_path / "w2")
    run_distributed(_world_worker, 4, wide, WIDE, AT_W4, None, timeout_s=1200)
    _check_world(wide, AT_W4)
    run_distributed(_world_worker, 2, narrow, NARROW, (), os.path.join(wide, "bf16-device-device"), timeout_s=600)
    want = _metrics(os.path.join(narrow, "resharded-dd"))
    assert [m[0] for m in want] == [STEPS]
    assert _metrics(os.path.join(narrow, "resharded-ss")) == want
    _assert_same_checkpoint(os.path.join(narrow, "resharded-ss"), os.path.join(narrow, "resharded-dd"), STEPS,
                            "resharded")
