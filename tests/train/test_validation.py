"""Validation ([validation]): the held-out split, the validator's loss against a plain model on the
same batches, what validation must leave untouched, and layout invariance through the real CLI.

- The embedded corpus's held-out split shares no document with the training corpus, and the
  training corpus (and so every existing run's stream) is what it was.
- One rank (spawned, gloo): the validator's loss equals the mean over the same batches of the
  token-mean cross-entropy of an unsharded copy of the model; parameters, gradients, optimizer
  state, router biases and load counters are as they were; two validations give the same loss.
- The CLI (slow): validation losses at W=1 (a real `torchrun -m mop_train.train` launch, metrics.jsonl
  and TensorBoard) equal those at (W=4, D=2, E_p=2, P=2) with every operator on (Ulysses, PipelinedLLEP
  chunking, Ring-DTP, SCO, OffloadStreamAdamW overlapping the next forward), rel 1e-5; the W=4 run is
  the same training function in 4 spawned ranks (tests/train/in_process.py), one launch fewer.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from mop_train.train import data
from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.utils import assert_close, fresh_seed


def test_held_out_split_is_disjoint_from_the_training_corpus(tmp_path):
    cache = data.default_cache_dir()
    train = data.load_documents(data.EMBEDDED, None, cache_dir=cache)["text"]
    held_out = data.load_documents(data.EMBEDDED, None, cache_dir=cache, section="validation")["text"]
    assert len(held_out) >= 10 and not set(train) & set(held_out)
    # The training stream is the standard library's top-level modules, as before the split existed.
    assert train == data._stdlib_documents()
    assert sorted(os.listdir(data.embedded_assets(cache))) == ["corpus.jsonl", "tokenizer.json",
                                                               "tokenizer_config.json"]
    # Built once, into its own file: a second call reads the same file.
    first = data.embedded_validation_corpus(str(tmp_path))
    assert data.embedded_validation_corpus(str(tmp_path)) == first and os.path.dirname(first) == str(tmp_path)


def test_validation_batches_restart_and_one_pass_ends(tmp_path):
    from torchtitan.config.job_config import Validation

    tokenizer = data.build_tokenizer(data.EMBEDDED, cache_dir=data.default_cache_dir())
    rng = random.Random(fresh_seed(9501))
    path = tmp_path / "held_out.jsonl"
    docs_text = [" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(rng.randint(5, 80)))
                 for _ in range(9)]
    path.write_text("".join('{"text": "%s"}\n' % t for t in docs_text))
    docs = data.load_documents("jsonl", str(path), cache_dir=str(tmp_path), section="validation")
    S, B = rng.choice([8, 16]), rng.randint(1, 3)
    for steps in (2, -1):
        v = Validation(enable=True, dataset="jsonl", dataset_path=str(path), seq_len=S, local_batch_size=B,
                       steps=steps)
        cap = 50 if steps > 0 else 10_000
        first = list(_take(data.build_validation_dataloader(v, docs, tokenizer, 0, 1), cap))
        again = list(_take(data.build_validation_dataloader(v, docs, tokenizer, 0, 1), cap))
        assert len(first) == len(again)
        assert all(torch.equal(a[0]["input"], b[0]["input"]) for a, b in zip(first, again))
        if steps == -1:  # one pass: exactly the windows the documents hold, the last batch maybe short
            n_tokens = sum(len(tokenizer.encode(t, add_bos=True, add_eos=True)) for t in docs_text)
            assert sum(x["input"].shape[0] for x, _ in first) == n_tokens // (S + 1)
        else:            # loops over the documents
            assert len(first) == 50
    with pytest.raises(ValueError, match="validation.dataset_path = .*names no jsonl file"):
        data.load_documents("jsonl", str(tmp_path / "none.jsonl"), cache_dir=str(tmp_path), section="validation")


def _take(loader, n):
    for i, batch in enumerate(loader):
        if i == n:
            return
        yield batch


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _validator_worker(rank, world_size, seed, folder):
    from functools import partial

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.models.model import MoETransformer
    from mop_train.train.build import build_run
    from mop_train.train.loop import _micro_batch
    from mop_train.train.validate import build_validator

    B, S, steps = 2, 64, 3
    cfg = load_job_config(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--checkpoint.no-enable",
                           "--debug.seed", str(seed % 1000), "--validation.enable", "--validation.dataset", "embedded",
                           "--validation.local_batch_size", str(B), "--validation.seq_len", str(S),
                           "--validation.steps", str(steps)], model_flavors=zoo.names())
    run = build_run(cfg, torch.device("cpu"))
    validator = build_validator(cfg, run, prepare=partial(_micro_batch, layout=run.layout, device="cpu", eos_id=None))
    model = run.parts.model
    g = torch.Generator().manual_seed(seed)
    for moe in model.moe_layers():            # a step's counted loads and moved biases
        moe.router.tokens_per_expert.copy_(torch.randint(0, 50, moe.router.tokens_per_expert.shape, generator=g))
        moe.router.expert_bias.copy_(torch.randn(moe.router.expert_bias.shape, generator=g) * 1e-2)
    before = {k: _full(v).clone() for k, v in run.parts.module.state_dict().items()}
    loads = [moe.router.tokens_per_expert.clone() for moe in model.moe_layers()]
    got = validator.run(1)
    assert got["validation/batches"] == steps and got["validation/tokens"] == steps * B * S
    after = {k: _full(v) for k, v in run.parts.module.state_dict().items()}
    for key, value in before.items():         # weights and router biases
        assert torch.equal(after[key], value), f"validation changed {key}"
    for moe, load in zip(model.moe_layers(), loads):
        assert torch.equal(moe.router.tokens_per_expert, load), "validation counted routes"
    assert all(p.grad is None for p in run.parts.module.parameters()), "validation left gradients"
    assert all(not opt.state for opt in run.optimizers), "the optimizer took a step"
    # The reference: an unsharded plain copy of the model, token-mean CE per batch, mean over batches.
    plain = MoETransformer(zoo.get_model_args("debug"))
    plain.load_state_dict({k: after["model." + k] for k in plain.state_dict()})
    batches = data.build_validation_dataloader(cfg.validation, validator.docs, validator.tokenizer, 0, 1)
    losses = []
    with torch.no_grad():
        for (inputs, labels), _ in zip(batches, range(steps)):
            hidden = plain(inputs["input"]).flatten(0, 1)
            losses.append(F.cross_entropy(hidden @ plain.output.weight.t(), labels.flatten()))
    assert_close(torch.tensor(got["validation/loss"]), torch.stack(losses).mean(), rtol=1e-5, atol=0,
                 name="validation loss")
    assert validator.run(2)["validation/loss"] == got["validation/loss"]   # the same batches every time


def test_validator_scores_the_held_out_batches_and_changes_nothing(tmp_path):
    run_distributed(_validator_worker, 1, fresh_seed(9502), str(tmp_path / "run"), timeout_s=600)


VALIDATION_GLOBAL_BATCH, VALIDATION_STEPS = 4, 4
LAYOUTS = [  # (W, D, E_p, P, flags)
    (1, 1, 1, 1, ["--mop.moe.dispatch", "local"]),
    (4, 2, 2, 2, ["--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget", "24",
                  "--mop.moe.min_tokens_per_gemm", "8", "--mop.moe.imbalance_threshold", "1.0",
                  "--mop.sco.host_budget", "64MiB", "--optimizer.name", "OffloadStreamAdamW",
                  "--mop.offload_adamw.overlap"]),
]


def _validation_args(W, D, Ep, P, flags, seed) -> list[str]:
    rows = VALIDATION_GLOBAL_BATCH * D // W
    return ["--job.config_file", DEBUG_CONFIG, "--training.steps", str(VALIDATION_STEPS),
            "--training.local_batch_size", str(rows), "--metrics.log_freq", "3", "--checkpoint.no-enable",
            "--debug.seed", str(seed), "--validation.enable", "--validation.dataset", "embedded",
            "--validation.freq", "2", "--validation.steps", "3", "--validation.local_batch_size", str(rows),
            "--validation.seq_len", "96", "--mop.layout.seq_degree", str(D), "--mop.layout.expert_degree", str(Ep),
            "--mop.layout.vocab_degree", str(P), *flags]


def _validation_worker(rank, world, folder, seed):
    from tests.train.in_process import train_here

    train_here(folder, _validation_args(*LAYOUTS[1], seed))


@pytest.mark.slow
def test_validation_losses_are_the_same_at_every_layout(tmp_path):
    """W=1 through the CLI (`torchrun -m mop_train.train`, metrics.jsonl and TensorBoard); the W=4 layout
    through the same training function in 4 spawned ranks (tests/train/in_process.py), a launch fewer."""
    seed = fresh_seed(9503) % 1000
    folders = [str(tmp_path / f"w{layout[0]}") for layout in LAYOUTS]
    check_ok(run_train(_validation_args(*LAYOUTS[0], seed) + ["--job.dump_folder", folders[0]], nproc=1,
                       timeout=600))
    run_distributed(_validation_worker, LAYOUTS[1][0], folders[1], seed, timeout_s=600)
    results = []
    for folder in folders:
        records = read_metrics(folder)
        validated = [r for r in records if "validation/loss" in r]
        assert [r["step"] for r in validated] == [2, 4]       # forced into the record at each validation
        assert all(r["validation/batches"] == 3 and r["validation/tokens"] == 3 * VALIDATION_GLOBAL_BATCH * 96
                   for r in validated)
        results.append((validated, records, folder))
    (ref, ref_records, ref_folder), (got, got_records, _) = results
    assert_close(torch.tensor([r["validation/loss"] for r in got]), torch.tensor([r["validation/loss"] for r in ref]),
                 rtol=1e-5, atol=0, name="validation losses W=4 vs W=1")
    assert_close(torch.tensor([r["loss"] for r in got_records]), torch.tensor([r["loss"] for r in ref_records]),
                 rtol=1e-5, atol=0, name="training losses W=4 vs W=1")
    assert got_records[-1]["moe_num_chunks"] > 1 and got_records[-1]["sco_offloaded_layers"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(ref_folder, "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("validation/loss")] == [2, 4]
