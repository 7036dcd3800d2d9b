"""Regressions found by an adversarial check of validation ([validation]); each test names the input.

- validation.dataloader.num_workers > 0 (a `[validation] dataloader` key mop_train honours): every
  DataLoader worker iterated the whole packed stream, so each batch came once per worker (batches
  0, 0, 1, 1, ... with 2 workers) and validation.steps = 3 scored batches 0, 0, 1 instead of 0, 1, 2;
  steps = -1 scored each batch twice. The batches must be those of num_workers = 0, in order, at
  every data rank of the layout.
- The same with a streamed validation.dataset = "hub": the dataset hands each worker only its shards,
  so that split would score half the batches (one shard) or other windows (several): refused, with how
  to fix it.
- validation.steps = -1 over a held-out set shorter than one global batch was refused at the first
  validation, after `freq` steps of training: now when the validator is built. An empty held-out file
  said "StopIteration"; now it is named as holding no documents.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from mop_train.train import data
from tests.utils import fresh_seed


def _batches(v, docs, tokenizer, dp_rank, dp_size, cap):
    out = []
    for batch in data.build_validation_dataloader(v, docs, tokenizer, dp_rank, dp_size):
        out.append(batch)
        if len(out) == cap:
            break
    return out


def test_validation_dataloader_workers_yield_the_batches_of_no_workers(tmp_path):
    from torchtitan.config.job_config import DataLoader, Validation

    rng = random.Random(fresh_seed(9601))
    tokenizer = data.build_tokenizer(data.EMBEDDED, cache_dir=data.default_cache_dir())
    docs, path = _held_out_documents(tmp_path, rng, 40, 70)
    S, B, dp_size, workers = rng.choice([8, 12, 16]), rng.randint(1, 3), rng.choice([1, 2, 3]), rng.choice([2, 3])
    for steps in (3, -1):
        cap = 3 if steps > 0 else 100_000
        for dp_rank in range(dp_size):
            want, got = (_batches(Validation(enable=True, dataset="jsonl", dataset_path=str(path), seq_len=S,
                                             local_batch_size=B, steps=steps, dataloader=DataLoader(num_workers=n)),
                                  docs, tokenizer, dp_rank, dp_size, cap) for n in (0, workers))
            where = f"steps={steps}, S={S}, B={B}, data rank {dp_rank} of {dp_size}, {workers} workers"
            assert len(got) == len(want), f"{len(got)} batches, not {len(want)} ({where})"
            for k, ((x, y), (wx, wy)) in enumerate(zip(got, want)):
                assert torch.equal(x["input"], wx["input"]) and torch.equal(y, wy), f"batch {k} differs ({where})"


def test_validation_dataloader_workers_over_a_streamed_dataset_are_refused(tmp_path):
    """A streamed ("hub") dataset gives each DataLoader worker only its shards (one shard: all to worker 0),
    so with the split above the workers scored half the batches (and with several shards, other windows)."""
    from torchtitan.config.job_config import DataLoader, Validation

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(30)))
    docs = data.load_documents("hub", str(repo), cache_dir=str(tmp_path), section="validation")
    tokenizer = data.build_tokenizer(data.EMBEDDED, cache_dir=data.default_cache_dir())
    v = Validation(enable=True, dataset="hub", dataset_path=str(repo), seq_len=16, local_batch_size=2, steps=-1,
                   dataloader=DataLoader(num_workers=2))
    with pytest.raises(ValueError, match=r"validation.dataloader.num_workers = 2 .*'hub'.*set validation.dataloader"):
        data.build_validation_dataloader(v, docs, tokenizer, 0, 1)
    v = Validation(enable=True, dataset="hub", dataset_path=str(repo), seq_len=16, local_batch_size=2, steps=-1)
    assert len(list(data.build_validation_dataloader(v, docs, tokenizer, 0, 1))) > 0   # no workers: read


def _too_small_worker(rank, world, folder, path):
    from functools import partial

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.train.build import build_run
    from mop_train.train.loop import _micro_batch
    from mop_train.train.validate import build_validator
    from tests.train.cli import DEBUG_CONFIG

    cfg = load_job_config(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--checkpoint.no-enable",
                           "--validation.enable", "--validation.dataset", "jsonl", "--validation.dataset_path", path,
                           "--validation.steps", "-1", "--validation.seq_len", "64", "--validation.local_batch_size",
                           "2", "--validation.freq", "100"], model_flavors=zoo.names(), world_size=world)
    run = build_run(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"holds less than one global batch of 2 x 2 sequences of 64 tokens"):
        build_validator(cfg, run, prepare=partial(_micro_batch, layout=run.layout, device="cpu", eos_id=None))


def test_a_held_out_pass_shorter_than_one_global_batch_fails_at_start_up(tmp_path):
    """steps = -1 over a set with one batch for one data rank but none for the other: refused when the
    validator is built (on every rank), not at the first validation, `freq` training steps later."""
    from tests.dist_utils import run_distributed

    rng = random.Random(fresh_seed(9603))
    tokenizer = data.build_tokenizer(data.EMBEDDED, cache_dir=data.default_cache_dir())
    words = ["alpha", "beta", "gamma", "def", "return"]
    text = ""
    while len(tokenizer.encode(text, add_bos=True, add_eos=True)) < 3 * 65:  # 3 windows of S + 1 = 65 tokens:
        text += " " + rng.choice(words)                                     # 2 rows on one rank, 1 on the other
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    run_distributed(_too_small_worker, 2, str(tmp_path / "run"), str(path), timeout_s=300)


def test_an_empty_held_out_file_is_named(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match=r"validation.dataset_path = .*empty.jsonl.* holds no documents"):
        data.load_documents("jsonl", str(path), cache_dir=str(tmp_path), section="validation")


def test_validation_leaves_the_training_generator_where_it_was(tmp_path):
    """Starting a DataLoader's iterator draws its base seed from the torch CPU generator. With
    validation.steps > 0 an uninterrupted run drew once (its first validation, then kept the batches)
    and a run resumed past that drew again at its own first validation, so the generator a model
    draws from (dropout) no longer followed the uninterrupted run's: validation now draws nothing
    from it, at start-up (steps = -1's check) or at any validation."""
    from types import SimpleNamespace

    from torchtitan.config.job_config import Validation

    from mop_train.train.validate import Validator

    rng = random.Random(fresh_seed(9611))
    tokenizer = data.build_tokenizer(data.EMBEDDED, cache_dir=data.default_cache_dir())
    docs, path = _held_out_documents(tmp_path, rng, 20, 40)
    run = SimpleNamespace(parts=None, layout=SimpleNamespace(data_rank=0, data_size=1), optimizers=[])
    for steps in (rng.randint(1, 3), -1):
        v = Validation(enable=True, dataset="jsonl", dataset_path=str(path), seq_len=rng.choice([8, 16]),
                       local_batch_size=rng.randint(1, 2), steps=steps)
        validator = Validator(v, docs, tokenizer, run, prepare=None)
        seed = fresh_seed(9612 + steps)
        torch.manual_seed(seed)
        want = torch.rand(8)
        torch.manual_seed(seed)
        next(validator._batches())                   # a validation's pass over the held-out batches
        assert torch.equal(torch.rand(8), want), f"validation.steps = {steps} drew from the training generator"


def _held_out_documents(tmp_path, rng: random.Random, fewest: int, most: int):
    """(documents, path): a held-out jsonl of fewest..most random short documents, loaded as validation reads it."""
    words = ["alpha", "beta", "gamma", "def", "return", "(", ")", "\n"]
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))}) + "\n"
                            for _ in range(rng.randint(fewest, most))))
    return data.load_documents("jsonl", str(path), cache_dir=str(tmp_path), section="validation"), path
