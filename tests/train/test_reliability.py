"""Reliability pieces that need no launch: strict metrics JSON, checkpoint manifests, the dump-folder lock.

The launched checks (non-finite steps, damaged checkpoints, SIGTERM, orphans, hangs) are in
tests/train/test_reliability_cli.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from mop_train.train import integrity
from mop_train.train.metrics import format_line, strict_json_record
from mop_train.train.reliability import CheckpointError, DumpFolderLock, DumpFolderLocked, Fault


def test_metrics_stay_strict_json():
    record = strict_json_record({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3,
                                 "tokens_per_s": 10.0, "peak_mem_gib": 0.5, "skipped": True, "skipped_steps": 1})
    text = json.dumps(record, allow_nan=False)
    back = json.loads(text)
    assert back["loss"] is None and back["grad_norm"] is None and back["nonfinite"] == ["loss", "grad_norm"]
    assert "SKIPPED" in format_line(back) and "loss nan" in format_line(back)
    clean = {"step": 1, "loss": 1.0}
    assert strict_json_record(clean) is clean


def test_resumed_metrics_read_as_one_run(tmp_path):
    """Resuming from step 4: records past it, and a line a crash cut short, move aside in order;
    records up to 4 stay; nothing moves when nothing is past the step."""
    from mop_train.train.metrics import supersede_records

    path = str(tmp_path / "metrics.jsonl")
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 4, 5, 6)]
    with open(path, "w") as f:
        f.writelines(lines + ['{"step": 7, "lo'])           # the crash cut the last record short
    note = supersede_records(path, after_step=4)
    assert open(path).readlines() == lines[:3]
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("metrics.jsonl.superseded-")]
    assert open(tmp_path / aside).read().splitlines() == [lines[3].strip(), lines[4].strip(), '{"step": 7, "lo']
    for part in ("2 records past step 4 (steps 5-6)", "1 unreadable line", aside):
        assert part in note, note
    assert supersede_records(path, after_step=4) is None and open(path).readlines() == lines[:3]


def test_log_line_says_step_of_total_elapsed_and_eta():
    record = {"step": 120, "total_steps": 200, "run_elapsed_s": 83.4, "eta_s": 55.6, "loss": 2.5,
              "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 100.0, "peak_mem_gib": 0.5}
    assert format_line(record).startswith("step 120/200  elapsed 0:01:23  eta 0:00:56  loss 2.5000")
    assert format_line({**record, "step": 7}).startswith("step   7/200  ")
    assert format_line({**record, "eta_s": None}).startswith("step 120/200  elapsed 0:01:23  eta ?  ")


def _fake_checkpoint(base, step: int) -> str:
    folder = os.path.join(base, f"step-{step}")
    os.makedirs(folder)
    for name, size in ((".metadata", 100), ("__0_0.distcp", 5000), ("__1_0.distcp", 7000)):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(os.urandom(size))
    integrity.write_manifest(folder, rank=0, world=1)
    return folder


def test_manifest_catches_truncation_flips_and_missing_files(tmp_path):
    base = str(tmp_path / "checkpoint")
    older, newest = _fake_checkpoint(base, 2), _fake_checkpoint(base, 4)
    assert integrity.verify(newest, rank=0, world=1) == []
    assert integrity.choose_step(base, -1, fallback=False, rank=0, world=1) == integrity.Resume(4)
    shard = os.path.join(newest, "__1_0.distcp")
    damages = {
        "truncated": lambda: os.truncate(shard, 3000),
        "SHA-256 differs": lambda: _flip_byte(shard, 4321),
        "missing": lambda: os.unlink(shard),
    }
    for needle, damage in damages.items():   # a complete checkpoint whose bytes differ: refused
        backup = open(shard, "rb").read() if os.path.exists(shard) else None
        damage()
        with pytest.raises(CheckpointError) as info:
            integrity.choose_step(base, -1, fallback=False, rank=0, world=1)
        assert info.value.exit_code == 4 and info.value.agreed
        msg = str(info.value)
        for part in (needle, shard, newest, older, "--mop.reliability.resume_from_verified"):
            assert part in msg, f"{part!r} missing from: {msg}"
        resume = integrity.choose_step(base, -1, fallback=True, rank=0, world=1)
        assert resume.step == 2 and older in resume.note
        with open(shard, "wb") as f:
            f.write(backup)
    _flip_byte(shard, 4321)
    _flip_byte(os.path.join(older, "__0_0.distcp"), 10)
    with pytest.raises(CheckpointError, match="No older complete, verified checkpoint"):
        integrity.choose_step(base, -1, fallback=True, rank=0, world=1)


def test_a_save_cut_short_is_skipped_not_refused(tmp_path):
    """Folders without a manifest (.metadata or not: saves that died before their commit), newest
    first, are skipped and set aside out of torchtitan's step-N pattern, named in one line with the
    checkpoint taken; asked for by --checkpoint.load_step, such a folder is refused."""
    base = str(tmp_path / "checkpoint")
    _fake_checkpoint(base, 2)
    for step in (4, 6):
        os.unlink(os.path.join(_fake_checkpoint(base, step), integrity.MANIFEST))
    os.unlink(os.path.join(base, "step-6", "__1_0.distcp"))
    resume = integrity.choose_step(base, -1, fallback=False, rank=0, world=1)
    assert resume == integrity.Resume(2, None, (6, 4))
    with pytest.raises(CheckpointError, match="never completed"):
        integrity.choose_step(base, 4, fallback=False, rank=0, world=1)
    os.makedirs(os.path.join(base, "incomplete-4"))          # an earlier cut save at the same step
    moved = integrity.set_aside(base, resume.incomplete, rank=0, world=1)
    assert moved == [os.path.join(base, "incomplete-6"), os.path.join(base, "incomplete-4.2")]
    assert integrity.step_folders(base) == [2] and all(os.path.isdir(m) for m in moved)
    note = integrity.describe_skipped(base, resume.incomplete, moved, resume.step)
    assert "\n" not in note
    for part in ("step-6, step-4", "no manifest.json", *moved, os.path.join(base, "step-2")):
        assert part in note, f"{part!r} missing from: {note}"
    os.unlink(os.path.join(base, "step-2", integrity.MANIFEST))   # nothing complete left: start afresh
    resume = integrity.choose_step(base, -1, fallback=False, rank=0, world=1)
    assert resume == integrity.Resume(-1, None, (2,))
    assert "starts from step 0" in integrity.describe_skipped(base, (2,), ["x"], -1)


def _dcp_checkpoint(base: str, step: int, *, model_only: bool, seed: int) -> str:
    """A real one-process DCP save at `{base}/step-N` with its manifest: model tensors alone (torchtitan's
    last_save_model_only save of a run's last step), or with a train state beside them (a full one)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(seed)
    state = {"tok_embeddings.weight": torch.randn(5, 3, generator=g)}
    if not model_only:
        state["train_state"] = {"step": torch.tensor(step), "tokens_seen": torch.randint(1, 99, (), generator=g)}
        state["optimizer"] = {"state.tok_embeddings.weight.exp_avg": torch.randn(5, 3, generator=g)}
    folder = os.path.join(base, f"step-{step}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    integrity.write_manifest(folder, rank=0, world=1)
    return folder


def test_a_model_only_last_save_is_passed_over_for_the_newest_full_checkpoint(tmp_path):
    """torchtitan's default checkpoint.last_save_model_only = true saves a run's last step without its
    optimizer state, data position or step. A run extended past it (more training.steps) took that folder,
    the newest, and failed in DCP's load with "does not fit this run: it has no '{fqn}.\")' ... resume
    with the model flavor and optimizer it was written with" (the key read off the traceback's source
    line). It now resumes from the newest full checkpoint, saying why, and keeps the weights-only
    folder; asked for by load_step, or with nothing else to resume from, it is refused by name."""
    from tests.utils import fresh_seed

    base = str(tmp_path / "checkpoint")
    for step, only in ((2, False), (4, False), (6, True)):
        _dcp_checkpoint(base, step, model_only=only, seed=fresh_seed(300 + step))
    os.unlink(os.path.join(_dcp_checkpoint(base, 7, model_only=False, seed=fresh_seed(307)), integrity.MANIFEST))
    assert integrity.model_only(os.path.join(base, "step-6"))
    assert not integrity.model_only(os.path.join(base, "step-4"))
    resume = integrity.choose_step(base, -1, fallback=False, rank=0, world=1)
    assert (resume.step, resume.incomplete) == (4, (7,))
    for part in (os.path.join(base, "step-6"), "weights alone", "last_save_model_only", os.path.join(base, "step-4")):
        assert part in resume.note, f"{part!r} missing from: {resume.note}"
    assert os.path.isdir(os.path.join(base, "step-6"))
    _flip_byte(os.path.join(base, "step-4", "__0_0.distcp"), 7)        # the fallback passes it over too
    resume = integrity.choose_step(base, -1, fallback=True, rank=0, world=1)
    assert resume.step == 2 and "weights alone" in resume.note and os.path.join(base, "step-2") in resume.note
    with pytest.raises(ValueError) as info:
        integrity.choose_step(base, 6, fallback=False, rank=0, world=1)
    for part in ("checkpoint.load_step = 6", os.path.join(base, "step-6"), "--checkpoint.initial_load_path",
                 "--checkpoint.initial_load_model_only", "--checkpoint.no-last_save_model_only"):
        assert part in str(info.value), f"{part!r} missing from: {info.value}"
    only = str(tmp_path / "only")
    _dcp_checkpoint(only, 3, model_only=True, seed=fresh_seed(303))
    with pytest.raises(ValueError, match="holds no checkpoint to resume from"):   # not a fresh start over it
        integrity.choose_step(only, -1, fallback=False, rank=0, world=1)
    _dcp_checkpoint(only, 0, model_only=True, seed=fresh_seed(310))   # torchtitan's seed checkpoint: its model
    assert integrity.choose_step(only, -1, fallback=False, rank=0, world=1).step == 0


def test_a_roll_back_sets_the_newer_checkpoints_aside(tmp_path):
    """checkpoint.load_step older than the newest (a roll-back, the advice after a divergence or a damaged
    checkpoint) left the abandoned history's newer `step-N` folders in place: a run rolled back to step 2,
    then stopped after saving step 5, resumed next time from the old step 6. Those folders now move aside
    (`superseded-N`, kept), said in one line; incomplete and weights-only folders are left to their rules."""
    from tests.utils import fresh_seed

    base = str(tmp_path / "checkpoint")
    for step, only in ((2, False), (4, False), (6, False), (7, True)):
        _dcp_checkpoint(base, step, model_only=only, seed=fresh_seed(330 + step))
    os.unlink(os.path.join(_dcp_checkpoint(base, 8, model_only=False, seed=fresh_seed(338)), integrity.MANIFEST))
    assert integrity.choose_step(base, -1, fallback=False, rank=0, world=1).superseded == ()
    resume = integrity.choose_step(base, 2, fallback=False, rank=0, world=1)
    assert (resume.step, resume.superseded, resume.incomplete) == (2, (6, 4), ())
    moved = integrity.set_aside(base, resume.superseded, rank=0, world=1, name=integrity.SUPERSEDED)
    assert moved == [os.path.join(base, "superseded-6"), os.path.join(base, "superseded-4")]
    assert integrity.step_folders(base) == [2, 7, 8]
    note = integrity.describe_superseded(base, resume.superseded, moved, resume.step)
    assert "\n" not in note and "checkpoint.load_step = 2" in note and all(m in note for m in moved), note
    _dcp_checkpoint(base, 5, model_only=False, seed=fresh_seed(335))   # the rolled-back run's own save
    assert integrity.choose_step(base, -1, fallback=False, rank=0, world=1).step == 5


def test_a_missing_key_is_read_off_dcps_message_not_its_traceback(tmp_path):
    """DCP's CheckpointException carries each rank's traceback, whose source line reads
    `raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")`: the refusal named '{fqn}.")'."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from mop_train.train.checkpoint import missing_key
    from tests.utils import fresh_seed

    g = torch.Generator().manual_seed(fresh_seed(320))
    folder = str(tmp_path / "step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model.w": torch.randn(4, generator=g)}, checkpoint_id=folder, no_dist=True)
        with pytest.raises(CheckpointException) as info:
            dcp.load({"model.w": torch.randn(4, generator=g), "optimizer.state.w.exp_avg": torch.randn(4, generator=g)},
                     checkpoint_id=folder, no_dist=True)
    assert missing_key(str(info.value)) == "optimizer.state.w.exp_avg"
    assert missing_key("nothing of the kind") is None


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_dump_folder_lock_names_the_holder_and_replaces_stale_ones(tmp_path):
    first = DumpFolderLock(str(tmp_path))
    assert first.acquire() is None
    with pytest.raises(DumpFolderLocked) as info:     # held by a live process (this one)
        DumpFolderLock(str(tmp_path)).acquire()
    assert socket.gethostname() in str(info.value) and f"pid {os.getpid()}" in str(info.value)
    first.release()
    assert not os.path.exists(first.path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    with open(first.path, "w") as f:
        f.write(f"{socket.gethostname()} {dead}\n")
    lock = DumpFolderLock(str(tmp_path))
    note = lock.acquire()
    assert note is not None and "stale" in note and dead in note
    assert lock.holder() == (socket.gethostname(), os.getpid())
    lock.release()


def test_fault_spec():
    assert Fault.from_env({}) is None
    fault = Fault.from_env({"MOP_TRAIN_FAULT": "nan_grad:3,5:1:layers.1"})
    assert fault.fires(5, 1, "nan_grad") and not fault.fires(4, 1, "nan_grad") and not fault.fires(5, 0, "nan_grad")
    assert fault.name == "layers.1"


def _a2a_worker(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    from mop_train.ops.moe_dispatch import comm
    from mop_train.train.reliability import SplitMismatch, install_a2a_split_check

    install_a2a_split_check()
    send = [r + rank + 1 for r in range(world)]            # rank s sends s + d + 1 rows to rank d
    recv = [rank + s + 1 for s in range(world)]            # the transpose: what each rank expects
    rows = torch.arange(sum(send), dtype=torch.float32)[:, None]
    (out,) = comm.all_to_all([rows], send, recv, dist.group.WORLD)
    assert out.shape[0] == sum(recv)
    if rank == 1:
        recv = [*recv[:-1], recv[-1] + 1]                   # injected: rank 1 expects a row too many
    try:
        comm.all_to_all([rows], send, recv, dist.group.WORLD)
    except SplitMismatch as err:
        expected = f"rank 1 expects {world + 2} rows from rank {world - 1}, which sends {world + 1}"
        assert expected in str(err), str(err)
    else:
        raise AssertionError("the mismatch went through")


class _StubManager:
    """What Checkpointer uses of torchtitan's CheckpointManager."""
    enable, load_only, last_save_model_only = True, False, False

    def __init__(self, folder, model):
        self.folder, self.model, self.saved = folder, model, []

    def _should_save(self, step, last_step=False):
        return True

    def _create_checkpoint_id(self, step):
        return os.path.join(self.folder, f"step-{step}")


def _guards_worker(rank: int, world: int, folder: str) -> None:
    import torch

    from mop_train.train.checkpoint import Checkpointer
    from mop_train.train.reliability import NonFiniteError, NonFiniteGuard

    class Rel:
        on_nonfinite, max_consecutive_skips = "stop", 10

    _a2a_worker(rank, world)
    guard = NonFiniteGuard(Rel, rank=rank, world=world, device=torch.device("cpu"))
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.zeros_like(model.weight)
    model.bias.grad = torch.full_like(model.bias, float("nan") if rank == 1 else 0.0)
    loss = torch.tensor(float("nan") if rank == world - 1 else 1.0)
    verdict = guard.check(loss, torch.tensor(1.0), stop_requested=rank == 0)
    assert verdict.skip and verdict.loss_ranks == (world - 1,) and verdict.stop_requested
    try:
        guard.after(verdict, step=7, named_params=list(model.named_parameters()))
    except NonFiniteError as err:
        for part in ("step 7", f"loss on rank(s) [{world - 1}]", "first non-finite gradient: bias (rank 1)",
                     "No checkpoint of this run has been saved"):
            assert part in str(err), str(err)
        assert "holds finite state" not in str(err) and err.agreed
    else:
        raise AssertionError("on_nonfinite = 'stop' did not stop")
    # A non-finite state is neither saved nor taken from a checkpoint.
    ckpt = Checkpointer(_StubManager(folder, model), model=model, optimizers=[], device=torch.device("cpu"),
                        fallback=False)
    with torch.no_grad():
        model.weight[0, 0] = float("inf") if rank == 1 else 0.0
    try:
        ckpt.save(3)
    except CheckpointError as err:
        assert "not saving" in str(err) and err.exit_code == 4
    else:
        raise AssertionError("a non-finite state was saved")


@pytest.mark.parametrize("world", [3])
def test_guards_across_ranks(world, tmp_path):
    """One spawn: all-to-all splits that disagree raise on every rank; a NaN on one rank stops every
    rank naming the step, the ranks and the parameter; a non-finite state is not saved."""
    from tests.dist_utils import run_distributed

    run_distributed(_guards_worker, world, str(tmp_path))


def test_checkpoint_loads_run_no_code(tmp_path):
    """Dataloader state with a global in its pickle is refused; non-tensor entries load weights-only."""
    import io
    import pickle

    import torch

    from mop_train.train.checkpoint import SafeDataloaderState, TrainState

    class Loader:
        loaded = None

        def state_dict(self):
            return {"dp_rank_0": pickle.dumps({"_num_yielded": 3, "buf": [1, 2]}), "world_size": 1}

        def load_state_dict(self, sd):
            self.loaded = sd

    loader = Loader()
    safe = SafeDataloaderState(loader)
    safe.load_state_dict(safe.state_dict())
    assert loader.loaded is not None
    evil = {"dp_rank_0": pickle.dumps({"x": os.getcwd}), "world_size": 1}   # os.getcwd: a global
    with pytest.raises(CheckpointError, match="posix.getcwd|os.getcwd"):
        safe.load_state_dict(evil)
    state = TrainState(rank=0).state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert set(torch.load(buf, weights_only=True)) == set(state)   # tensors only: loads weights-only
