"""The stored chunks of a DCP checkpoint's tensors, read whole and counted, in one process.

    chunks = DCPChunks(step_folder)                 # reads .metadata once
    chunks.size("layers.1.moe.experts.w1")          # global shape, whatever layout wrote it
    parts = chunks.stored("layers.1.moe.experts.w1")  # [Chunk(key, offsets, sizes)], one per stored piece
    tensors = chunks.read(parts)                    # {chunk: tensor}: one pass over the files holding them

A DCP checkpoint stores every tensor as the pieces its ranks held (FSDP2 row shards, expert shards
over E_p, vocabulary intervals over P; a replicated tensor once), each piece an item of one
`.distcp` file, and `.metadata` lists every piece's offsets and sizes in the global tensor. `read`
plans one load of whole pieces through DCP's own `FileSystemReader` (the StorageReader protocol;
each file opened once per call, each item's bytes read once) into buffers of the pieces' shapes,
so a caller that asks for each piece once reads every stored byte once; `reads` counts per piece.

Legend: offsets/sizes are per dimension of the global tensor.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem


@dataclass(frozen=True)
class Chunk:
    """One stored piece of tensor `key`: rows/columns [offsets, offsets + sizes) of the global tensor."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


class _IntoBuffers(LoadPlanner):
    """The part of DCP's LoadPlanner protocol FileSystemReader.read_data calls: where each piece goes."""

    def __init__(self, buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
        self.buffers = buffers

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.buffers[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise ValueError(f"{read_item.dest_index.fqn} is not a tensor in this checkpoint")

    def set_up_planner(self, *args, **kwargs) -> None:  # the rest of the protocol is not used here
        raise NotImplementedError

    create_local_plan = create_global_plan = finish_plan = set_up_planner


STEP = re.compile(r"step-(\d+)")
METADATA = ".metadata"


def _steps_in(folder: str) -> list[str]:
    """The `step-N` folders in `folder`, by N."""
    names = [n for n in os.listdir(folder) if STEP.fullmatch(n) and os.path.isdir(os.path.join(folder, n))]
    return sorted(names, key=lambda n: int(STEP.fullmatch(n).group(1)))


def _listed(steps: list[str]) -> str:
    return ", ".join(steps[:5]) + (f", ... ({len(steps)} in all)" if len(steps) > 5 else "")


def check_step_folder(folder: str) -> None:
    """Raise ValueError unless `folder` is a DCP checkpoint folder (one holding .metadata), naming what
    it is instead: missing (with the step folders beside it), a file, or the parent of step-N folders.
    Reads no tensor data (a directory listing or two)."""
    pass_one = "pass a checkpoint step folder (--checkpoint DUMP/checkpoint/step-N)"
    if not os.path.exists(folder):
        parent = os.path.dirname(os.path.abspath(folder))
        beside = _steps_in(parent) if os.path.isdir(parent) else []
        where = (f"; {parent} holds {_listed(beside)}" if beside else
                 f" (nor does {parent})" if not os.path.isdir(parent) else "")
        raise ValueError(f"checkpoint folder {folder} does not exist{where}; {pass_one}")
    if not os.path.isdir(folder):
        raise ValueError(f"--checkpoint {folder} is a file, not a checkpoint folder; {pass_one}")
    if os.path.isfile(os.path.join(folder, METADATA)):
        return
    steps = _steps_in(folder)
    if steps:
        raise ValueError(f"{folder} is the checkpoints' parent folder, not a checkpoint: it holds "
                         f"{_listed(steps)}; pass one of them, e.g. --checkpoint "
                         f"{os.path.join(folder, steps[-1])} (the newest)")
    raise ValueError(f"{folder} holds no DCP {METADATA}, so it is not a checkpoint (or is a save "
                     f"that died before its commit); {pass_one}")


class DCPChunks:
    """The tensors of the DCP checkpoint in `folder`, readable piece by piece (module docstring)."""

    def __init__(self, folder: str):
        self.folder = folder
        check_step_folder(folder)
        self.reader = FileSystemReader(folder)
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.reads: Counter = Counter()       # Chunk -> times read
        self.bytes_read = 0

    def missing_bytes(self) -> list[str]:
        """The data files .metadata names that are absent or shorter than the items it places in them
        (empty when every stored byte is there), without reading them."""
        need: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        problems = []
        for name, size in sorted(need.items()):
            path = os.path.join(self.folder, name)
            if not os.path.isfile(path):
                problems.append(f"{name} is missing")
            elif os.path.getsize(path) < size:
                problems.append(f"{name} has {os.path.getsize(path)} bytes, .metadata places {size}")
        return problems

    def _meta(self, key: str) -> TensorStorageMetadata:
        meta = self.metadata.state_dict_metadata.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            what = "missing" if meta is None else "not a tensor"
            raise ValueError(f"checkpoint {self.folder}: {key!r} is {what}; is this a checkpoint of the model "
                             f"named in its run's mop_model.json (or --flavor)?")
        return meta

    def size(self, key: str) -> tuple[int, ...]:
        return tuple(self._meta(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._meta(key).properties.dtype

    def stored(self, key: str) -> list[Chunk]:
        """The non-empty stored pieces of `key`."""
        out = [Chunk(key, tuple(c.offsets), tuple(c.sizes)) for c in self._meta(key).chunks]
        return [c for c in out if c.numel > 0]

    def read(self, chunks: list[Chunk]) -> dict[Chunk, torch.Tensor]:
        """Each piece whole, in the checkpoint's dtype, on the CPU."""
        buffers, items = {}, []
        for c in chunks:
            index = MetadataIndex(c.key, torch.Size(c.offsets))
            zeros = torch.Size([0] * len(c.sizes))
            items.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, torch.Size(c.sizes)))
            buffers[(c.key, c.offsets)] = torch.empty(c.sizes, dtype=self.dtype(c.key))
        if items:
            plan = self.reader.prepare_local_plan(LoadPlan(items))
            plan = self.reader.prepare_global_plan([plan])[0]
            self.reader.read_data(plan, _IntoBuffers(buffers)).wait()
        for c in chunks:
            self.reads[c] += 1
            self.bytes_read += buffers[(c.key, c.offsets)].nbytes
        return {c: buffers[(c.key, c.offsets)] for c in chunks}
