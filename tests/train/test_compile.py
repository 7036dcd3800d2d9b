"""torch.compile ([compile]): each block compiled on its own, our autograd Functions and collectives
left as graph breaks, the loss and every gradient equal to the eager model's.

- In one process (fast): the `debug` model under activation checkpointing, compiled with aot_eager
  (dynamo + AOTAutograd, the graph capture and partitioning inductor also goes through) and with
  inductor (CPU C++), against an identical eager copy on random tokens: loss, every gradient and
  the router's load counters; state-dict names unchanged; compiled graphs really made.
- On 2 gloo ranks (slow): every dispatch schedule (ep, llep, pipelined_llep), with Ulysses, kept
  attention and SCO, through `parallelize` (FSDP2), compiled against eager.
- The training CLI (slow): `debug` at W=1 with inductor, losses of 3 steps against eager (the eager
  reference through the same training function in a spawned rank).
- The settings that cannot compile fail before launch, naming the setting.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from mop_train.config import load_job_config
from mop_train.models import zoo
from mop_train.models.model import MoETransformer, tile_blocks
from mop_train.models.moe import FeedForward
from mop_train.parallel import compile as compile_mod
from mop_train.parallel.compile import EAGER_SUBMODULES, CompileOptions, apply_compile, check_compiler
from mop_train.parallel.parallelize import apply_activation_checkpointing
from mop_train.train.loss import LanguageModelLoss
from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close, assert_close_to_scale, fresh_seed


def _module(seed: int, hot_expert: bool = False) -> LanguageModelLoss:
    """The debug model, seeded. With `hot_expert`, every token's top-k includes expert 0 (a selection bias, as
    the router's balancing bias is applied), so the expert group's first rank holds well over the mean load and
    LLEP must relocate: with random routing alone the excess over the mean is often below `min_tokens_per_gemm`
    and nothing moves (a seed of 2026-12-07's CI did that)."""
    torch.manual_seed(seed)
    model = MoETransformer(zoo.get_model_args("debug"))
    model.init_weights()
    if hot_expert:
        with torch.no_grad():
            for moe in model.moe_layers():
                moe.router.expert_bias[0] += 10.0
    return LanguageModelLoss(model)


def _step(module: nn.Module, tokens: torch.Tensor, labels: torch.Tensor):
    loss = module(tokens, labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    loads = [moe.router.tokens_per_expert.clone() for moe in module.model.moe_layers()]
    for moe in module.model.moe_layers():
        moe.router.tokens_per_expert.zero_()
    return loss.detach(), grads, loads


def _compare_compiled_with_eager(backend: str, seed: int, *, rtol: float, tiles: tuple[int, int] = (0, 0),
                                 device: str = "cpu", new_shape: bool = True) -> None:
    """Two steps of each; the second at a new (B, S) (dynamo recompiles for it: a dynamic-shape graph) or,
    with new_shape=False, at the first's (the compiled code is reused; no graph is made)."""
    rng = random.Random(seed)
    eager = _module(seed).to(device)
    compiled = copy.deepcopy(eager)
    checkpointed = sorted(rng.sample(range(3), 2))                 # one block left unwrapped
    for m in (eager, compiled):
        tile_blocks(m.model, *tiles)                                # [mop.tiling]: before checkpointing
        apply_activation_checkpointing(m.model, checkpointed, preserve_rng_state=True)
    names = list(compiled.state_dict())
    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    apply_compile(compiled, CompileOptions(model=True, loss=True, backend=backend), device_type=device)
    assert list(compiled.state_dict()) == names                     # checkpoints move between the two
    for block in compiled.model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        eager_subs = [inner.get_submodule(p) for p in EAGER_SUBMODULES if hasattr(inner, p.split(".")[0])]
        assert len(eager_subs) == 2 if hasattr(inner, "moe") else len(eager_subs) == 1
        assert all(type(s) in compile_mod._EAGER_CLASSES.values() for s in eager_subs)
        tiled_ffns = [m for m in inner.modules() if isinstance(m, FeedForward) and m.tile_tokens]
        assert len(tiled_ffns) == (1 if tiles[0] else 0)            # the dense FFN or the shared expert
    V = eager.model.args.vocab_size
    shape = (rng.randint(1, 3), rng.choice([16, 24, 32]))
    for call in range(2):
        B, S = (rng.randint(1, 3), rng.choice([16, 24, 32])) if new_shape and call else shape
        if call and not new_shape:
            graphs_after_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).to(device)
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = -100
        want, got = _step(eager, tokens, labels), _step(compiled, tokens, labels)
        assert_close(got[0], want[0], rtol=rtol, atol=0, name=f"{backend} loss")
        for name, grad in want[1].items():
            assert_close_to_scale(got[1][name], grad, rtol=rtol, name=f"{backend} grad {name}")
        for layer, (g, w) in enumerate(zip(got[2], want[2])):       # each route counted once, recompute too
            assert torch.equal(g, w), f"{backend}: router loads of MoE layer {layer} differ: {g} vs {w}"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > graphs_before, "nothing was compiled"
    if not new_shape:
        assert graphs == graphs_after_first, f"{backend}: the same shapes compiled again ({graphs_after_first} -> {graphs})"


def test_compiled_blocks_and_loss_match_eager_aot_eager():
    _compare_compiled_with_eager("aot_eager", fresh_seed(9401), rtol=1e-5)


def test_compiled_blocks_with_token_tiles_match_eager():
    """[mop.tiling]'s autograd Function (tiled FFNs and attention stages) inside compiled blocks."""
    rng = random.Random(fresh_seed(9405))
    _compare_compiled_with_eager("aot_eager", fresh_seed(9406), rtol=1e-5, tiles=(rng.choice([8, 16]), 16))


@pytest.mark.slow
def test_compiled_inductor_cpu_plain_path_is_exact_enough():
    """The backend users run: inductor's C++ code on CPU (fp32; fused kernels round differently). One shape,
    as training runs it (a new shape's recompile is aot_eager's test, which shares dynamo's and AOTAutograd's
    graphs; inductor's C++ build of a second, dynamic graph doubled this test's ~75 s)."""
    _compare_compiled_with_eager("inductor", fresh_seed(9402), rtol=1e-4, new_shape=False)


@pytest.mark.gpu
def test_compiled_inductor_cuda_matches_eager():
    """Inductor's Triton code on a GPU, fp32 without TF32, with token tiles on one pass."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _compare_compiled_with_eager("inductor", fresh_seed(9407), rtol=1e-4, device="cuda")
    _compare_compiled_with_eager("inductor", fresh_seed(9408), rtol=1e-4, tiles=(16, 16), device="cuda")


SCHEDULE_CASES = [  # (dispatch, D, E_p, keep attention, SCO)
    ("ep", 1, 2, False, False),
    ("llep", 2, 2, True, False),
    ("pipelined_llep", 2, 2, False, True),
]


def _parallelized(seed, layout, options, sco_bytes):
    from mop_train.ops.sco import SelectiveCheckpointOffload
    from mop_train.parallel.parallelize import parallelize

    module = _module(seed, hot_expert=True)
    sco = SelectiveCheckpointOffload(sco_bytes, device="cpu") if sco_bytes else None
    parallelize(module, layout, options, sco=sco)
    return module, sco


def _local_grads(module):
    from mop_train.parallel.sharding import local

    return {n: local(p.grad).clone() for n, p in module.named_parameters() if p.grad is not None}


def _schedules_worker(rank, world_size, seed):
    import dataclasses
    from types import SimpleNamespace

    import torch.distributed as dist

    from mop_train.layout import RankLayout, plan_layout
    from mop_train.ops.moe_dispatch import dispatch_options
    from mop_train.parallel.apply import dispatch_metrics
    from mop_train.parallel.parallelize import ParallelizeOptions
    from mop_train.parallel.precision import MixedPrecision
    from mop_train.train.loop import shard_sequence

    moe_cfg = SimpleNamespace(token_budget=24, max_chunks=10, membership="strided", alpha=1.0,
                              min_tokens_per_gemm=8, imbalance_threshold=1.0)
    rng = random.Random(seed)
    for dispatch, D, E_p, keep, sco in SCHEDULE_CASES:
        layout = RankLayout.build(plan_layout(world_size, D, E_p, 1), device_type="cpu")
        options = ParallelizeOptions(dispatch=dispatch_options(dispatch, moe_cfg), keep_attention=keep,
                                     checkpointed=(0, 2), preserve_rng_state=True,
                                     precision=MixedPrecision(torch.float32, torch.float32))
        compiled_options = dataclasses.replace(options, compile=CompileOptions(True, True, "aot_eager"))
        eager, _ = _parallelized(seed, layout, options, 1 << 20 if sco else 0)
        compiled, compiled_sco = _parallelized(seed, layout, compiled_options, 1 << 20 if sco else 0)
        torch._dynamo.reset()                                       # each case compiles afresh
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(2):
            # Each sequence group its own sequences; the D ranks of a group take its S/D slices.
            tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)
                                                                                          + layout.data_rank))
            labels = torch.roll(tokens, -1, dims=1)
            tokens, labels, positions = shard_sequence(tokens, labels, layout)
            results = []
            for module in (eager, compiled):
                loss = module(tokens, labels, positions)
                loss.backward()
                results.append((loss.detach(), _local_grads(module)))
                module.zero_grad(set_to_none=True)
            name = f"rank {rank} {dispatch} D={D}"
            assert_close(results[1][0], results[0][0], rtol=1e-5, atol=0, name=f"{name} loss")
            assert results[1][1].keys() == results[0][1].keys()
            for key, grad in results[0][1].items():
                assert_close_to_scale(results[1][1][key], grad, rtol=1e-5, name=f"{name} grad {key}")
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before, f"{dispatch}: nothing compiled"
        stats = dispatch_metrics(compiled.model)
        if dispatch == "pipelined_llep":   # the compiled run really chunked, and SCO really offloaded
            assert stats["num_chunks"] > 1 and compiled_sco.last_step_stats()["offloaded_layers"] > 0
        if dispatch != "ep":
            flag = torch.tensor([stats["relocated_routes"]])
            dist.all_reduce(flag)
            assert flag.item() > 0, f"{dispatch}: no route relocated, LLEP's path untested"


@pytest.mark.slow
def test_every_dispatch_schedule_compiles_and_matches_eager():
    from tests.dist_utils import run_distributed

    run_distributed(_schedules_worker, 2, fresh_seed(9403), timeout_s=900)


def _eager_worker(rank, world, folder, args):
    from tests.train.in_process import train_here

    train_here(folder, args)


@pytest.mark.slow
def test_training_cli_compiled_losses_match_eager(tmp_path):
    """The compiled run through the CLI (plain `python -m mop_train.train`); the eager reference through
    the same training function in one spawned rank (tests/train/in_process.py), one launch fewer."""
    from tests.dist_utils import run_distributed

    common = ["--job.config_file", DEBUG_CONFIG, "--training.steps", "3", "--metrics.log_freq", "1",
              "--metrics.no-enable-tensorboard", "--checkpoint.no-enable", "--debug.seed", str(fresh_seed(9404) % 1000)]
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    run_distributed(_eager_worker, 1, eager, common, timeout_s=300)
    check_ok(run_train([*common, "--job.dump_folder", compiled, "--compile.enable"], nproc=None, timeout=900))
    losses = {name: torch.tensor([m["loss"] for m in read_metrics(folder)])
              for name, folder in (("eager", eager), ("compiled", compiled))}
    assert len(losses["eager"]) == 3
    assert_close(losses["compiled"], losses["eager"], rtol=1e-4, atol=0, name="compiled vs eager losses")


@pytest.mark.parametrize("flags, needles", [
    (["--compile.enable", "--mop.layout.vocab_degree", "2"], ["compile.components", "Ring-DTP", "vocab_degree = 2",
                                                               '["model"]']),
    (["--compile.enable", "--mop.ring_dtp.enable"], ["Ring-DTP", "mop.ring_dtp.enable = true"]),
    (["--compile.enable", "--compile.components", "model,optimizer"], ["'optimizer'", "model, loss"]),
    (["--compile.enable", "--compile.backend", "no_such_backend"], ["compile.backend = 'no_such_backend'",
                                                                     "inductor"]),
])
def test_settings_that_cannot_compile_fail_before_launch(flags, needles):
    with pytest.raises(ValueError) as info:
        load_job_config(["--job.config_file", DEBUG_CONFIG, *flags])
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} missing from: {info.value}"
    # Without the loss, Ring-DTP runs with compiled blocks.
    if "Ring-DTP" in needles:
        cfg = load_job_config(["--job.config_file", DEBUG_CONFIG, *flags, "--compile.components", "model"])
        assert CompileOptions.from_config(cfg.compile) == CompileOptions(model=True, loss=False, backend="inductor")


def test_inductor_on_cpu_without_a_cxx_compiler_names_the_setting(monkeypatch):
    import torch._inductor.cpp_builder as cpp_builder

    def missing():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    with pytest.raises(ValueError, match=r"compile.backend = 'inductor' on CPU needs a C\+\+ compiler"):
        check_compiler("inductor", "cpu")
    check_compiler("inductor", "cuda")       # Triton there, not C++
    check_compiler("aot_eager", "cpu")
