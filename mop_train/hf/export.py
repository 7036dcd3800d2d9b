"""`mop-train export`: a DCP checkpoint of the MLA family -> a Hugging Face DeepseekV3 folder, on CPU.

    report = export_checkpoint("DUMP/checkpoint/step-N", "OUT", args, dtype=torch.bfloat16,
                               max_shard_bytes=2 << 30, tokenizer_folder=...)

OUT gets config.json (names.hf_config), model-0000i-of-0000n.safetensors with
model.safetensors.index.json (`weight_map`, `total_size`), and the run's tokenizer files when it
used an HF tokenizer (tokenizer.json, tokenizer_config.json, ...). How:
  1. the HF tensors (names.hf_tensors), in model order, are cut into files of at most
     `max_shard_bytes` each (a tensor larger than that gets a file of its own);
  2. per file, the stored DCP pieces its tensors touch (dcp_chunks: global offsets in .metadata, so
     the layout that wrote the checkpoint does not matter) that were not read yet are read in one
     pass; each HF tensor is copied out of them (an expert: its rows of our stacked [E, ...] tensor)
     and cast; the file is written; pieces no later file needs are dropped.
Every stored piece is read exactly once (`report.chunk_reads`). Host memory held at once (the
bound, measured as `report.peak_bytes`): the tensors of one output file (<= max_shard_bytes, or the
one larger tensor) + the stored pieces those tensors touch (in the checkpoint's dtype) that are not
used up yet; a stored piece is at most one rank's shard of one tensor, which that rank held.
`mop-train export` first checks the checkpoint against its manifest (train/integrity.py: one
streamed pass over each file; --no-verify skips it). The router's gate and correction bias stay
fp32 whatever `dtype` (names.FP32_KEPT). torchtitan 0.2.2's `DeepSeekV3StateDictAdapter.to_hf` is the model for the
names; its whole-state-dict conversion is what the grouped reads replace.

Legend: E experts, I expert width, H hidden.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import torch
from torch import nn

from mop_train.hf.dcp_chunks import Chunk, DCPChunks
from mop_train.hf.names import HFTensor, check_exportable, hf_config, hf_tensors
from mop_train.models.args import MoEModelArgs
from mop_train.models.model import MoETransformer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
"""Files of an HF tokenizer folder that are copied (the embedded corpus beside them is not)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportReport:
    files: list[str]                      # safetensors files written, in order
    total_bytes: int                      # tensor bytes in them (index.json's total_size)
    peak_bytes: int                       # most host bytes held at once: output tensors + stored pieces
    chunk_reads: dict = field(default_factory=dict)   # Chunk -> times read (1 each)
    tokenizer_files: list[str] = field(default_factory=list)


def our_shapes(args: MoEModelArgs) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry (parameters and persistent buffers) of the model `args` describes."""
    with torch.device("meta"):
        model: nn.Module = MoETransformer(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_mapping(args: MoEModelArgs, tensors: list[HFTensor]) -> None:
    """Every entry of our state dict is covered by the HF tensors exactly, and nothing else."""
    shapes, mapped = our_shapes(args), {t.key for t in tensors}
    if mapped != set(shapes):
        raise ValueError(f"HF names do not cover the model: unmapped {sorted(set(shapes) - mapped)[:5]}, "
                         f"unknown {sorted(mapped - set(shapes))[:5]} (a model change without names.py?)")
    for t in tensors:
        want = shapes[t.key][1:] if t.expert is not None else shapes[t.key]
        if tuple(t.shape) != want:
            raise ValueError(f"{t.name}: HF shape {t.shape} but {t.key} gives {want} (names.py out of date?)")


def _box(t: HFTensor, size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """[start, stop) per dimension of our global tensor `t.key` that HF tensor `t` is."""
    if t.expert is None:
        return (0,) * len(size), size
    return (t.expert,) + (0,) * (len(size) - 1), (t.expert + 1,) + size[1:]


def _overlap(box, chunk: Chunk):
    lo = tuple(max(b, c) for b, c in zip(box[0], chunk.offsets))
    hi = tuple(min(b, c + s) for b, c, s in zip(box[1], chunk.offsets, chunk.sizes))
    return (lo, hi) if all(a < b for a, b in zip(lo, hi)) else None


def _assemble(t: HFTensor, box, pieces: dict[Chunk, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """HF tensor `t` copied out of the stored pieces of its key that overlap its box."""
    out = torch.empty(tuple(b - a for a, b in zip(*box)), dtype=dtype)
    covered = 0
    for chunk, data in pieces.items():
        if chunk.key != t.key or (ov := _overlap(box, chunk)) is None:
            continue
        lo, hi = ov
        dst = tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, box[0]))
        src = tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, chunk.offsets))
        out[dst] = data[src]
        covered += out[dst].numel()
    if covered != out.numel():
        raise ValueError(f"{t.key}: the checkpoint's stored pieces cover {covered} of the {out.numel()} "
                         f"elements of {t.name} (an incomplete checkpoint?)")
    return out.reshape(t.shape)


def _out_dtype(t: HFTensor, dtype: torch.dtype | None, stored: torch.dtype) -> torch.dtype:
    return torch.float32 if t.keep_fp32 else (dtype or stored)


def plan_files(tensors: list[HFTensor], nbytes: dict[str, int], max_shard_bytes: int) -> list[list[HFTensor]]:
    """Consecutive tensors packed into files of at most max_shard_bytes (one larger tensor alone)."""
    files, current, size = [], [], 0
    for t in tensors:
        if current and size + nbytes[t.name] > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes[t.name]
    return files + ([current] if current else [])


def export_checkpoint(checkpoint: str, out: str, args: MoEModelArgs, *, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = 2 << 30, tokenizer_folder: str | None = None) -> ExportReport:
    """Write the HF folder `out` (new or empty) from the DCP checkpoint folder `checkpoint`."""
    check_exportable(args)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file, not a folder; export into a new folder")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"--out {out} exists and is not empty; export into a new folder")
    if tokenizer_folder:                    # refused before anything is written, so a rerun may use `out`
        _tokenizer_json(tokenizer_folder)
    chunks, tensors = DCPChunks(checkpoint), hf_tensors(args)
    problems = chunks.missing_bytes()
    if problems:
        raise ValueError(f"checkpoint {checkpoint} is incomplete: {'; '.join(problems[:3])}; export a complete "
                         f"checkpoint (a save that finished, copied whole)")
    check_mapping(args, tensors)
    shapes = our_shapes(args)
    for key in sorted(shapes):
        if chunks.size(key) != shapes[key]:
            raise ValueError(f"checkpoint {checkpoint}: {key} has shape {chunks.size(key)} but the model needs "
                             f"{shapes[key]}; export with the --flavor it was trained with")
    dtypes = {t.name: _out_dtype(t, dtype, chunks.dtype(t.key)) for t in tensors}
    nbytes = {t.name: torch.Size(t.shape).numel() * dtypes[t.name].itemsize for t in tensors}
    groups = plan_files(tensors, nbytes, max_shard_bytes)
    needs = [{c for t in g for c in chunks.stored(t.key) if _overlap(_box(t, chunks.size(t.key)), c)}
             for g in groups]
    last_use = {c: i for i, need in enumerate(needs) for c in need}
    os.makedirs(out, exist_ok=True)
    report, held, weight_map = ExportReport([], 0, 0), {}, {}
    from safetensors.torch import save_file

    for i, group in enumerate(groups):
        held.update(chunks.read(sorted(needs[i] - set(held), key=lambda c: (c.key, c.offsets))))
        data = {t.name: _assemble(t, _box(t, chunks.size(t.key)), held, dtypes[t.name]) for t in group}
        report.peak_bytes = max(report.peak_bytes, sum(v.nbytes for v in held.values())
                                + sum(v.nbytes for v in data.values()))
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(data, os.path.join(out, name), metadata={"format": "pt"})
        report.files.append(name)
        report.total_bytes += sum(v.nbytes for v in data.values())
        weight_map.update({t.name: name for t in group})
        del data
        held = {c: v for c, v in held.items() if last_use[c] > i}
    report.chunk_reads = dict(chunks.reads)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": report.total_bytes}, "weight_map": weight_map}, f, indent=2)
    bos = eos = None
    if tokenizer_folder:
        report.tokenizer_files, bos, eos = copy_tokenizer(tokenizer_folder, out)
    config = hf_config(args, dtype=_dtype_name(dtype or chunks.dtype("tok_embeddings.weight")),
                       bos_token_id=bos, eos_token_id=eos)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return report


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _token_id(tokenizer_json: str, config: dict, name: str) -> int | None:
    token = config.get(name)
    token = token.get("content") if isinstance(token, dict) else token
    if not token:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_json).token_to_id(token)


def _tokenizer_json(folder: str) -> str:
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        raise ValueError(f"tokenizer folder {folder} has no tokenizer.json (gone from the cache?); pass "
                         f"--tokenizer DIR, or --tokenizer none to export without one")
    return tokenizer_json


def copy_tokenizer(folder: str, out: str) -> tuple[list[str], int | None, int | None]:
    """Copy the HF tokenizer files of `folder` into `out`; returns (files, bos id, eos id)."""
    tokenizer_json = _tokenizer_json(folder)
    copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    for name in copied:
        shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
    config = {}
    if "tokenizer_config.json" in copied:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            config = json.load(f)
    return copied, _token_id(tokenizer_json, config, "bos_token"), _token_id(tokenizer_json, config, "eos_token")
