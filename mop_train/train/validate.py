"""Validation ([validation], torchtitan 0.2.2's keys): every `freq` steps, the mean loss over
`steps` held-out batches, logged beside the step's training record as `validation/loss`.

    validator = build_validator(cfg, run, prepare=...)   # None unless validation.enable
    if validator is not None and validator.due(step):
        values.update(validator.run(step))        # {"validation/loss", "validation/batches", ...}

How: the first `steps` batches of the held-out stream, read once and kept in host memory (steps x
B x S token ids twice), so every validation scores the same batches without tokenizing them again
(steps = -1: a fresh pass over the whole set each time); packed and split like training's (every rank packs the same global stream and keeps
its rows; the D ranks of a sequence group take their S/D slices), the training model's own forward
under torch.no_grad with every operator as configured (Ring-DTP takes its loss-only path, SCO and
PipelinedLLEP's chunk checkpoints see no graph and save nothing). No gradient, no optimizer step.
The router's load counters and last aux loss are put back afterwards, so the bias update of the
next step counts training routes only (the biases themselves move only in that update). Per batch
the loss is the summed token loss over the global count of target tokens; the logged loss is the
mean over batches (torchtitan's Validator, `components/validate.py`, taken as the model, not
copied). One all-reduce of the [batches, 2] sums at the end (plus, for steps = -1, one small
all-reduce per batch so every rank stops at the same one). Afterwards FSDP2's units are resharded:
a no-grad forward leaves the root and the last block unsharded, which a checkpoint must not see.
Unlike torchtitan, validation runs at multiples of `freq` only (not also at step 1).

Legend: W ranks, D sequence degree, B validation.local_batch_size, S validation.seq_len.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from mop_train.parallel.fake_world import fake_world_note, in_fake_world
from mop_train.train.data import (build_tokenizer, build_validation_dataloader, check_validation_workers,
                                  default_cache_dir, load_documents)
from mop_train.train.loss import IGNORE_INDEX
from mop_train.train.optim import wait_for_weights


class Validator:
    """Scores the held-out batches with the run's model (see the module docstring).

    Args:
        validation: the `[validation]` section.
        docs: the held-out documents (`load_documents(..., section="validation")`).
        tokenizer: the run's tokenizer.
        run: the built run (mop_train.train.build.Run): layout, parts, optimizers.
        prepare: one dataloader batch -> (tokens, labels, positions [S/D], doc_ids) on this rank's
            device, as the training step prepares its micro-batches.
        text_column: [mop.data] text_column.
    """

    def __init__(self, validation, docs, tokenizer, run, *, prepare, text_column: str = "text"):
        self.validation, self.docs, self.tokenizer = validation, docs, tokenizer
        self.run_parts, self.layout, self.optimizers = run.parts, run.layout, run.optimizers
        self.prepare, self.text_column = prepare, text_column
        self._kept: list | None = None           # this rank's batches, after the first validation

    def due(self, step: int) -> bool:
        return step % self.validation.freq == 0

    @torch.no_grad()
    def run(self, step: int) -> dict:
        """Validate now; returns the values to log (the same on every rank)."""
        module, model = self.run_parts.module, self.run_parts.model
        device = next(iter(module.parameters())).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)          # the training step's work is not counted here
        start = time.perf_counter()
        wait_for_weights(self.optimizers)           # OffloadStreamAdamW's overlap: the weights are final
        saved = [(moe.router.tokens_per_expert.clone(), moe.last_aux_loss) for moe in model.moe_layers()]
        module.eval()
        try:
            sums = self._loss_sums(module)
        finally:
            module.train()
            for moe, (loads, aux) in zip(model.moe_layers(), saved):
                moe.router.tokens_per_expert.copy_(loads)
                moe.last_aux_loss = aux
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()
        if not sums:
            raise ValueError(self._too_small())
        totals = torch.stack(sums)                  # [batches, 2]: summed token loss, target tokens
        dist.all_reduce(totals)
        loss = float((totals[:, 0] / totals[:, 1]).mean())
        seconds = time.perf_counter() - start
        fake = in_fake_world()                      # the reduce left this rank's sums: W identical ranks
        tokens = int(totals[:, 1].sum()) * (dist.get_world_size() if fake else 1)
        if dist.get_rank() == 0 or fake:            # a fake world's one process is its own log
            print(f"validation at step {step}: loss {loss:.4f} over {len(sums)} batches "
                  f"({tokens:,} tokens, {seconds:.2f} s)" + (f" [{fake_world_note()}]" if fake else ""), flush=True)
        return {"validation/loss": loss, "validation/batches": len(sums),
                "validation/tokens": tokens, "validation/s": seconds}

    def _loss_sums(self, module) -> list[torch.Tensor]:
        v = self.validation
        batches = self._batches()
        sums = []
        while v.steps == -1 or len(sums) < v.steps:
            batch = next(batches, None)
            if v.steps == -1 and not self._every_rank_has(batch):
                break                                # the end of one pass: the same batch on every rank
            tokens, labels, positions, doc_ids = self.prepare(batch)
            loss_sum = module(tokens, labels, positions, doc_ids)          # fp32 sum over local tokens
            count = (labels != IGNORE_INDEX).sum()
            sums.append(torch.stack([loss_sum.double(), count.double()]))
        return sums

    def check_one_batch(self) -> None:
        """At start-up, for steps = -1: every rank's pass holds a whole batch (else the first validation,
        `freq` steps of training later, would find none). Reads one batch per rank: one collective."""
        if self.validation.steps != -1:
            return                                   # (steps > 0: the loader loops over the documents)
        loader = self._fresh_pass()
        if not self._every_rank_has(next(loader, None)):
            raise ValueError(self._too_small())

    def _too_small(self) -> str:
        v = self.validation
        return (f"validation.dataset = {v.dataset!r} holds less than one global batch of {v.local_batch_size} x "
                f"{self.layout.data_size} sequences of {v.seq_len} tokens; lower validation.local_batch_size or "
                f"validation.seq_len, or use more documents")

    def _batches(self):
        """This rank's validation batches: kept after the first pass (steps > 0), or a fresh pass (-1)."""
        if self._kept is not None:
            return iter(self._kept)
        v = self.validation
        loader = self._fresh_pass()
        if v.steps == -1:
            return loader
        self._kept = [next(loader) for _ in range(v.steps)]    # the loader loops: never exhausted
        return iter(self._kept)

    def _fresh_pass(self):
        """An iterator over the held-out stream from its first document. Starting a DataLoader's iterator
        draws its base seed from the torch CPU generator: drawn here under `fork_rng`, so validation leaves
        the training run's generator as it was. Else a resumed run, whose first validation reads the kept
        batches again, drew once more than the uninterrupted run, which had kept them since its first
        validation, and a model that draws (dropout) no longer repeated its losses."""
        with torch.random.fork_rng(devices=[]):
            return iter(build_validation_dataloader(self.validation, self.docs, self.tokenizer, self.layout.data_rank,
                                                    self.layout.data_size, text_column=self.text_column))

    def _every_rank_has(self, batch) -> bool:
        """Whether every rank holds a whole batch (a pass ends on a partial or missing one)."""
        whole = batch is not None and batch[1].shape[0] == self.validation.local_batch_size
        device = next(iter(self.run_parts.module.parameters())).device
        flag = torch.tensor([int(whole)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def check_validation_fits(validation, model_args) -> None:
    """The validation batch against the model, before the model is built (its divisibility by the
    sequence degree is a config check: config_checks.validate_run_tools)."""
    if validation.seq_len > model_args.max_seq_len:
        raise ValueError(f"validation.seq_len ({validation.seq_len}) exceeds the model's max_seq_len "
                         f"({model_args.max_seq_len}); lower it")


def build_validator(cfg, run, *, prepare) -> Validator | None:
    """The run's Validator, or None when validation.enable is false. Loads the held-out documents
    once (the embedded corpus's held-out split for validation.dataset = "embedded")."""
    v = cfg.validation
    if not v.enable:
        return None
    cache_dir = cfg.mop.data.cache_dir or default_cache_dir()
    tokenizer = build_tokenizer(cfg.model.hf_assets_path, cache_dir=cache_dir)
    docs = load_documents(v.dataset, v.dataset_path, cache_dir=cache_dir, text_column=cfg.mop.data.text_column,
                          section="validation")
    check_validation_workers(v, docs)          # at start-up, not at the first validation
    validator = Validator(v, docs, tokenizer, run, prepare=prepare, text_column=cfg.mop.data.text_column)
    validator.check_one_batch()
    return validator
