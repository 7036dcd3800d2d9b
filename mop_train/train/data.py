"""Offline data: a tokenizer and a dataloader of packed token sequences, with no network needed.

    tokenizer = build_tokenizer(cfg.model.hf_assets_path, cache_dir=...)
    dataloader = build_dataloader(cfg.training, tokenizer, dp_rank, dp_world_size, cache_dir=...)

Sources (`[training] dataset`, with `dataset_path`; `[validation]` takes the same):
  "embedded"                   a corpus built from the Python standard library's own .py sources
                               (ships with every Python; no file outside the install is read):
                               training reads its top-level modules, validation its held-out split,
                               the modules of the packages HELD_OUT_PACKAGES, which training never reads
  "jsonl" | "parquet" | "text" local files: one file, a directory of them, or a glob
  "hub"                        `datasets.load_dataset(dataset_path)`: a hub id or a local dataset repo
Tokenizer (`[model] hf_assets_path`): "embedded" (a byte-level BPE of 2048 tokens trained once on the
embedded corpus) or a directory holding `tokenizer.json` (HF tokenizers), as torchtitan expects.
The embedded assets are built deterministically at first use into `<cache_dir>/embedded-<hash>`.

Documents are tokenized with BOS/EOS and concatenated; every sample is a window of seq_len + 1
tokens (input = first S, labels = last S), by torchtitan's HuggingFaceTextDataset, whose resumable
position (sample index + token buffer) goes into the checkpoint through the StatefulDataLoader.
Every rank packs the same global stream and keeps its own rows of each global batch
(`PackedTextDataset`), so a step's global batch does not depend on the layout. By default packed
documents attend across EOS; `[mop.data] document_mask = true` keeps attention inside each
document (the loop splits rows at EOS, see mop_train/models/document_mask.py).

Legend: B local batch, S sequence length.
"""

from __future__ import annotations

import glob
import hashlib
import json
import operator
import os
import shutil
import sysconfig
import tempfile
from dataclasses import asdict

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

EMBEDDED = "embedded"
EMBEDDED_VOCAB_SIZE = 2048
BOS, EOS = "<|bos|>", "<|eos|>"
LOCAL_FORMATS = {"jsonl": ("json", (".jsonl", ".json", ".jsonl.gz", ".json.gz")),
                 "parquet": ("parquet", (".parquet",)),
                 "text": ("text", (".txt", ".text", ".md"))}
SOURCES = (EMBEDDED, *LOCAL_FORMATS, "hub")
_ASSETS_VERSION = "1"  # bump when the corpus or tokenizer recipe changes
HELD_OUT_PACKAGES = ("json", "html", "urllib", "http")
"""Standard-library packages whose modules form the embedded corpus's held-out (validation) split:
training reads only top-level modules, so the two never share a document (about 0.5 MB of text)."""


def default_cache_dir() -> str:
    """Where the embedded corpus and tokenizer are cached: $MOP_TRAIN_CACHE or ~/.cache/mop_train."""
    return os.environ.get("MOP_TRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mop_train")


# ------------------------------------------------------------------------------------------------
# The embedded corpus and tokenizer
# ------------------------------------------------------------------------------------------------

def _stdlib_documents() -> list[str]:
    """Top-level .py files of this Python's standard library, in sorted order (one per document)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = []
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            docs.append(text)
    if not docs:
        raise ValueError(f"found no .py sources under the standard library folder {stdlib!r}; "
                         f"use [training] dataset = \"jsonl\" with a dataset_path instead")
    return docs


def _held_out_documents() -> list[str]:
    """The .py files of the HELD_OUT_PACKAGES of this Python's standard library, in sorted order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for pkg in HELD_OUT_PACKAGES for p in glob.glob(os.path.join(stdlib, pkg, "*.py")))
    docs = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            docs.append(text)
    if not docs:
        raise ValueError(f"found none of the standard library packages {HELD_OUT_PACKAGES} under {stdlib!r} "
                         f"for the embedded validation split; use [validation] dataset = \"jsonl\" with a "
                         f"dataset_path instead")
    return docs


def _train_bpe(docs: list[str], out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=EMBEDDED_VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)


def embedded_assets(cache_dir: str) -> str:
    """Build (once) and return the folder holding corpus.jsonl, tokenizer.json, tokenizer_config.json.

    The folder name hashes the corpus, so another Python version gets its own folder. The build
    writes to a temporary folder and renames it into place, so concurrent builders are safe.
    """
    docs = _stdlib_documents()
    digest = hashlib.sha256(_ASSETS_VERSION.encode())
    for doc in docs:
        digest.update(doc.encode())
    folder = os.path.join(cache_dir, f"embedded-{digest.hexdigest()[:16]}")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".embedded-", dir=cache_dir)
    try:
        with open(os.path.join(tmp, "corpus.jsonl"), "w") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
        _train_bpe(docs, tmp)
        os.rename(tmp, folder)
    except OSError:
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):  # not a lost race: a real error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def embedded_validation_corpus(cache_dir: str) -> str:
    """Write (once) and return the held-out split's corpus file, `<cache_dir>/embedded-validation-<hash>.jsonl`
    (its own file: the training corpus, its folder and the tokenizer are those of runs before it)."""
    docs = _held_out_documents()
    digest = hashlib.sha256(_ASSETS_VERSION.encode())
    for doc in docs:
        digest.update(doc.encode())
    path = os.path.join(cache_dir, f"embedded-validation-{digest.hexdigest()[:16]}.jsonl")
    if os.path.isfile(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".embedded-validation-", dir=cache_dir)
    try:
        with os.fdopen(fd, "w") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
        os.replace(tmp, path)  # concurrent writers write the same bytes
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------

def tokenizer_folder(hf_assets_path: str, *, cache_dir: str) -> str:
    """The folder the tokenizer is read from: the embedded one's build folder, or `hf_assets_path`."""
    return embedded_assets(cache_dir) if hf_assets_path == EMBEDDED else hf_assets_path


def build_tokenizer(hf_assets_path: str, *, cache_dir: str) -> HuggingFaceTokenizer:
    """torchtitan's HF tokenizer from `hf_assets_path` ("embedded" or a folder with tokenizer.json)."""
    path = tokenizer_folder(hf_assets_path, cache_dir=cache_dir)
    if not os.path.isdir(path):
        raise ValueError(f"model.hf_assets_path = {path!r} is not a folder; point it at a folder holding "
                         f"tokenizer.json, or set it to \"{EMBEDDED}\" for the built-in tokenizer")
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        raise ValueError(f"no tokenizer.json in model.hf_assets_path = {path!r} (files: "
                         f"{sorted(os.listdir(path))[:10]}); copy the model's tokenizer.json there")
    try:
        return HuggingFaceTokenizer(path)
    except Exception as err:  # tokenizers raises its own Exception types for unreadable files
        raise ValueError(f"could not load the tokenizer {tokenizer_json!r} (corrupt or not an HF "
                         f"tokenizers file?): {err}") from None


# ------------------------------------------------------------------------------------------------
# Dataset
# ------------------------------------------------------------------------------------------------

def _local_files(path: str, fmt: str, section: str = "training") -> list[str]:
    _, suffixes = LOCAL_FORMATS[fmt]
    if os.path.isdir(path):
        files = sorted(p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if p.endswith(suffixes) and os.path.isfile(p))
    elif os.path.isfile(path):
        files = [path]
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise ValueError(f"{section}.dataset_path = {path!r} names no {fmt} file (looked for "
                         f"{', '.join(suffixes)}); pass an existing file, folder or glob")
    return files


def load_documents(source: str, path: str | None, *, cache_dir: str, text_column: str = "text",
                   section: str = "training"):
    """Load the raw documents as a `datasets` Dataset (or IterableDataset for "hub").

    `section`: "training", or "validation" (the embedded source then reads its held-out split;
    error messages name the section's keys)."""
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()

    if source not in SOURCES:
        raise ValueError(f"{section}.dataset = {source!r} is not a known source; use one of {SOURCES}")
    if source != EMBEDDED and not path:
        raise ValueError(f"{section}.dataset = {source!r} needs {section}.dataset_path "
                         f"(a file, folder or glob{'; or a hub id' if source == 'hub' else ''})")
    if source == "hub":
        files = None
    elif source == EMBEDDED and section == "validation":
        files = [embedded_validation_corpus(cache_dir)]
    elif source == EMBEDDED:
        files = [os.path.join(embedded_assets(cache_dir), "corpus.jsonl")]
    else:
        files = _local_files(path, source, section)
    if files is not None and all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"{section}.dataset_path = {path!r} holds no documents: its {len(files)} file(s) are empty "
                         f"({files[0]!r}{', ...' if len(files) > 1 else ''})")
    try:
        if files is None:
            ds = load_dataset(path, split="train", streaming=True)
        else:
            builder = "json" if source == EMBEDDED else LOCAL_FORMATS[source][0]
            ds = load_dataset(builder, data_files=files, split="train")
    except Exception as err:  # datasets reports parse failures through several exception types
        raise ValueError(f"could not read {section}.dataset_path = {path or files[0]!r} as {source}: "
                         f"{type(err).__name__}: {err}") from None
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise ValueError(f"{section}.dataset = {source!r} ({path or 'built in'}) has no {text_column!r} column "
                         f"(columns: {columns}); set [mop.data] text_column to the column holding the text")
    if columns is not None and hasattr(ds, "__len__") and len(ds) == 0:
        raise ValueError(f"dataset {path or source!r} holds no documents")
    return ds


class PackedTextDataset(HuggingFaceTextDataset):
    """torchtitan's packing and resumable position, over one global stream shared by all ranks.

    Every data-parallel rank packs the same stream of documents and keeps only its rows of each
    global batch: global sample j belongs to rank (j // B) % dp_world_size. So the global batch of
    a step is the same for every layout (W, D, ...), which is what makes training
    layout-invariant; the price is that every rank tokenizes the whole stream (cheap next to a
    training step). torchtitan's own constructor looks names up in its fixed registry; this one
    takes the loaded dataset and sets the fields its `__iter__` and state dict use.
    """

    def __init__(self, docs, tokenizer, *, seq_len: int, dp_rank: int, dp_world_size: int,
                 rows_per_rank: int, text_column: str = "text", name: str = "documents", infinite: bool = True):
        if rows_per_rank < 1:
            raise ValueError(f"training.local_batch_size = {rows_per_rank} must be >= 1")
        self.dataset_name = name
        self._data = docs
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite          # False: one pass over the documents (validation.steps = -1)
        self._text_processor = operator.itemgetter(text_column)
        self._sample_idx = 0
        self._token_buffer: list[int] = []
        self._dp_rank, self._dp_world_size, self._rows = dp_rank, dp_world_size, rows_per_rank
        self._global_sample = 0

    def __iter__(self):
        for sample in super().__iter__():
            mine = (self._global_sample // self._rows) % self._dp_world_size == self._dp_rank
            self._global_sample += 1
            if mine:
                yield sample

    def state_dict(self):
        return {**super().state_dict(), "global_sample": self._global_sample}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._global_sample = state_dict["global_sample"]


def build_dataloader(training, tokenizer, dp_rank: int, dp_world_size: int, *,
                     cache_dir: str, text_column: str = "text") -> ParallelAwareDataloader:
    """A resumable dataloader yielding ({"input": tokens [B, S]}, labels [B, S]) for this rank.

    Args:
        training: the `[training]` config section (dataset, dataset_path, seq_len,
            local_batch_size, dataloader).
    """
    docs = load_documents(training.dataset, training.dataset_path, cache_dir=cache_dir,
                          text_column=text_column)
    dataset = PackedTextDataset(docs, tokenizer, seq_len=training.seq_len, dp_rank=dp_rank,
                                dp_world_size=dp_world_size, rows_per_rank=training.local_batch_size,
                                text_column=text_column, name=training.dataset_path or training.dataset)
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=training.local_batch_size, **asdict(training.dataloader))


class _ValidationTextDataset(PackedTextDataset):
    """The validation stream, split over the DataLoader's workers (validation.dataloader.num_workers
    > 0): worker w keeps this rank's batches k with k % workers == w. The loader takes one batch from
    each worker in turn, so it yields this rank's batches in the order of num_workers = 0; without
    the split every worker yielded the whole stream and each batch came once per worker."""

    def __iter__(self):
        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        if worker is None or worker.num_workers == 1:
            yield from super().__iter__()
            return
        for i, sample in enumerate(super().__iter__()):
            if (i // self._rows) % worker.num_workers == worker.id:
                yield sample


def check_validation_workers(validation, docs) -> None:
    """validation.dataloader.num_workers > 0 needs documents every worker reads whole (a local source's
    Dataset). A streamed "hub" dataset hands each DataLoader worker only its shards (or all to one
    worker when it has one shard), so the workers would pack other windows than one reader: refused."""
    from datasets import Dataset

    n = validation.dataloader.num_workers
    if n > 0 and not isinstance(docs, Dataset):
        raise ValueError(f"validation.dataloader.num_workers = {n} cannot read validation.dataset = "
                         f"{validation.dataset!r} (a streamed dataset: each DataLoader worker would get only its "
                         f"shards and pack other windows than one reader); set validation.dataloader.num_workers "
                         f"= 0, or use a local source (\"jsonl\", \"parquet\" or \"text\")")


def build_validation_dataloader(validation, docs, tokenizer, dp_rank: int, dp_world_size: int, *,
                                text_column: str = "text") -> ParallelAwareDataloader:
    """A fresh dataloader over the held-out `docs` from their first document, yielding ({"input":
    tokens [B, S]}, labels [B, S]) for this rank; packed like training's (the same global batches
    whatever the layout). It loops over the documents when validation.steps > 0 (torchtitan's
    rule) and makes one pass for -1. With validation.dataloader.num_workers > 0 the workers share
    the stream (`_ValidationTextDataset`): the same batches, in the same order, as with none (a
    streamed "hub" dataset with workers is refused, `check_validation_workers`).

    Args:
        validation: the `[validation]` section (local_batch_size, seq_len, steps, dataloader).
        docs: `load_documents(..., section="validation")`, loaded once per run.
    """
    check_validation_workers(validation, docs)
    dataset = _ValidationTextDataset(docs, tokenizer, seq_len=validation.seq_len, dp_rank=dp_rank,
                                     dp_world_size=dp_world_size, rows_per_rank=validation.local_batch_size,
                                     text_column=text_column, name=validation.dataset_path or validation.dataset,
                                     infinite=validation.steps != -1)
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=validation.local_batch_size, **asdict(validation.dataloader))
