"""FSDP2's units of the MoE decoder as gradients = "stream" meets them and as the memory plan counts them
(issue 32's fifth peak; mop_train/parallel/parallelize.py `apply_fsdp`: the token embedding, each block,
the head [final norm, output projection], a root with no parameters of its own, torchtitan's units).

- Through the loop's `train_step` (CPU, gloo, W=1; tests/train/offload_steps.py: the debug model, bf16,
  2 micro-batches, every block checkpointed, weights and gradients streamed): in each micro-batch's
  backward the GradientStream's arrivals put the head's gradients before every parameter of the last
  block (the first block to run backward: the head's gradient has left before that block's backward
  ends) and the embedding's after every block's (it forms at the very end); FSDP2 holds the units
  above, and the root unit none.
- On paper, `small` at 524,288 tokens with every operator (the issue's command): with gradients =
  "stream" the gradients line at the peak (a block's backward) is the streaming's staging alone,
  `gradients_bound` with nothing retained, where the root unit's 4 B x 614,401,536 were counted before;
  with gradients on the device the same phase counts the head unit's gradients, not the embedding's.
"""

from __future__ import annotations

import os

import pytest

from tests.dist_utils import run_distributed
from tests.train.cli import REPO

SMALL_524K = ["--training.seq_len", "524288", "--training.local_batch_size", "1", "--mop.moe.dispatch",
              "pipelined_llep", "--mop.ring_dtp.enable", "--mop.sco.host_budget", "8GiB",
              "--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.weights", "stream"]


def _arrivals_worker(rank, world, root):
    import torch
    from torch.distributed.fsdp import FSDPModule

    from mop_train.train.build import build_run
    from tests.train.offload_steps import drive, offload_config
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    device = torch.device("cpu")
    cfg = offload_config(os.path.join(root, "ss"), weights="stream", gradients="stream", steps=1)
    run = build_run(cfg, device)
    module, model = run.parts.module, run.parts.model
    units = {id(m._get_fsdp_state()): m._get_fsdp_state() for m in module.modules() if isinstance(m, FSDPModule)}
    held = [tuple(type(m).__name__.removeprefix("FSDP") for m in s._modules) for s in units.values()
            if s._fsdp_param_group is not None]
    assert held[0] == ("Embedding",) and held[-1] == ("RMSNorm", "OutputProjection"), held
    assert len(held) == len(model.layers) + 2, held                  # and one unit per block between them
    assert module._get_fsdp_state()._fsdp_param_group is None, "the root unit holds no parameters"

    drive(cfg, run, device, steps=1)
    opt = run.optimizers.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(opt._params[i])] for i in opt.grad_stream.log]
    last = f"model.layers.{len(model.layers) - 1}."
    per_micro = len(order) // run.micro_batches
    assert per_micro * run.micro_batches == len(order) and per_micro == len(names), (len(order), len(names))
    for k in range(run.micro_batches):
        arrived = order[k * per_micro:(k + 1) * per_micro]
        first_block = min(i for i, n in enumerate(arrived) if n.startswith(last))
        head = [i for i, n in enumerate(arrived) if n in ("model.norm.weight", "model.output.weight")]
        blocks_done = max(i for i, n in enumerate(arrived) if n.startswith("model.layers."))
        assert len(head) == 2 and max(head) < first_block, (k, arrived)
        assert arrived.index("model.tok_embeddings.weight") > blocks_done, (k, arrived)
    assert opt.grad_stream.stats["left"] == len(order)


@pytest.mark.slow
def test_streamed_head_gradient_leaves_before_the_first_block_backward_ends(tmp_path):
    run_distributed(_arrivals_worker, 1, str(tmp_path))


def _plan(gradients: str):
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.job import plan_for_config
    cfg = load_job_config(["--job.config_file", os.path.join(REPO, "configs", "small_1gpu.toml"), *SMALL_524K,
                           "--mop.offload_adamw.gradients", gradients], model_flavors=zoo.names())
    return plan_for_config(cfg, world=1, ranks_per_node=1, host_bytes=128 * 2**30)


def test_streamed_gradients_line_at_the_peak_holds_no_root_unit_gradients():
    import torch

    from mop_train.models import zoo
    from mop_train.models.model import MoETransformer
    from mop_train.ops.offload_adamw.memory import StreamSettings, WeightShapes, gradients_bound
    args = zoo.get_model_args("small")
    with torch.device("meta"):
        model = MoETransformer(args)
    embedding, head = model.tok_embeddings.weight.numel(), model.norm.weight.numel() + model.output.weight.numel()
    kept = {id(p) for moe in model.moe_layers() for p in moe.experts.parameters()}
    unit = max(sum(p.numel() for p in b.parameters() if id(p) not in kept) for b in model.layers.values())
    block = max(sum(p.numel() for p in moe.experts.parameters()) for moe in model.moe_layers())
    streamed, kept_on_device = ({n: (b, how) for n, b, how in _plan(g).device_terms} for g in ("stream", "device"))
    grads, how = streamed["gradients"]
    assert "block backward)" in how, how                               # the peak: a block's backward
    shapes = WeightShapes(sum(p.numel() for p in model.parameters()), unit, block, 0, 2)
    assert grads == gradients_bound(StreamSettings("stream", "stream"), shapes, device_grads=0,
                                    retained_grads=0).device_bytes == 4 * (2 * unit + block)
    assert grads < 4 * (embedding + head)                               # what the root unit held before
    assert streamed["gathered"][0] == 2 * unit * 2                      # two blocks; head resharded, no root
    assert "(first block backward)" in kept_on_device["gradients"][1]  # gradients kept: the head's alone
    assert kept_on_device["gradients"][0] == 4 * head
