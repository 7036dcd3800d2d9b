"""Checksum manifests of DCP checkpoints: written after the commit, verified before a load.

    write_manifest(folder, rank=r, world=W)          # every rank, after the DCP save returned
    problems = verify(folder, rank=r, world=W)       # every rank; the same list everywhere
    resume = choose_step(base, requested, ...)       # the checkpoint to resume from, or an error
    moved = set_aside(base, resume.incomplete, ...)  # saves cut short: out of torchtitan's sight

`{base}/step-N/manifest.json` lists every file of the checkpoint (every rank's `.distcp` shards
and `.metadata`) with its size and SHA-256. The files are hashed by all ranks (file i by rank
i mod W) and rank 0 writes the manifest last, atomically, so a folder without one is not a
complete checkpoint, whatever `.metadata` says: torchtitan 0.2.2 takes `.metadata` alone as
complete, and a re-save that dies before its commit leaves an old `.metadata` beside new data.
A resume skips such folders (newest first) and renames them out of torchtitan's `step-N` pattern;
a complete checkpoint whose bytes differ from its manifest is refused (exit 4) unless asked to
fall back to an older verified one. A checkpoint of the model alone (`checkpoint.last_save_model_only`
at a run's last step: no optimizer state, data position or step) is passed over for the newest full
one, and kept: it holds the run's final weights. A roll-back (checkpoint.load_step older than the newest)
moves the newer checkpoints aside to `superseded-N`, so a later resume never takes the abandoned history.

Legend: W ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

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


def model_only(folder: str) -> bool:
    """Whether the DCP checkpoint in `folder` holds the model alone: torchtitan's save of a run's last step
    under `checkpoint.last_save_model_only = true` (its default), with no train state, optimizer state or
    data position, so no run can resume from it. Read from `.metadata`; False when that is unreadable
    (verification names it). Step 0 is torchtitan's model-only seed checkpoint, which it loads as such:
    callers leave it out."""
    try:
        keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception:   # (DCP raises several types for a missing or damaged .metadata)
        return False
    return not any(k.startswith("train_state.") for k in keys)


def weights_alone(base: str, step: int) -> bool:
    """Whether `{base}/step-N` holds the model alone (`model_only`; step 0, the seed checkpoint, never)."""
    return step > 0 and model_only(_folder(base, step))


def complete(base: str, step: int) -> bool:
    """Whether `{base}/step-N` holds its manifest: a save that finished (only such folders are resumed)."""
    return os.path.isfile(os.path.join(_folder(base, step), MANIFEST))


@dataclass(frozen=True)
class Resume:
    """What `choose_step` decided: the step to load (-1: none), a note for the log, and the newer
    step folders skipped because they hold no manifest (saves cut short: never checkpoints)."""

    step: int
    note: str | None = None
    incomplete: tuple[int, ...] = ()
    superseded: tuple[int, ...] = ()   # complete full checkpoints newer than a requested (older) step


def choose_step(base: str, requested: int, *, fallback: bool, rank: int, world: int) -> Resume:
    """The checkpoint to resume from; raises CheckpointError when it fails verification (naming
    the files, and the newest older one that passes) unless `fallback` takes that one.

    With `requested` = -1 (checkpoint.load_step's default: the newest), step folders without a
    manifest, newest first, are skipped (`Resume.incomplete`): a save that was cut short (torchrun's
    SIGKILL 30 s after SIGTERM, a crash mid-save) never became a checkpoint. A complete checkpoint
    whose bytes do not match its manifest is refused. A folder named by `requested` must verify.
    A checkpoint of the model alone (`model_only`: a run's last save under checkpoint.last_save_model_only)
    cannot be resumed from: the newest full one older than it is taken (said in the note), and a
    folder holding nothing else, or a `requested` one, is refused (ValueError) rather than started
    afresh over it.
    """
    steps = step_folders(base)
    if not steps:
        return Resume(-1)
    if requested != -1 and requested not in steps:
        raise ValueError(f"checkpoint.load_step = {requested} but {_folder(base, requested)} does not exist; "
                         f"available steps: {steps}")
    if requested != -1 and weights_alone(base, requested):
        raise ValueError(_model_only_refusal(base, [requested], f"checkpoint.load_step = {requested} names "))
    incomplete: list[int] = []
    passed: list[int] = []   # the model-only checkpoints passed over
    step = requested
    if requested == -1:
        for s in reversed(steps):
            if not complete(base, s):
                incomplete.append(s)
            elif weights_alone(base, s):
                passed.append(s)
            else:
                step = s
                break
        if step == -1 and passed:
            raise ValueError(_model_only_refusal(base, passed, f"{base} holds no checkpoint to resume from: "))
        if step == -1:
            return Resume(-1, None, tuple(incomplete))
    passed_over = (f"{', '.join(_folder(base, s) for s in passed)} "
                   f"{'hold' if len(passed) > 1 else 'holds'} the model's weights alone "
                   f"(checkpoint.last_save_model_only = true at a run's last step: no optimizer state, data "
                   f"position or step), so a run cannot resume from {'them' if len(passed) > 1 else 'it'} "
                   f"(kept); " if passed else "")
    problems = verify(_folder(base, step), rank=rank, world=world)
    if not problems:
        note = f"{passed_over}resuming from {_folder(base, step)}, the newest full checkpoint" if passed_over else None
        return Resume(step, note, tuple(incomplete), _newer_full(base, steps, requested))
    older = next((s for s in reversed(steps) if s < step and not weights_alone(base, s)
                  and not verify(_folder(base, s), rank=rank, world=world)), None)
    folder = _folder(base, step)
    head = f"checkpoint {folder} failed verification: " + "; ".join(problems[:5]) + (
        f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
    if older is None:
        raise CheckpointError(f"{head}. No older complete, verified checkpoint exists in {base}; move {folder} "
                              f"away to start afresh", agreed=True)
    if fallback:
        return Resume(older, f"{passed_over}{head}; resuming from {_folder(base, older)}, the newest complete "
                             f"verified checkpoint (mop.reliability.resume_from_verified)", tuple(incomplete))
    raise CheckpointError(f"{head}. The newest complete, verified checkpoint is {_folder(base, older)}: resume "
                          f"from it with --mop.reliability.resume_from_verified (or --checkpoint.load_step "
                          f"{older})", agreed=True)


def _newer_full(base: str, steps: list[int], requested: int) -> tuple[int, ...]:
    """The complete full checkpoints newer than a requested step (checkpoint.load_step: a roll-back),
    newest first. The run resumed from `requested` writes another history: left as `step-N`, the newest
    of them was what the next plain resume took (a run rolled back to step 2 and stopped at 5 went on
    from the abandoned run's step 6)."""
    if requested == -1:
        return ()
    return tuple(s for s in reversed(steps) if s > requested and complete(base, s) and not weights_alone(base, s))


def _folder(base: str, step: int) -> str:
    return os.path.join(base, f"step-{step}")


def _model_only_refusal(base: str, steps: list[int], head: str) -> str:
    """Why checkpoints of the model alone cannot be resumed from, and what to do instead."""
    folders = ", ".join(_folder(base, s) for s in steps)
    return (f"{head}{folders}, which {'hold' if len(steps) > 1 else 'holds'} the model's weights alone "
            f"(checkpoint.last_save_model_only = true, torchtitan's default, saves a run's last step without its "
            f"optimizer state, data position or step), so a run cannot resume from "
            f"{'them' if len(steps) > 1 else 'it'}; to train on from those weights, start a run in another "
            f"--job.dump_folder with --checkpoint.initial_load_path {_folder(base, steps[0])} "
            f"--checkpoint.initial_load_model_only (fresh optimizer state and data position), and set "
            f"--checkpoint.no-last_save_model_only so that a run's last save can be resumed from")


SET_ASIDE = "incomplete-{step}"
r"""Where `set_aside` moves an incomplete `step-N` folder: a name torchtitan's `step-(\d+)` search
(its load and its keep_latest_k purge) does not match, so it neither takes nor counts it."""


SUPERSEDED = "superseded-{step}"
"""Where `set_aside` moves a checkpoint newer than the one a roll-back (checkpoint.load_step) resumed from:
out of torchtitan's `step-N` pattern, so no later resume takes the abandoned history."""


def set_aside(base: str, steps: tuple[int, ...], *, rank: int, world: int, name: str = SET_ASIDE) -> list[str]:
    """Rank 0 renames each incomplete `{base}/step-N` to `{base}/incomplete-N` (`incomplete-N.K`
    when that exists; `name`: another pattern, SUPERSEDED) once every rank has decided; returns the new
    paths (rank 0's, on every rank)."""
    if world > 1:
        dist.barrier()   # every rank has looked at the folders before any is renamed
    moved: list = [None]
    if rank == 0:
        moved[0] = []
        for step in steps:
            target, k = os.path.join(base, name.format(step=step)), 1
            while os.path.exists(target + (f".{k}" if k > 1 else "")):
                k += 1
            target += f".{k}" if k > 1 else ""
            os.rename(_folder(base, step), target)
            moved[0].append(target)
    if world > 1:
        dist.broadcast_object_list(moved, src=0)
    return moved[0]


def describe_superseded(base: str, steps: tuple[int, ...], moved: list[str], taken: int) -> str:
    """The one log line that says which newer checkpoints a roll-back set aside."""
    return (f"checkpoint.load_step = {taken}: the newer checkpoints {', '.join(f'step-{s}' for s in steps)} in "
            f"{base} belong to the history this run rolls back from, so no later resume may take them: moved "
            f"aside to {', '.join(moved)} (delete them when not needed)")


def describe_skipped(base: str, steps: tuple[int, ...], moved: list[str], taken: int) -> str:
    """The one log line that says which incomplete saves a resume skipped and what it took."""
    names = ", ".join(f"step-{s}" for s in steps)
    where = ", ".join(moved)
    took = (f"resuming from {_folder(base, taken)}" if taken != -1 else
            "no complete checkpoint remains, so training starts from step 0")
    return (f"skipped {names} in {base}: no {MANIFEST}, a save cut short that never became a checkpoint "
            f"(moved aside to {where}; delete it when not needed); {took}")
