"""The host-link bytes OffloadStreamAdamW counts per step (mop_train/ops/offload_adamw/link.py), as
the training loop logs them in metrics.jsonl, equal an account made here from the model's parameter
sizes and the config alone (CPU, gloo, W=1; issue 32's 2 x 4K goal compares a step with the link
floor of these bytes).

The debug model (3 blocks, and 4 for one case; tests/train/offload_steps.py: bf16 compute, 2 micro-batches per step, every block
checkpointed, experts kept out of FSDP2) trains 2 steps under each weights / gradients setting, with
weight_window 2 and 1, with a device share and a CPU share, and with a skipped step (NaN loss). Per step, with N local elements of
P parameters, M micro-batches, L blocks, E MoE blocks, s_w window slots, e_w = 2 (bf16 working bytes):
  optimizer: h2d 12 N_s + 4 P (+ 4 N with gradients = "stream", + 4 N_h uploads with device working
             weights), d2h 12 N_s (+ e_w (N - N_h) with weights = "stream", + 4 N_h gradients of the
             CPU share, + 4 N_h first-update weights at step 1 with weights = "device"), where N_s is
             the streamed part, N_h the CPU share;
  windows:   per micro-batch, FSDP2 gathers every unit (the root and the L blocks, without experts)
             in the forward and blocks 0..L-2 again in backward (the last block and the root stay
             unsharded after the forward; the recompute reuses the unit gathered for backward); the
             expert blocks load E times in the step's first forward and, in each later pass (the
             backward's recompute, the next micro-batch's forward, ...: 2M - 1 passes), every block
             but the min(s_w, E) the previous pass left in the window (after a skipped step, whose
             update did not change the working weights, the first forward is such a pass too);
  a skipped step: the optimizer's part is 0 (its account is closed without an update);
  gradients: every gradient leaves after each micro-batch's backward (4 N d2h each) and is read
             back before the next one's sum (4 N h2d from the second micro-batch on).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow
GIB = 2**30
E_W = 2        # bf16 working weights
M = 2          # micro-batches per step (tests/train/offload_steps.py: global batch 4 of local batch 2)
SHARE = ("--mop.offload_adamw.host_fraction", "0.5", "--mop.offload_adamw.device_fraction", "0.25")
CASES = {  # name: (weights, gradients, weight_window, extra overrides, step whose loss is made NaN (skipped), L)
    "dd": ("device", "device", 2, (), None, 3), "ds": ("device", "stream", 2, (), None, 3),
    "bd": ("bf16", "device", 2, (), None, 3), "bs": ("bf16", "stream", 2, (), None, 3),
    "sd": ("stream", "device", 2, (), None, 3), "ss": ("stream", "stream", 2, (), None, 3),
    "ss-w1": ("stream", "stream", 1, (), None, 3), "ss-skip": ("stream", "stream", 2, (), 1, 3),
    "ss-4blocks": ("stream", "stream", 2, (), None, 4),  # E = 3 MoE blocks > s_w: loads in every pass
    "dd-share": ("device", "device", 2, SHARE, None, 3), "sd-share": ("stream", "device", 2, SHARE, None, 3),
}


def _worker(rank, world, root):
    from tests.train.offload_steps import offload_config
    from mop_train.train.loop import train
    from mop_train.train.reliability import StopFlag
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    for name, (weights, gradients, window, extra, skipped, layers) in CASES.items():
        cfg = offload_config(os.path.join(root, name), weights=weights, gradients=gradients, window=window,
                             steps=2, extra=extra)
        if skipped:
            os.environ["MOP_TRAIN_FAULT"] = f"nan_loss:{skipped}:0"
        try:
            train(cfg, torch.device("cpu"), StopFlag(), model_args=_args(layers))
        finally:
            os.environ.pop("MOP_TRAIN_FAULT", None)


def _args(layers: int):
    from mop_train.models import zoo
    return replace(zoo.get_model_args("debug"), n_layers=layers)


def _structure(layers: int):
    """(numel per parameter in the optimizer's flat order, non-expert numel per FSDP2 unit [root, block 0,
    ...], numel per MoE block's experts), read off the debug model's parameters (at W=1 a shard is the
    whole parameter; the flat order is the forward's: the embedding, the blocks, then norm and projection,
    the order the model registers them)."""
    from mop_train.models import zoo
    model = zoo.build_model(_args(layers), device="meta")
    units, experts = [0] * (layers + 1), {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if ".experts." in name:
            experts[int(parts[1])] = experts.get(int(parts[1]), 0) + p.numel()
        else:
            units[int(parts[1]) + 1 if parts[0] == "layers" else 0] += p.numel()
    return [p.numel() for p in model.parameters()], units, [experts[k] for k in sorted(experts)]


def _expected(weights, gradients, window, extra, skipped, layers, step):
    from mop_train.ops.offload_adamw.buckets import device_cut
    from mop_train.ops.offload_adamw.host_update import host_cut
    numels, units, experts = _structure(layers)
    total, n_params, shared = sum(numels), len(numels), bool(extra)
    n_dev = device_cut(numels, 0.25) if shared else 0           # the shares' cuts (lane-aligned)
    n_host = total - host_cut(numels, n_dev, 0.5) if shared else 0
    n_streamed = total - n_dev - n_host
    h2d, d2h = {}, {}
    stale = skipped != step - 1  # the last step changed the working weights (a skipped step did not)
    h2d["optimizer"] = 12 * n_streamed + 4 * n_params + (4 * total if gradients == "stream" else 0) \
        + (4 * n_host if weights != "stream" else 0)
    d2h["optimizer"] = 12 * n_streamed + (E_W * (total - n_host) if weights == "stream" else 0) + 4 * n_host \
        + (4 * n_host if weights == "device" and step == 1 else 0)
    if weights == "stream":
        assert len(set(experts)) == 1, "the expert blocks' loads are counted as equal-sized"
        E = len(experts)
        kept = E - min(window, E)  # loads in a pass that follows another
        expert_loads = (E if stale else kept) + kept * (2 * M - 1)
        per_micro = sum(units) + sum(units[1:-1])  # forward: every unit; backward: blocks 0..L-2
        h2d["windows"] = E_W * (M * per_micro + expert_loads * experts[0])
    else:
        h2d["windows"] = 0
    d2h["windows"] = 0
    h2d["gradients"] = 4 * total * (M - 1) if gradients == "stream" else 0
    d2h["gradients"] = 4 * total * M if gradients == "stream" else 0
    if skipped == step:  # no update: the step moved nothing of its own
        h2d["optimizer"] = d2h["optimizer"] = 0
    return h2d, d2h


def test_logged_link_bytes_match_an_account_from_the_config(tmp_path):
    run_distributed(_worker, 1, str(tmp_path), timeout_s=900)
    losses = {}
    for name, (weights, gradients, window, extra, skipped, layers) in CASES.items():
        with open(tmp_path / name / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        assert [r["step"] for r in records] == [1, 2], name
        assert [r["skipped"] for r in records] == [r["step"] == skipped for r in records], name
        for r in records:
            h2d, d2h = _expected(weights, gradients, window, extra, skipped, layers, r["step"])
            for source in h2d:
                got = (r[f"offload_h2d_gib_{source}"] * GIB, r[f"offload_d2h_gib_{source}"] * GIB)
                assert got == (h2d[source], d2h[source]), f"{name} step {r['step']} {source}: {got} bytes " \
                                                         f"(h2d, d2h), expected {(h2d[source], d2h[source])}"
            assert r["offload_h2d_gib"] * GIB == sum(h2d.values()), name
            assert r["offload_d2h_gib"] * GIB == sum(d2h.values()), name
        losses[name] = [r["loss"] for r in records]
    # The same model and data under every setting (the 4-block one aside; a skipped step is no step):
    # the settings move bytes, never bits, one window slot included.
    for name, (*_, skipped, layers) in CASES.items():
        if layers == 3 and skipped is None:
            assert losses[name] == losses["dd"], (name, losses[name], losses["dd"])
