"""Start a run from Hugging Face DeepseekV3 safetensors: each rank reads only the slices it owns.

    [checkpoint]
    enable = true
    initial_load_path = "DIR"          # config.json + model*.safetensors (+ index), e.g. `mop-train export`'s
    initial_load_in_hf = true

torchtitan's CheckpointManager takes this branch when the run's checkpoint folder does not exist
yet (a resume from it ignores the HF folder) and calls our `dcp_load` with the model's state dict
(train/checkpoint.py), which calls `load_hf_weights`. For each entry of that state dict (a DTensor:
an FSDP2 row shard over W, an expert shard over E_p, a vocabulary interval over P; or a plain
tensor such as the router bias) the rank computes the box of the global tensor it holds (DTensor's
own rule: `compute_local_shape_and_global_offset`), reads exactly that box of the HF tensors through
`safe_open(...).get_slice` (experts: rows [e0, e1) of our stacked tensor are HF experts e0..e1-1, each
read over the box's other dimensions), casts it into the local shard in place, checks it finite, and
then the wrapper's `load_state_dict` applies the state dict (torchtitan's own flow: to_hf -> read ->
from_hf -> load_state_dict, as in its DeepSeekV3StateDictAdapter, our model here).
config.json is checked against the run's model first (names.check_hf_config), and every HF tensor's
shape; float8 checkpoints are refused (dequantize first). Tensors of the folder the model does not
take are named in one line on rank 0: the multi-token-prediction layers (num_nextn_predict_layers;
DeepSeek-V3's published checkpoints carry one), which our model does not have, are not loaded.

Legend: W ranks, E_p expert degree, P vocab degree, E experts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchtitan.tools.logging import logger

from mop_train.hf.names import HFTensor, check_hf_config, hf_tensors
from mop_train.models.args import MoEModelArgs

INDEX = "model.safetensors.index.json"


@dataclass
class HFLoadReport:
    elements_read: int = 0     # elements this rank read from the HF files
    slices: int = 0            # get_slice reads
    elements_total: int = 0    # elements of the whole HF checkpoint
    note: str | None = None    # what the folder holds that the model does not take (MTP layers), or None


def _weight_map(folder: str) -> dict[str, str]:
    """HF tensor name -> file, from the index or the one model.safetensors."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"checkpoint.initial_load_path = {folder} holds neither {INDEX} nor model.safetensors; "
                         f"point it at a Hugging Face model folder (e.g. one `mop-train export` wrote)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: "model.safetensors" for name in f.keys()}


class HFFiles:
    """The safetensors files of an HF folder, opened once each, checked against the tensors we need."""

    def __init__(self, folder: str, tensors: list[HFTensor]):
        from safetensors import safe_open

        self.folder, self.weight_map = folder, _weight_map(folder)
        missing = [t.name for t in tensors if t.name not in self.weight_map]
        if missing:
            raise ValueError(f"{folder}: {len(missing)} tensors the run's model needs are missing, e.g. "
                             f"{missing[:3]}; is this checkpoint of the model.flavor being trained?")
        self.handles = {}
        for name in sorted({self.weight_map[t.name] for t in tensors}):
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise ValueError(f"{folder}: {name}, which {INDEX} names for "
                                 f"{sum(f == name for f in self.weight_map.values())} tensors, is missing; "
                                 f"copy the whole Hugging Face folder")
            try:
                self.handles[name] = safe_open(path, framework="pt", device="cpu")
            except Exception as err:      # safetensors' SafetensorError: a truncated or damaged file
                raise ValueError(f"{folder}: {name} is not a readable safetensors file ({err}); copy it "
                                 f"again or export again") from None
        for t in tensors:
            piece = self.handles[self.weight_map[t.name]].get_slice(t.name)
            shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
            if shape != t.shape:
                raise ValueError(f"{folder}: {t.name} has shape {shape} but the run's model needs {t.shape}")
            if dtype.startswith("F8"):
                raise ValueError(f"{folder}: {t.name} is {dtype} (quantized); dequantize the checkpoint to "
                                 f"bfloat16 or float32 first")

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.handles[self.weight_map[name]].get_slice(name)[index]


def _local_box(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's tensor to write into, its offset in the global tensor)."""
    if isinstance(value, DTensor):
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return value.to_local(), tuple(offset)       # under no_grad: the local shard itself, not a copy
    return value, (0,) * value.dim()


def _fill(local: torch.Tensor, offset: tuple[int, ...], size: tuple[int, ...], pieces: list[HFTensor],
          files: HFFiles, report: HFLoadReport) -> None:
    """Copy the box [offset, offset + local.shape) of our global tensor out of its HF tensors."""
    stop = tuple(o + n for o, n in zip(offset, local.shape))
    for t in pieces:
        t0 = (t.expert,) + (0,) * (len(size) - 1) if t.expert is not None else (0,) * len(size)
        t1 = (t.expert + 1,) + size[1:] if t.expert is not None else size
        lo, hi = tuple(map(max, offset, t0)), tuple(map(min, stop, t1))
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        skip = 1 if t.expert is not None else 0       # an HF expert tensor has no expert dimension
        src = files.read(t.name, tuple(slice(a - b, c - b) for a, c, b in zip(lo[skip:], hi[skip:], t0[skip:])))
        dst = tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, offset))
        local[dst].copy_(src.reshape(local[dst].shape))
        report.elements_read += src.numel()
        report.slices += 1


def unused_note(config: dict, weight_map: dict[str, str], tensors: list[HFTensor], folder: str,
                n_layers: int) -> str | None:
    """One line naming the folder's tensors the model takes no value from: the multi-token-prediction
    layers (`num_nextn_predict_layers`, model.layers.{L}... after the L blocks: DeepSeek-V3's published
    checkpoints carry one), which our model does not have, and any other name; None when there are none."""
    mtp = config.get("num_nextn_predict_layers") or 0
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        raise ValueError(f"{folder}/config.json: num_nextn_predict_layers = {mtp!r} is not a count of layers; "
                         f"need an integer >= 0")
    unused = sorted(set(weight_map) - {t.name for t in tensors})
    layers = [f"model.layers.{n_layers + i}" for i in range(mtp)]
    in_mtp = [n for n in unused if any(n.startswith(p + ".") for p in layers)]
    other = [n for n in unused if n not in set(in_mtp)]
    parts = []
    if mtp:
        parts.append(f"config.json has num_nextn_predict_layers = {mtp}: its multi-token-prediction "
                     f"layer{'s' if mtp > 1 else ''} {', '.join(layers)} ({len(in_mtp)} tensors) "
                     f"{'are' if mtp > 1 else 'is'} not loaded, as mop_train's model has no MTP module "
                     f"(training uses and saves the other tensors only)")
    if other:
        parts.append(f"{len(other)} tensors the model has no place for are not loaded, e.g. {other[:3]}")
    return f"HF import from {folder}: " + "; ".join(parts) if parts else None


@torch.no_grad()
def load_hf_state_dict(state_dict: dict, folder: str, args: MoEModelArgs) -> HFLoadReport:
    """Fill every tensor of `state_dict` (our keys) in place with this rank's part of the HF folder."""
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint.initial_load_path = {folder}: cannot read config.json ({err}); point it "
                         f"at a Hugging Face model folder") from None
    check_hf_config(config, args, source=config_path)
    tensors = hf_tensors(args)
    by_key: dict[str, list[HFTensor]] = {}
    for t in tensors:
        by_key.setdefault(t.key, []).append(t)
    unknown = sorted(set(state_dict) - set(by_key))
    if unknown:
        raise ValueError(f"the model's state dict holds entries no HF tensor maps to: {unknown[:3]}")
    files = HFFiles(folder, tensors)
    report = HFLoadReport(elements_total=sum(torch.Size(t.shape).numel() for t in tensors),
                          note=unused_note(config, files.weight_map, tensors, folder, args.n_layers))
    for key, value in state_dict.items():
        local, offset = _local_box(value)
        _fill(local, offset, tuple(value.shape), by_key[key], files, report)
        if local.is_floating_point() and not torch.isfinite(local).all():
            raise ValueError(f"{folder}: the HF tensors of {key} hold NaN/inf; refusing to start from them")
    return report


def load_hf_weights(model_wrapper, state_dict: dict, folder: str) -> None:
    """torchtitan's `dcp_load(from_hf=True)` for our model: fill `state_dict` (torchtitan's ModelWrapper's
    flat model state dict) from the HF folder, then load it into the model."""
    (model,) = model_wrapper.model
    report = load_hf_state_dict(state_dict, folder, model.args)
    counts = [report.elements_read]
    if dist.is_initialized() and dist.get_world_size() > 1:   # every rank is here (torchtitan's load is SPMD)
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, report.elements_read)
    logger.info(f"HF import from {folder}: ranks read {counts} of the checkpoint's {report.elements_total} "
                f"elements (each its own slices)")
    if report.note and (not dist.is_initialized() or dist.get_rank() == 0 or _alone()):
        logger.warning(report.note)
    model_wrapper.load_state_dict(state_dict)


def _alone() -> bool:
    """A fake world's one process (its default group stands for identical ranks) is its own log."""
    from mop_train.ops.moe_dispatch.comm import stands_for_identical_ranks
    return stands_for_identical_ranks(dist.group.WORLD)
