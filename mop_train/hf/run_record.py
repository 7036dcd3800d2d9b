"""What model a run trains, recorded in its dump folder so that its checkpoints can be exported alone.

    write_run_record(dump_folder, flavor=..., args=..., tokenizer_folder=..., checkpoint_folder=...)  # rank 0, at launch
    record = find_run_record(step_folder)   # DUMP/checkpoint/step-N -> DUMP/mop_model.json, or None

`{dump_folder}/mop_model.json` holds the flavor, every field of its MoEModelArgs (so a later change
of the zoo does not change what an old checkpoint means), the tokenizer folder the run read
(`model.hf_assets_path`, resolved: the embedded tokenizer's build folder), and the checkpoint folder
relative to the dump folder. A DCP checkpoint holds tensors only; `mop-train export` reads this file
to know the model. Written atomically (a temporary file renamed into place) at every launch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

from mop_train.models.args import MoEModelArgs

RECORD = "mop_model.json"


@dataclass(frozen=True)
class RunRecord:
    flavor: str
    args: MoEModelArgs
    tokenizer_folder: str | None      # a folder holding tokenizer.json, or None
    checkpoint_folder: str            # relative to the dump folder (or absolute)
    path: str                         # the record's own file


def write_run_record(dump_folder: str, *, flavor: str, args: MoEModelArgs, tokenizer_folder: str | None,
                     checkpoint_folder: str) -> str:
    """Write `{dump_folder}/mop_model.json` (call on one rank); returns its path."""
    os.makedirs(dump_folder, exist_ok=True)
    path = os.path.join(dump_folder, RECORD)
    body = {"flavor": flavor, "model_args": asdict(args),
            "tokenizer_folder": os.path.abspath(tokenizer_folder) if tokenizer_folder else None,
            "checkpoint_folder": checkpoint_folder}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def read_run_record(path: str) -> RunRecord:
    try:
        with open(path) as f:
            body = json.load(f)
        known = {f.name for f in fields(MoEModelArgs)}
        args = MoEModelArgs(**{k: v for k, v in body["model_args"].items() if k in known}).validate()
        return RunRecord(body["flavor"], args, body.get("tokenizer_folder"), body["checkpoint_folder"], path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: unreadable run record ({type(err).__name__}: {err}); pass --flavor "
                         f"(and --tokenizer) to `mop-train export` instead") from None


def find_run_record(step_folder: str, max_levels: int = 4) -> RunRecord | None:
    """The record of the run whose checkpoint folder holds `step_folder`: the nearest folder above
    it with a mop_model.json whose checkpoint_folder leads back to step_folder's parent."""
    base = os.path.dirname(os.path.abspath(step_folder))
    folder = base
    for _ in range(max_levels):
        folder = os.path.dirname(folder)
        path = os.path.join(folder, RECORD)
        if os.path.isfile(path):
            rel = read_run_record(path).checkpoint_folder
            if os.path.realpath(os.path.join(folder, rel)) == os.path.realpath(base):
                return read_run_record(path)
        if folder == os.path.dirname(folder):
            break
    return None
