"""In-process checks of the training loop's parts: loss, data, checkpoint state, plan, guards."""

from __future__ import annotations

import json
import random
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchtitan.config.job_config import Training

from mop_train.config import load_job_config
from mop_train.train import data
from mop_train.train.checkpoint import TrainState
from mop_train.train.loss import chunked_cross_entropy_sum
from mop_train.layout import plan_layout
from mop_train.models import zoo
from mop_train.ops.moe_dispatch import PipelinedLLEPOptions
from mop_train.parallel.parallelize import (ParallelizeOptions, check_layout_fits, check_titan_parallelism,
                                            checkpointed_layer_ids)
from mop_train.plan.terms import check_host_memory, host_memory_plan
from tests.utils import assert_close, fresh_seed


@pytest.mark.parametrize("N, chunk", [(37, 8), (5, 64), (0, 4), (16, 16)])
def test_chunked_cross_entropy_matches_reference(N, chunk):
    g = torch.Generator().manual_seed(fresh_seed(1000 + N))
    H, V = 12, 29
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::3] = -100  # ignored positions
    got = chunked_cross_entropy_sum(hidden, weight, targets, chunk_size=chunk)
    ref = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100, reduction="sum")
    assert_close(got, ref, name="loss")
    upstream = torch.rand((), generator=g) + 0.5
    gh, gw = torch.autograd.grad(got * upstream, (hidden, weight))
    rh, rw = torch.autograd.grad(ref * upstream, (hidden, weight))
    assert_close(gh, rh, name="grad hidden")
    assert_close(gw, rw, name="grad weight")


def test_chunked_cross_entropy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy_sum(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy_sum(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long))


@pytest.fixture(scope="module")
def tokenizer():
    return data.build_tokenizer(data.EMBEDDED, cache_dir=data.default_cache_dir())


def _training(**kw):
    training = Training(dataset="jsonl", seq_len=16, local_batch_size=2)
    for key, value in kw.items():
        setattr(training, key, value)
    return training


def test_embedded_tokenizer_matches_the_debug_vocab(tokenizer):
    assert tokenizer.get_vocab_size() == data.EMBEDDED_VOCAB_SIZE == 2048
    ids = tokenizer.encode("def f(x):\n    return x", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == "def f(x):\n    return x"


def test_dataloader_resumes_exactly_and_ranks_read_different_data(tmp_path, tokenizer):
    path = tmp_path / "docs.jsonl"
    rng = random.Random(5)
    with open(path, "w") as f:
        for i in range(11):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(3, 60)))
            f.write(json.dumps({"text": f"doc {i}: {words}"}) + "\n")
    cfg = _training(dataset_path=str(path))
    loader = data.build_dataloader(cfg, tokenizer, 0, 2, cache_dir=str(tmp_path))
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(4)]
    fresh = data.build_dataloader(cfg, tokenizer, 0, 2, cache_dir=str(tmp_path))
    fresh.load_state_dict(state)
    it2 = iter(fresh)
    for (xa, ya), (xb, yb) in zip(expected, (next(it2) for _ in range(4))):
        assert xa["input"].shape == (2, 16) and torch.equal(xa["input"], xb["input"]) and torch.equal(ya, yb)
    other = next(iter(data.build_dataloader(cfg, tokenizer, 1, 2, cache_dir=str(tmp_path))))
    first = next(iter(data.build_dataloader(cfg, tokenizer, 0, 2, cache_dir=str(tmp_path))))
    assert not torch.equal(first[0]["input"], other[0]["input"])
    assert torch.equal(first[0]["input"][:, 1:], first[1][:, :-1])  # labels are inputs shifted by one


def test_bad_data_and_tokenizer_paths_name_the_path(tmp_path, tokenizer):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="missing.jsonl"):
        data.load_documents("jsonl", missing, cache_dir=str(tmp_path))
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"text": "fine"}\n{not json at all\n')
    with pytest.raises(ValueError, match="corrupt.jsonl"):
        data.load_documents("jsonl", str(corrupt), cache_dir=str(tmp_path))
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="no 'text' column"):
        data.load_documents("jsonl", str(no_text), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not a known source"):
        data.load_documents("c5", None, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs training.dataset_path"):
        data.load_documents("parquet", None, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="nowhere"):
        data.build_tokenizer(str(tmp_path / "nowhere"), cache_dir=str(tmp_path))
    empty_dir = tmp_path / "tok_empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        data.build_tokenizer(str(empty_dir), cache_dir=str(tmp_path))
    bad_dir = tmp_path / "tok_bad"
    bad_dir.mkdir()
    (bad_dir / "tokenizer.json").write_text("{ this is not a tokenizer")
    with pytest.raises(ValueError, match="tok_bad"):
        data.build_tokenizer(str(bad_dir), cache_dir=str(tmp_path))


def test_global_batch_is_the_same_for_any_number_of_data_ranks(tmp_path, tokenizer):
    path = tmp_path / "docs.jsonl"
    rng = random.Random(torch.seed())
    with open(path, "w") as f:
        for i in range(7):
            words = " ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(rng.randint(3, 40)))
            f.write(json.dumps({"text": f"doc {i}: {words}"}) + "\n")
    global_rows = 6
    whole = iter(data.build_dataloader(_training(dataset_path=str(path), local_batch_size=global_rows),
                                       tokenizer, 0, 1, cache_dir=str(tmp_path)))
    for world in (2, 3):
        loaders = [iter(data.build_dataloader(_training(dataset_path=str(path), local_batch_size=global_rows // world),
                                              tokenizer, r, world, cache_dir=str(tmp_path))) for r in range(world)]
        reference = iter(data.build_dataloader(_training(dataset_path=str(path), local_batch_size=global_rows),
                                               tokenizer, 0, 1, cache_dir=str(tmp_path)))
        for _ in range(3):  # several steps: the stream wraps around the 7 documents
            expected_x, expected_y = next(reference)
            parts = [next(it) for it in loaders]
            assert torch.equal(torch.cat([x["input"] for x, _ in parts]), expected_x["input"])
            assert torch.equal(torch.cat([y for _, y in parts]), expected_y)
    assert next(whole)[0]["input"].shape == (global_rows, 16)


def test_train_state_restores_rng_streams():
    state = TrainState(rank=3)
    state.step, state.tokens_seen = 17, 4096
    saved = state.state_dict()
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.rand(9), random.random(), np.random.rand()  # move every stream on
    restored = TrainState(rank=3)
    restored.load_state_dict(saved)
    assert (restored.step, restored.tokens_seen) == (17, 4096)
    torch.rand(3)  # a start-up draw between the load and the first step (the dataloader's seed) ...
    restored.restore_rng()  # ... which restore_rng, called after it, puts back
    got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    with pytest.raises(ValueError, match="rank 0"):
        TrainState(rank=0).load_state_dict(saved)


def test_inconsistent_layouts_are_rejected_before_launch():
    debug = zoo.get_model_args("debug")  # 4 heads, 8 experts
    cfg = load_job_config(["--training.seq_len", "130"])
    with pytest.raises(ValueError, match=r"seq_len \(130\) must be divisible by mop.layout.seq_degree \(4\)"):
        check_layout_fits(plan_layout(8, 4, 1, 1), cfg.training, debug)
    cfg = load_job_config(["--training.seq_len", "128"])
    with pytest.raises(ValueError, match=r"attention heads \(4\) must be divisible by mop.layout.seq_degree \(8\)"):
        check_layout_fits(plan_layout(8, 8, 1, 1), cfg.training, debug)
    with pytest.raises(ValueError, match=r"expert_degree \(3\) must divide num_experts \(8\)"):
        check_layout_fits(plan_layout(6, 1, 3, 1), cfg.training, debug)
    check_layout_fits(plan_layout(8, 4, 8, 2), cfg.training, debug)
    cfg = load_job_config(["--parallelism.tensor_parallel_degree", "2"])
    with pytest.raises(ValueError, match="tensor_parallel_degree = 2"):
        check_titan_parallelism(cfg.parallelism, cfg.training, data_size=2)
    cfg = load_job_config(["--training.local_batch_size", "3", "--training.global_batch_size", "12"])
    with pytest.raises(ValueError, match=r"local_batch_size x W/D = 3 x 5 = 15 .* a multiple of 15"):
        check_titan_parallelism(cfg.parallelism, cfg.training, data_size=5)
    assert check_titan_parallelism(cfg.parallelism, cfg.training, data_size=4) == 1
    assert check_titan_parallelism(cfg.parallelism, cfg.training, data_size=2) == 2   # 2 micro-batches
    with pytest.raises(ValueError, match="a multiple of 9"):
        check_titan_parallelism(cfg.parallelism, cfg.training, data_size=3)
    cfg = load_job_config([])
    assert check_titan_parallelism(cfg.parallelism, cfg.training, data_size=3) == 1


def test_parallelize_options_are_resolved_and_checked_from_the_config():
    """The settings `parallelize` applies are built once from the config, before the model is: the
    dispatch options of the chosen schedule, the checkpointed blocks, the precision policy."""
    debug = zoo.get_model_args("debug")                              # 3 blocks
    cfg = load_job_config(["--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget", "24",
                           "--activation_checkpoint.mode", "selective",
                           "--activation_checkpoint.selective_ac_option", "2", "--mop.attention.keep",
                           "--training.mixed_precision_param", "bfloat16"])
    options = ParallelizeOptions.from_config(cfg, debug)
    assert options.dispatch == PipelinedLLEPOptions(token_budget=24)
    assert options.checkpointed == (0, 2) and options.keep_attention
    assert options.precision.param_dtype == torch.bfloat16 and options.precision.reduce_dtype == torch.float32
    assert ParallelizeOptions.from_config(load_job_config([]), debug).dispatch is None     # local
    assert checkpointed_layer_ids(load_job_config(["--activation_checkpoint.mode", "none"]).activation_checkpoint,
                                  3) == []
    cfg = load_job_config(["--activation_checkpoint.mode", "selective",
                           "--activation_checkpoint.selective_ac_option", "op"])
    with pytest.raises(ValueError, match=r"selective_ac_option = 'op' is not supported"):
        ParallelizeOptions.from_config(cfg, debug)


def test_host_memory_plan_and_check():
    terms = {n: b for n, b, _ in host_memory_plan(1000, offload_optimizer=True, host_fraction=0.25,
                                                  sco_host_budget=300)}
    assert terms == {"optimizer state": 12_000, "host share grads": 1_000, "sco boundaries": 300}
    shared = {n: b for n, b, _ in host_memory_plan(1000, offload_optimizer=True, host_fraction=0.25,
                                                   device_fraction=0.4)}
    assert shared["optimizer state"] == 12 * 600 and shared["host share grads"] == 4 * 150  # of the 600 streamed
    plain = host_memory_plan(1000, offload_optimizer=False, host_fraction=0.25, sco_host_budget=0)
    assert sum(b for _, b, _ in plain) == 0
    plan = host_memory_plan(1000, offload_optimizer=True, host_fraction=0.25, sco_host_budget=300)
    check_host_memory(plan, local_ranks=8, available_bytes=8 * 13_300)          # exactly fits
    with pytest.raises(ValueError, match=r"8 rank\(s\) on this node need .* GiB pinned .*optimizer state"):
        check_host_memory(plan, local_ranks=8, available_bytes=8 * 13_300 - 1)

