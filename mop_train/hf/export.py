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
`mop-train export` first makes every check that reads no tensor data (`plan_export`: the model,
--out, the dtype, the tokenizer folder, .metadata against the model, the data files' lengths), then
checks the checkpoint against its manifest (train/integrity.py: one streamed pass over each file;
--no-verify skips it), then writes (`write_export`) into a new folder beside OUT that is renamed to
OUT once complete, so a failure partway (a tensor outside --dtype's range, a full disk) leaves OUT as
it was. A cast that would turn a finite value into inf (float16 above 65504) is refused, naming the
tensor, as its file is assembled (checking first would take a second read of the checkpoint). The router's gate and correction bias stay
fp32 whatever `dtype` (names.FP32_KEPT). torchtitan 0.2.2's `DeepSeekV3StateDictAdapter.to_hf` is the model for the
names; its whole-state-dict conversion is what the grouped reads replace.

Legend: E experts, I expert width, H hidden.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
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


def _pieces_of(t: HFTensor, box, pieces: dict[Chunk, torch.Tensor]):
    """(stored piece, its part inside `box` as a slice of the HF tensor, the same part as a slice of the piece)."""
    for chunk, data in pieces.items():
        if chunk.key != t.key or (ov := _overlap(box, chunk)) is None:
            continue
        lo, hi = ov
        yield (data, tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, box[0])),
               tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, chunk.offsets)))


def _assemble(t: HFTensor, box, pieces: dict[Chunk, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """HF tensor `t` copied out of the stored pieces of its key that overlap its box, cast to `dtype`
    (refused when a finite value would become inf: outside `dtype`'s range)."""
    out = torch.empty(tuple(b - a for a, b in zip(*box)), dtype=dtype)
    covered, cast = 0, False
    for data, dst, src in _pieces_of(t, box, pieces):
        out[dst] = data[src]
        covered += out[dst].numel()
        cast |= data.dtype != dtype
    if covered != out.numel():
        raise ValueError(f"{t.key}: the checkpoint's stored pieces cover {covered} of the {out.numel()} "
                         f"elements of {t.name} (an incomplete checkpoint?)")
    if cast and out.is_floating_point() and torch.isinf(out).any():
        _check_range(t, box, pieces, out)
    return out.reshape(t.shape)


def _check_range(t: HFTensor, box, pieces: dict[Chunk, torch.Tensor], out: torch.Tensor) -> None:
    """Raise when an inf of `out` was a finite stored value (an inf stored as inf is left to the import)."""
    overflow, biggest = False, 0.0
    for data, dst, src in _pieces_of(t, box, pieces):
        stored = data[src]
        finite = torch.isfinite(stored)
        overflow |= bool((torch.isinf(out[dst]) & finite).any())
        if finite.any():
            biggest = max(biggest, stored[finite].abs().max().item())
    if overflow:
        name = _dtype_name(out.dtype)
        instead = "bfloat16 or float32" if out.dtype == torch.float16 else "float32"
        raise ValueError(f"--dtype {name}: {t.name} ({t.key} in the checkpoint) holds |values| up to {biggest:.6g}, "
                         f"above {name}'s largest {torch.finfo(out.dtype).max:.6g}, so it would be written as inf "
                         f"(which the import refuses); nothing was written; export with --dtype {instead}")


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


@dataclass
class ExportPlan:
    """What `plan_export` checked and decided, for `write_export`: no tensor data read yet."""

    checkpoint: str
    out: str
    args: MoEModelArgs
    dtype: torch.dtype | None
    tokenizer_folder: str | None
    chunks: DCPChunks
    dtypes: dict[str, torch.dtype]        # HF name -> dtype written
    groups: list[list[HFTensor]]          # the tensors of each file, in order
    needs: list[set[Chunk]]               # the stored pieces each file's tensors touch


def check_out(out: str) -> None:
    """`out` must be a new or empty folder (an export never writes over another)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file, not a folder; export into a new folder")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"--out {out} exists and is not empty; export into a new folder")


def plan_export(checkpoint: str, out: str, args: MoEModelArgs, *, dtype: torch.dtype | None = None,
                max_shard_bytes: int = 2 << 30, tokenizer_folder: str | None = None) -> ExportPlan:
    """Every check of an export that reads no tensor data (the model, --out, the dtype, the tokenizer
    folder, the checkpoint's .metadata against the model, every data file's presence and length), and
    its plan of files. Raises ValueError before anything is read or written."""
    check_exportable(args)
    check_out(out)
    if dtype is not None and dtype not in DTYPES.values():
        raise ValueError(f"--dtype {dtype}: export writes {', '.join(DTYPES)} only")
    if tokenizer_folder:
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
    return ExportPlan(checkpoint, out, args, dtype, tokenizer_folder, chunks, dtypes, groups, needs)


def export_checkpoint(checkpoint: str, out: str, args: MoEModelArgs, *, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = 2 << 30, tokenizer_folder: str | None = None,
                      verify=None) -> ExportReport:
    """Write the HF folder `out` (new or empty) from the DCP checkpoint folder `checkpoint`; with `verify`,
    the checkpoint is first checked against its manifest (after every check that reads no data)."""
    plan = plan_export(checkpoint, out, args, dtype=dtype, max_shard_bytes=max_shard_bytes,
                       tokenizer_folder=tokenizer_folder)
    if verify is not None:              # checkpoint -> None or raise: the caller's manifest check
        verify(checkpoint)              # (train/integrity.py, above this floor: passed in by the CLI)
    return write_export(plan)


def write_export(plan: ExportPlan) -> ExportReport:
    """Write the planned export into a new folder beside `plan.out`, renamed to it when complete: a
    failure (a refused tensor, a full disk, an interrupt) leaves `plan.out` as it was and removes what
    it wrote (a process killed outright leaves a `.NAME.partial-*` folder beside it)."""
    final = os.path.realpath(plan.out)
    parent = os.path.dirname(final)
    created, tmp = _first_missing(parent), None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.partial-", dir=parent)
        os.chmod(tmp, 0o777 & ~_umask())                  # a folder's usual mode, not mkdtemp's 0700
        report = _write(plan, tmp)
        check_out(plan.out)                              # still empty (nothing else wrote into it meanwhile)
        os.replace(tmp, final)                           # onto an empty folder: POSIX rename replaces it
    except BaseException:
        if created or tmp:
            shutil.rmtree(created or tmp, ignore_errors=True)
        raise
    return report


def _first_missing(path: str) -> str | None:
    """The outermost folder of `path` that does not exist yet (os.makedirs would create it), or None."""
    missing = None
    while not os.path.exists(path):
        missing, path = path, os.path.dirname(path)
    return missing


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write(plan: ExportPlan, out: str) -> ExportReport:
    """The files of `plan` into the folder `out` (module docstring: each stored piece read once)."""
    chunks, groups, needs = plan.chunks, plan.groups, plan.needs
    last_use = {c: i for i, need in enumerate(needs) for c in need}
    report, held, weight_map = ExportReport([], 0, 0), {}, {}
    from safetensors.torch import save_file

    for i, group in enumerate(groups):
        held.update(chunks.read(sorted(needs[i] - set(held), key=lambda c: (c.key, c.offsets))))
        data = {t.name: _assemble(t, _box(t, chunks.size(t.key)), held, plan.dtypes[t.name]) for t in group}
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
    if plan.tokenizer_folder:
        report.tokenizer_files, bos, eos = copy_tokenizer(plan.tokenizer_folder, out)
    config = hf_config(plan.args, dtype=_dtype_name(plan.dtype or chunks.dtype("tok_embeddings.weight")),
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
