"""[mop.offload_adamw] host_init (mop_train.train.build.init_pieces_to_host): a model initialised shard by
shard is initialised one piece at a time and its values kept on the host, with the values, losses and
parameters of the plain path (`module.to_empty(device)` + `init_weights`) bit for bit.

CPU, gloo, the debug model forced to per-shard initialisation (HOST_INIT_MAX_PARAMS = 0, as for a model
over 2B parameters), stream/stream and bf16/device, bf16 compute, at W=1, at W=3 (uneven, padded FSDP2
shards) and at (W=4, D=2, E_p=2, P=2):
every parameter's local values right after the build, then the losses, gradient norms and final
parameters of 2 steps, host_init on against off. Where the values live (the host, one piece on the
device at a time) is a CUDA matter: tests/train/test_host_init_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG

pytestmark = pytest.mark.slow
STEPS = 2
COMMON = ["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
          "--training.seq_len", "64", "--training.global_batch_size", "4", "--checkpoint.no-enable",
          "--lr_scheduler.total_steps", "3", "--lr_scheduler.warmup_steps", "1", "--optimizer.name",
          "OffloadStreamAdamW", "--mop.offload_adamw.bucket_params", "3000", "--training.mixed_precision_param",
          "bfloat16"]
STREAM = ["--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients", "stream"]
SETTINGS = (("stream", "stream"), ("bf16", "device"))  # (weights, gradients)
LAYOUTS = {1: ["--training.local_batch_size", "2", "--mop.moe.dispatch", "ep"],
           3: ["--training.local_batch_size", "1", "--training.global_batch_size", "6", "--mop.moe.dispatch", "ep"],
           4: ["--training.local_batch_size", "1", "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2",
               "--mop.layout.vocab_degree", "2", "--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget",
               "12", "--mop.moe.min_tokens_per_gemm", "4", "--mop.moe.imbalance_threshold", "1.0"]}


def _worker(rank, world, root, seed):
    import mop_train.train.build as build
    from torchtitan.tools.logging import logger
    logger.setLevel("ERROR")
    build.HOST_INIT_MAX_PARAMS = 0  # per-shard initialisation, as for a large model
    device = torch.device("cpu")
    for weights, gradients in SETTINGS:
        _compare(rank, world, root, seed, weights, gradients, device)


def _compare(rank, world, root, seed, weights, gradients, device):
    import mop_train.train.build as build
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from tests.train.offload_steps import drive
    from tests.utils import assert_bitwise_equal
    results = {}
    for host_init in (False, True):
        name = "host" if host_init else "device"
        cfg = load_job_config([*COMMON, *LAYOUTS[world], "--debug.seed", str(seed), "--training.steps", str(STEPS),
                               "--job.dump_folder", os.path.join(root, f"{weights}-{gradients}-{name}"),
                               "--mop.offload_adamw.weights", weights, "--mop.offload_adamw.gradients", gradients,
                               "--mop.offload_adamw." + ("host_init" if host_init else "no-host_init")],
                              model_flavors=zoo.names())
        run = build.build_run(cfg, device)
        assert run.parts.init_mode == "per-shard", run.parts.init_mode
        opt = run.optimizers.optimizers[0]
        built = [p.to_local().detach().clone() for p in run.parts.module.parameters()]
        out = drive(cfg, run, device, STEPS)
        opt.wait_for_weights()
        final = [p.to_local().detach().clone() for p in run.parts.module.parameters()]
        results[name] = (built, torch.stack([torch.stack(o) for o in out]), final)
    (b0, o0, f0), (b1, o1, f1) = results["device"], results["host"]
    where = f"rank {rank}, {weights}/{gradients}"
    assert len(b0) == len(b1) and len(f0) == len(f1)
    for i, (a, b) in enumerate(zip(b1, b0)):
        assert_bitwise_equal(a, b, name=f"{where}: parameter {i} as built")
    assert_bitwise_equal(o1, o0, name=f"{where}: (loss, grad norm) per step")
    for i, (a, b) in enumerate(zip(f1, f0)):
        assert_bitwise_equal(a, b, name=f"{where}: parameter {i} after {STEPS} steps")


@pytest.mark.parametrize("world", [1, 3, 4])  # 3: uneven FSDP2 shards (padded)
def test_host_init_gives_the_plain_initialisation_bit_for_bit(tmp_path, world):
    from tests.utils import fresh_seed
    run_distributed(_worker, world, str(tmp_path), fresh_seed() % 10_000, timeout_s=900)


def test_init_pieces_cover_every_parameter_in_init_weights_order():
    """`init_pieces` yields every parameter once, and running its initialisers in order draws the same
    numbers as `init_weights` (the per-piece materialisation relies on both)."""
    from mop_train.models import zoo
    from mop_train.models.model import MoETransformer
    args = zoo.get_model_args("debug")
    with torch.device("meta"):
        model = MoETransformer(args)
    pieces = list(model.init_pieces(buffer_device="cpu"))
    held = [id(p) for piece, _ in pieces for p in piece.parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters()) and len(held) == len(set(held))
    plain, piecewise = zoo.build_model("debug"), zoo.build_model("debug")
    from tests.utils import fresh_seed
    seed = fresh_seed(1)
    torch.manual_seed(seed)
    plain.init_weights(buffer_device="cpu")
    torch.manual_seed(seed)
    for _, init in piecewise.init_pieces(buffer_device="cpu"):
        init()
    for (name, a), b in zip(plain.named_parameters(), piecewise.parameters()):
        assert torch.equal(a, b), name


def test_host_init_needs_weights_kept_off_the_device():
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    with pytest.raises(ValueError, match="host_init = true keeps the parameters' values on the host"):
        load_job_config([*COMMON, "--mop.offload_adamw.host_init"], model_flavors=zoo.names())
