"""Checksum manifests of DCP checkpoints: written after the commit, verified before a load.

    write_manifest(folder, rank=r, world=W)          # every rank, after the DCP save returned
    problems = verify(folder, rank=r, world=W)       # every rank; the same list everywhere
    step, note = choose_step(base, requested, ...)   # the checkpoint to resume from, or an error

`{base}/step-N/manifest.json` lists every file of the checkpoint (every rank's `.distcp` shards
and `.metadata`) with its size and SHA-256. The files are hashed by all ranks (file i by rank
i mod W) and rank 0 writes the manifest last, atomically, so a folder without one is not a
complete checkpoint, whatever `.metadata` says: torchtitan 0.2.2 takes `.metadata` alone as
complete, and a re-save that dies before its commit leaves an old `.metadata` beside new data.

Legend: W ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import torch.distributed as dist

from mop_train.train.reliability import CheckpointError

MANIFEST = "manifest.json"
_CHUNK = 1 << 24


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def write_manifest(folder: str, *, rank: int, world: int) -> None:
    """Hash the committed checkpoint in `folder` (all ranks), then rank 0 writes its manifest."""
    names = sorted(n for n in os.listdir(folder) if n != MANIFEST and not n.startswith(MANIFEST))
    mine = {n: {"bytes": os.path.getsize(os.path.join(folder, n)), "sha256": sha256(os.path.join(folder, n))}
            for n in _share(names, rank, world)}
    files = {k: v for part in _gather(mine, world) for k, v in part.items()}
    if rank == 0:
        tmp = os.path.join(folder, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"files": files}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, MANIFEST))
    if world > 1:
        dist.barrier()


def check_files(folder: str, names: list[str], files: dict) -> list[str]:
    """Problems of `names` (a share of the manifest's files) against their recorded size and hash."""
    problems = []
    for name in names:
        path, want = os.path.join(folder, name), files[name]
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
        elif os.path.getsize(path) != want["bytes"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, the manifest says {want['bytes']} "
                            f"(truncated or overwritten)")
        elif sha256(path) != want["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest (corrupted bytes)")
    return problems


def read_manifest(folder: str) -> tuple[dict | None, str | None]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None, (f"{path}: missing, so the checkpoint was never completed (a save that died before "
                      f"its commit, or one written before manifests existed)")
    try:
        with open(path) as f:
            return json.load(f)["files"], None
    except (OSError, ValueError, KeyError) as err:
        return None, f"{path}: unreadable ({err})"


def verify(folder: str, *, rank: int, world: int) -> list[str]:
    """Every problem of the checkpoint in `folder`; each rank checks a share, all get the whole list."""
    files, problem = read_manifest(folder)
    if files is None:
        return [problem]
    mine = check_files(folder, _share(sorted(files), rank, world), files)
    return sorted(p for part in _gather(mine, world) for p in part)


def step_folders(base: str) -> list[int]:
    """The steps N of `{base}/step-N` folders, ascending."""
    if not os.path.isdir(base):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(base) if (m := re.fullmatch(r"step-(\d+)", n)))


def choose_step(base: str, requested: int, *, fallback: bool, rank: int, world: int) -> tuple[int, str | None]:
    """The step to resume from (-1: none) and a note for the log; raises ValueError when the
    checkpoint to resume from fails verification (CheckpointError naming the files, and the newest
    older one that passes) unless `fallback` takes that one.

    Args:
        requested: checkpoint.load_step (-1: the newest step folder).
    """
    steps = step_folders(base)
    if not steps:
        return -1, None
    step = max(steps) if requested == -1 else requested
    folder = os.path.join(base, f"step-{step}")
    if not os.path.isdir(folder):
        raise ValueError(f"checkpoint.load_step = {requested} but {folder} does not exist; "
                         f"available steps: {steps}")
    problems = verify(folder, rank=rank, world=world)
    if not problems:
        return step, None
    older = next((s for s in reversed(steps) if s < step
                  and not verify(os.path.join(base, f"step-{s}"), rank=rank, world=world)), None)
    head = f"checkpoint {folder} failed verification: " + "; ".join(problems[:5]) + (
        f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
    if older is None:
        raise CheckpointError(f"{head}. No older complete, verified checkpoint exists in {base}; move {folder} "
                         f"away to start afresh")
    if fallback:
        return older, (f"{head}; resuming from {os.path.join(base, f'step-{older}')}, the newest complete "
                       f"verified checkpoint (mop.reliability.resume_from_verified)")
    raise CheckpointError(f"{head}. The newest complete, verified checkpoint is {os.path.join(base, f'step-{older}')}: "
                     f"resume from it with --mop.reliability.resume_from_verified (or --checkpoint.load_step "
                     f"{older})")
