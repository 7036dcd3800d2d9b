"""torchtitan's `[parallelism] fsdp_reshard_after_forward` ("default" | "always" | "never") as the loop honours
it (mop_train/parallel/parallelize.py `block_reshard_after_forward`, `apply_fsdp`), and as the memory plan
counts it (mop_train/plan/terms.py's `gathered` line).

- Exact: at (W=2, D=1, E_p=2; experts kept out of FSDP2, bf16 compute, two micro-batches a step, every
  block checkpointed) and at W=1 with no checkpointing, each policy trains 3 steps of the debug model from
  one seed: the losses, gradient norms and final parameters are bitwise those of "default". Resharding moves
  no value: the same bf16 casts of the same fp32 shards are gathered, once or twice.
- What FSDP2 really holds: at the final norm's forward (the head unit's first module, after every block's
  forward) "never" has every block unsharded, "default" only the last, "always" none; and the plan's
  `gathered` line at the loss is the sum of all blocks' parameters in bf16 under "never", two blocks otherwise.
- Refused by name: "never" with [mop.offload_adamw] weights = "stream" (its window holds 2 blocks).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG

POLICIES = ("default", "always", "never")
STEPS = 3
CASES = {  # name -> (world, flags)
    "w2_ep_ckpt": (2, ["--mop.layout.expert_degree", "2", "--mop.moe.dispatch", "ep",
                       "--training.local_batch_size", "1", "--training.global_batch_size", "4",
                       "--activation_checkpoint.mode", "full"]),
    "w1_plain": (1, ["--mop.moe.dispatch", "local", "--training.local_batch_size", "2",
                     "--activation_checkpoint.mode", "none"]),
}


def _config(folder: str, policy: str, flags: list[str]):
    import torch.distributed as dist

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    return load_job_config(["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "1",
                            "--metrics.no-enable-tensorboard", "--training.seq_len", "64",
                            "--training.mixed_precision_param", "bfloat16", "--checkpoint.no-enable",
                            "--lr_scheduler.total_steps", str(STEPS), "--lr_scheduler.warmup_steps", "1",
                            "--debug.seed", str(int(os.environ.get("RESHARD_TEST_SEED", "23"))),
                            "--training.steps", str(STEPS), "--job.dump_folder", folder,
                            "--parallelism.fsdp_reshard_after_forward", policy, *flags],
                           model_flavors=zoo.names(), world_size=dist.get_world_size())


def _unsharded_at_head(run):
    """(record, hook handle): record[0] will say which blocks FSDP2 holds unsharded when the final norm's
    forward starts (first micro-batch)."""
    seen: list[list[bool]] = []
    model = run.parts.model

    def record(_module, _args):
        if not seen:
            seen.append([b._get_fsdp_state()._fsdp_param_group.is_unsharded for b in _fsdp_blocks(model)])
    handle = model.norm.register_forward_pre_hook(record)
    return seen, handle


def _fsdp_blocks(model):
    from torch.distributed.fsdp import FSDPModule
    out = []
    for block in model.layers.values():
        # the FSDP2 unit is the block itself, or the block inside its checkpoint wrapper
        unit = block if isinstance(block, FSDPModule) else next(m for m in block.modules() if isinstance(m, FSDPModule))
        out.append(unit)
    return out


def _worker(rank, world, root):
    import torch.distributed as dist

    from mop_train.train.build import build_run
    from tests.train.offload_steps import drive
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    device = torch.device("cpu")
    for name, (case_world, flags) in CASES.items():
        if case_world != world:
            continue
        results = {}
        for policy in POLICIES:
            cfg = _config(os.path.join(root, f"{name}_{policy}"), policy, flags)
            run = build_run(cfg, device)
            seen, handle = _unsharded_at_head(run)
            steps = drive(cfg, run, device, steps=STEPS)
            handle.remove()
            params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                      for k, v in run.parts.module.state_dict().items() if torch.is_tensor(v) or hasattr(v, "full_tensor")}
            results[policy] = ([(float(loss), float(norm)) for loss, norm in steps], params, seen[0])
            del run
        ref_steps, ref_params, _ = results["default"]
        for policy in POLICIES:
            got_steps, got_params, unsharded = results[policy]
            assert got_steps == ref_steps, f"{name} {policy}: steps {got_steps} != default's {ref_steps}"
            assert sorted(got_params) == sorted(ref_params)
            for key, value in ref_params.items():
                assert torch.equal(got_params[key], value), f"{name} {policy}: final {key} differs from default's"
            want = {"default": [False] * (len(unsharded) - 1) + [True], "always": [False] * len(unsharded),
                    "never": [True] * len(unsharded)}[policy]
            assert unsharded == want, f"{name} {policy}: blocks unsharded at the head's forward {unsharded}, want {want}"
        assert all(loss > 0 for loss, _ in ref_steps)
    dist.barrier()


@pytest.mark.slow
def test_every_reshard_policy_trains_bitwise_as_the_default_and_holds_what_it_says(tmp_path):
    for world in sorted({w for w, _ in CASES.values()}):
        run_distributed(_worker, world, str(tmp_path), timeout_s=600)


def test_block_policy_is_torchtitans():
    from mop_train.parallel.parallelize import block_reshard_after_forward
    assert [block_reshard_after_forward("default", i, 3) for i in range(3)] == [True, True, False]
    assert [block_reshard_after_forward("always", i, 3) for i in range(3)] == [True] * 3
    assert [block_reshard_after_forward("never", i, 3) for i in range(3)] == [False] * 3
    with pytest.raises(ValueError, match="must be one of"):
        block_reshard_after_forward("sometimes", 0, 3)


def _plan(policy: str, *extra: str):
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.job import plan_for_config
    from tests.train.cli import REPO
    cfg = load_job_config(["--job.config_file", os.path.join(REPO, "configs", "small_1gpu.toml"),
                           "--training.seq_len", "4096", "--training.local_batch_size", "2",
                           "--parallelism.fsdp_reshard_after_forward", policy, *extra], model_flavors=zoo.names())
    return plan_for_config(cfg, world=1, ranks_per_node=1, host_bytes=128 * 2**30)


def test_plan_counts_every_block_gathered_under_never():
    from mop_train.models import zoo
    from mop_train.models.model import MoETransformer
    from mop_train.plan.job import fsdp_block_params
    with torch.device("meta"):
        model = MoETransformer(zoo.get_model_args("small"))
    blocks = [fsdp_block_params(b, set()) for b in model.layers.values()]   # dispatch "local": all in FSDP2
    assert len(set(blocks)) > 1                                              # dense first block, MoE blocks
    # Gradients streamed out: the peak is the loss, where "never" holds every block in bf16 (2 B each)
    streamed = ("--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.weights", "bf16",
                "--mop.offload_adamw.gradients", "stream")
    plans = {p: _plan(p, *streamed) for p in POLICIES}
    lines = {p: {n: (b, how) for n, b, how in plan.device_terms} for p, plan in plans.items()}
    assert lines["default"]["gathered"] == lines["always"]["gathered"]
    assert "at the peak (loss)" in lines["never"]["gradients"][1]
    assert lines["never"]["gathered"][0] - lines["default"]["gathered"][0] == 2 * (sum(blocks) - 2 * max(blocks))
    assert "every block" in lines["never"]["gathered"][1]
    # Gradients kept on the device: the peak is the last block's backward, where every block but it and the
    # prefetched one has been resharded and its fp32 gradient (twice the bf16 weights) has taken its place
    kept = {p: _plan(p) for p in ("default", "never")}
    assert kept["never"].device_terms == kept["default"].device_terms
    assert "at the peak (last block backward)" in dict((n, h) for n, _, h in kept["never"].device_terms)["gradients"]


def test_never_with_streamed_weights_is_refused_by_name():
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward = 'never'.*weights = 'stream'"):
        _plan("never", "--optimizer.name", "OffloadStreamAdamW", "--mop.offload_adamw.weights", "stream")
